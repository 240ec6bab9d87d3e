"""The wheel ships every package of the source tree: each folder of specexec/, cli/ and offload/ that holds an
__init__.py is listed in pyproject.toml (a folder missing there installs from a checkout but not from a wheel),
and the data files the code opens are declared as package data."""
from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")           # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for top in ("specexec", "cli", "offload")
             for p in (ROOT / top).rglob("__init__.py")}
    assert listed == found


def test_data_files_are_package_data() -> None:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "models.yaml" in data["specexec.runtime"] and (ROOT / "specexec/runtime/models.yaml").is_file()
    shipped = {p.suffix for p in (ROOT / "specexec/prompts").iterdir() if p.suffix != ".py" and p.is_file()}
    assert shipped and {f"*{s}" for s in shipped} <= set(data["specexec.prompts"])
    assert "*.c" in data["offload.quant.cpu_kernels"] and (ROOT / "offload/quant/cpu_kernels/kernels.c").is_file()
