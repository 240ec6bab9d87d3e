"""`tools/gpu-wheels`: download, here, the wheels the lent GPU machine needs and lacks, into .whl/ (git-ignored).

The machine reaches no registry: a package the project requires that its image lacks (image.missing(), e.g.
bitsandbytes for NF4 on CUDA) travels as a wheel in the `run` call's `carry` (64 MiB per call with the
working tree). This runs the device README's `pip download` (py3.12, manylinux x86-64, no dependencies) for
each at the version installed here (else the newest), checks that what each wheel requires is on the image,
drops wheels of anything else, and prints the list and the total size. tools/gpu-check installs them there
(pip install --no-index --no-deps --target /tmp/site .whl/*.whl).

    tools/gpu-wheels            download what is missing and print the list
    tools/gpu-wheels --list     only print what .whl/ holds

Does not know: what the check does with them.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from tools.gpu_check import image

WHEELS = image.ROOT / ".whl"
CARRY_LIMIT = 64 << 20           # bytes a `run` call carries with the working tree
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")


def wheel_name(path: Path) -> str:
    return image.canonical(path.name.split("-")[0])


def requires(path: Path) -> list[str]:
    """What a wheel requires (no extras), canonical names."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    deps = [line.split(":", 1)[1] for line in lines if line.startswith("Requires-Dist:") and "extra ==" not in line]
    return [image.canonical(re.split(r"[<>=!~;\[ (]", d.strip(), maxsplit=1)[0]) for d in deps]


def download(package: str) -> None:
    try:
        spec = f"{package}=={importlib.metadata.version(package)}"
    except importlib.metadata.PackageNotFoundError:
        spec = package
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(WHEELS), spec]
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def report(required: list[str]) -> int:
    """Print the wheels, their size and what they need from the image; the number of problems."""
    wheels = sorted(WHEELS.glob("*.whl"))
    problems, total = 0, sum(w.stat().st_size for w in wheels)
    for w in wheels:
        lacking = [d for d in requires(w) if d not in image.IMAGE and d not in {wheel_name(x) for x in wheels}]
        print(f"  {w.name}  {w.stat().st_size / 2**20:.1f} MiB" + (f"  NEEDS {lacking}" if lacking else ""))
        problems += bool(lacking)
    names = [wheel_name(w) for w in wheels]
    for p in required:
        if p not in names:
            print(f"  MISSING: no wheel of {p}")
            problems += 1
    for p in {n for n in names if names.count(n) > 1}:
        print(f"  TWO VERSIONS of {p}: keep one (pip refuses the install)")
        problems += 1
    print(f"{len(wheels)} wheel(s), {total / 2**20:.1f} MiB in .whl/ (carry [\".whl\"]; {CARRY_LIMIT >> 20} MiB per call "
          "with the working tree)")
    return problems + (total > CARRY_LIMIT)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools/gpu-wheels", description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="only list what .whl/ holds")
    ns = p.parse_args(argv)
    required, optional = image.missing()
    print(f"the image lacks: required {required or 'nothing'}; optional (tests skip) {optional or 'nothing'}")
    if not ns.list:
        WHEELS.mkdir(exist_ok=True)
        for stale in [w for w in WHEELS.glob("*.whl") if wheel_name(w) not in required]:
            print(f"removing {stale.name} (not needed)")
            stale.unlink()
        for package in required:
            if not any(wheel_name(w) == package for w in WHEELS.glob("*.whl")):
                download(package)
    return 1 if report(required) else 0


if __name__ == "__main__":
    sys.exit(main())
