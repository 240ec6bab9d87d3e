"""Reliability tests: hostile inputs through the real CLI (bad checkpoints, configs, flags, prompts, endless and
hostile files) and seeded fuzzing of every format the loaders read."""
