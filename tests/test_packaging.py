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
    configs = list((ROOT / "specexec/checkpoints/configs").glob("*/config.json"))    # plan by catalogue name, offline
    assert configs and all(any(p.relative_to(ROOT / "specexec/checkpoints").match(glob)
                               for glob in data["specexec.checkpoints"]) for p in configs)
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


def _readme_commands() -> list[str]:
    """Every line of the README's ```sh blocks, in order."""
    import re

    blocks = re.findall(r"```sh\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.DOTALL)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_ci_runs_the_readmes_test_command_verbatim() -> None:
    ci = (ROOT / ".ci/run").read_text().splitlines()
    marker = next(i for i, line in enumerate(ci) if "README's test command" in line)
    command = ci[marker + 1].strip()
    assert command.endswith("python3 -m pytest -q") and command in _readme_commands()


def test_readme_says_the_torch_build_before_the_first_install() -> None:
    """Whoever runs the README's commands in order on a machine without a GPU gets the CPU build of torch: its
    line comes before the first command that installs specexec (which would pull the default, CUDA, build)."""
    commands = _readme_commands()
    cpu = next(i for i, c in enumerate(commands) if "download.pytorch.org/whl/cpu" in c)
    first_install = next(i for i, c in enumerate(commands) if c.startswith("python3 -m pip install -e"))
    assert cpu < first_install
    quick = next(i for i, c in enumerate(commands) if c.endswith('pytest -q -m "not slow"'))
    assert quick < next(i for i, c in enumerate(commands) if c.endswith("pytest -q"))     # the quick loop first
