"""`specexec --version` and where the version shows (doctor, serve's /v1/models); the supported families come
from one source, the families registry: `specexec --help`, `specexec models` and the README's table all show a
module added to it, and the README's table is the one the registry makes."""
from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

import specexec
from cli import catalog
from cli.main import main
from specexec.families import registry
from tools import readme_families

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.filterwarnings("ignore")


def test_version_is_one_line_exit_0_and_is_the_packages(capsys) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr() == (f"specexec {specexec.__version__}\n", "")
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" in project["project"]["dynamic"]                        # one place: specexec.__version__
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "specexec.__version__"}


def test_doctor_and_serve_name_the_version() -> None:
    from cli import doctor
    from specexec.serving import openai_api

    assert doctor.version_report()["specexec"] == specexec.__version__
    card = openai_api.models_list("m", 0)["data"][0]
    assert card["specexec_version"] == specexec.__version__ and card["id"] == "m"


@pytest.fixture
def extra_family(monkeypatch: pytest.MonkeyPatch) -> str:
    """A family module added to the registry, as a new family's engineer adds one."""
    module = types.ModuleType("specexec.families.newfam", "Newfam: a decoder with a new trick. More text.")
    module.ARCHITECTURES = {"NewfamForCausalLM": "newfam"}
    monkeypatch.setattr(registry, "FAMILY_MODULES", (*registry.FAMILY_MODULES, module))
    registry.architectures.cache_clear()
    yield "newfam"
    registry.architectures.cache_clear()


def test_a_registered_family_shows_in_help_models_and_readme(extra_family, capsys) -> None:
    assert main(["--help"]) == 0
    assert extra_family in " ".join(capsys.readouterr().out.split())
    assert main(["models", "--json"]) == 0
    supported = json.loads(capsys.readouterr().out)["supported"]
    assert {"family": "newfam", "architectures": ["NewfamForCausalLM"]} in supported
    assert "| newfam | `NewfamForCausalLM` | Newfam: a decoder with a new trick |" in catalog.families_markdown()
    text = (ROOT / "README.md").read_text()
    assert "NewfamForCausalLM" in readme_families.rewritten(text) and "NewfamForCausalLM" not in text


def test_help_and_models_name_every_registered_family(capsys) -> None:
    families = [f for fams, _, _ in registry.summaries() for f in fams]
    assert len(families) >= 10
    assert main(["--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert all(f in help_text for f in families) and "Llama-family" not in help_text
    assert main(["models"]) == 0
    listed = capsys.readouterr().out
    assert all(f in listed for f in families)


def test_readme_table_is_the_registrys() -> None:
    text = (ROOT / "README.md").read_text()
    assert readme_families.rewritten(text) == text, "the README's families table is stale: run tools/readme-families"
    assert all(f"`{arch}`" in text for arch in registry.architectures())
