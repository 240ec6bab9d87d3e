"""The wheel ships every package of the source tree: each folder of specexec/, cli/, offload/ and cpu_kernels/ that
holds an __init__.py is listed in pyproject.toml (a folder missing there installs from a checkout but not from a
wheel), and the data files the code opens are declared as package data; torch's floor is the oldest release with
every torch API the code calls."""
from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")           # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for top in ("specexec", "cli", "offload", "cpu_kernels")
             for p in (ROOT / top).rglob("__init__.py")}
    assert listed == found


def test_data_files_are_package_data() -> None:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "models.yaml" in data["specexec.checkpoints"] and (ROOT / "specexec/checkpoints/models.yaml").is_file()
    shipped = {p.suffix for p in (ROOT / "specexec/prompts").iterdir() if p.suffix != ".py" and p.is_file()}
    assert shipped and {f"*{s}" for s in shipped} <= set(data["specexec.prompts"])
    sources = [p for p in (ROOT / "cpu_kernels/csrc").iterdir() if p.suffix in (".c", ".h")]     # compiled on first use
    assert sources and all(any(p.match(glob) for glob in data["cpu_kernels"]) for p in sources)


def test_the_torch_floor_has_every_api_the_code_calls() -> None:
    """SDPAParams with seven arguments (enable_gqa) is torch 2.5's: an older torch raises a TypeError on the
    first CUDA attention. The floor in pyproject must be at least the release that brought it."""
    import re

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floor = next(tuple(int(x) for x in m.groups()) for d in deps if (m := re.fullmatch(r"torch>=(\d+)\.(\d+)", d)))
    calls = re.findall(r"SDPAParams\(([^()]*)\)", (ROOT / "specexec/network/attention.py").read_text())
    assert calls and all(len(c.split(",")) == 7 for c in calls)
    assert floor >= (2, 5), floor
