"""Developer tools run from the repository root (not shipped in the wheel): tools/gpu-check, tools/gpu-wheels,
tools/readme-families."""
