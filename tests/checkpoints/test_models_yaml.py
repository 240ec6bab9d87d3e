"""models.yaml: the shipped catalogue, its checks (unknown keys and bad values are one-line errors), name
resolution (a path always wins; $SPECEXEC_MODEL_DIRS; recommended draft/budget as defaults) and
`specexec models`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.main import main
from specexec.options import ConfigError
from specexec.checkpoints.loading import resolve_model_path
from specexec.checkpoints.catalog import CATALOG_ENV, DIRS_ENV, find, load_catalog, parse_catalog

ROOT = Path(__file__).resolve().parents[2]
CATALOG = ROOT / "specexec" / "checkpoints" / "models.yaml"     # the one catalogue, shipped in the package

ENTRY = """\
version: 1
models:
  tiny-target:
    hub: test-org/Tiny-Target
    family: llama
    params: 1M
    drafts: [tiny-draft]
    budget: 16
    quant: none
  tiny-draft:
    hub: test-org/Tiny-Draft
    family: llama
    params: 0.5M
"""


def test_shipped_catalogue_has_the_recommended_pairs() -> None:
    cat = load_catalog(CATALOG)
    pairs = {e.name: e.drafts for e in cat}
    assert {"llama-3.1-8b-instruct", "llama-3.2-1b-instruct"} <= set(pairs["llama-3.1-70b-instruct"])
    assert {"qwen2.5-7b-instruct", "qwen2.5-0.5b-instruct"} <= set(pairs["qwen2.5-72b-instruct"])
    assert "llama-2-7b-chat" in pairs["llama-2-70b-chat"]
    assert pairs["qwen2.5-coder-1.5b-instruct"] == ("qwen2.5-coder-0.5b-instruct",)
    assert cat.get("Qwen/Qwen2.5-72B-Instruct").name == "qwen2.5-72b-instruct"     # a Hub id finds it too
    assert cat.get("LLAMA-3.1-70B-INSTRUCT") is not None                          # names are case-blind
    assert {e.family for e in cat} == {"llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral", "gpt_oss",
                                       "gemma2", "gemma3", "phi3", "glm4_moe", "minimax_m2", "deepseek_v3", "gemma4",
                                       "qwen3_next", "qwen3_5_moe"}                  # the 2026 hybrids too
    for name in ("glm-4.5-air", "glm-4.6", "minimax-m2", "deepseek-v3", "kimi-k2-instruct", "gemma-4-31b-it",
                 "qwen3-next-80b-a3b", "qwen3.5-35b-a3b"):
        assert pairs[name] == ("self",), name                         # no small model of their tokenizer
    assert pairs["qwen3-30b-a3b"] == ("qwen3-0.6b",)                             # a dense draft for an MoE target
    assert pairs["gpt-oss-120b"] == ("gpt-oss-20b",)
    assert pairs["mixtral-8x7b-instruct-v0.1"] == ("mistral-7b-instruct-v0.2",)
    assert pairs["gemma-2-27b-it"] == ("gemma-2-2b-it",) and pairs["gemma-3-27b-it"] == ("gemma-3-1b-it",)
    assert pairs["phi-4"][0] == "qwenphi-4-0.5b-draft"
    assert all(e.quant == "nf4" for e in cat if e.params in ("70B", "72B"))


BAD = {
    "unknown entry key": ("    quant: none\n", "    quant: none\n    colour: blue\n", "unknown key 'colour'"),
    "unknown top key": ("version: 1\n", "version: 1\nextra: 3\n", "unknown top-level key 'extra'"),
    "bad family": ("family: llama\n    params: 1M", "family: gpt2\n    params: 1M", "family 'gpt2'"),
    "bad quant": ("    quant: none\n", "    quant: int3\n", "quant 'int3'"),
    "budget zero": ("budget: 16", "budget: 0", "budget"),
    "budget type": ("budget: 16", "budget: many", "budget must be a int"),
    "missing draft": ("drafts: [tiny-draft]", "drafts: [nobody]", "'nobody', which is not an entry"),
    "draft of another tokenizer": ("family: llama\n    params: 0.5M", "family: llama\n    tokenizer: other\n    params: 0.5M",
                                   "cannot draft with 'tiny-draft' (tokenizer other vs llama)"),
    "missing hub": ("    hub: test-org/Tiny-Target\n", "", "missing key 'hub'"),
    "bad version": ("version: 1", "version: 2", "version must be 1"),
    "not yaml": ("models:", "models: [", "not valid YAML"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_catalogues_are_one_line_errors(case: str) -> None:
    old, new, message = BAD[case]
    assert old in ENTRY
    with pytest.raises(ConfigError) as info:
        parse_catalog(ENTRY.replace(old, new, 1), "my.yaml")
    text = str(info.value)
    assert message in text and "my.yaml" in text and "\n" not in text.strip(), text


@pytest.fixture
def catalogue(tmp_path, monkeypatch, tiny_pair, tiny_perturbed_draft) -> Path:
    """A catalogue of the tiny pair, present under $SPECEXEC_MODEL_DIRS as tiny-target / Tiny-Draft."""
    path = tmp_path / "models.yaml"
    path.write_text(ENTRY, encoding="utf-8")
    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny-target").symlink_to(tiny_pair[0])
    (models / "Tiny-Draft").symlink_to(tiny_perturbed_draft)          # found by the Hub id's last part
    monkeypatch.setenv(CATALOG_ENV, str(path))
    monkeypatch.setenv(DIRS_ENV, str(models))
    return models


def test_names_resolve_and_a_path_wins(catalogue, tmp_path, monkeypatch) -> None:
    assert resolve_model_path("tiny-target") == (catalogue / "tiny-target").resolve()
    assert resolve_model_path("test-org/Tiny-Draft") == (catalogue / "Tiny-Draft").resolve()
    local = tmp_path / "cwd"
    (local / "tiny-target").mkdir(parents=True)
    monkeypatch.chdir(local)
    assert find("tiny-target") is None                                    # an existing directory is a path
    assert resolve_model_path("tiny-target") == (local / "tiny-target").resolve()


def test_absent_name_says_where_it_looked(catalogue, monkeypatch, capsys) -> None:
    monkeypatch.setenv(DIRS_ENV, "")
    code = main(["generate", "--model", "tiny-target", "--no-draft", "--prompt", "x"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert "test-org/Tiny-Target" in err and "not on this machine" in err


def test_model_name_brings_its_draft_and_budget(catalogue, capsys) -> None:
    assert main(["generate", "--model", "tiny-target", "--prompt", "Hello", "--max-new-tokens", "6", "--json"]) == 0
    captured = capsys.readouterr()
    stats = json.loads(captured.out)["stats"]
    assert stats["builder"] == "specexec" and stats["budget"] == 16
    assert "draft tiny-draft" in captured.err and "budget 16" in captured.err
    assert main(["generate", "--model", "tiny-target", "--no-draft", "--prompt", "Hello", "--max-new-tokens", "4",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["builder"] == "none"


def test_models_command_lists_local_presence(catalogue, capsys) -> None:
    assert main(["models", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    rows = {r["name"]: r for r in obj["models"]}
    assert set(rows) == {"tiny-target", "tiny-draft", "demo", "demo-draft"}        # the demo's pair, always
    assert rows["tiny-target"]["local_path"] and rows["tiny-target"]["drafts"] == ["tiny-draft"]
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "tiny-target" in out and "yes" in out and "test-org/Tiny-Target" in out
    families = {f["family"]: f["architectures"] for f in obj["supported"]}
    assert families["gemma3"] == ["Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"]
    assert {"llama", "qwen3", "gemma2", "phi3"} <= set(families)
    assert "supported families" in out and "Phi3ForCausalLM" in out


def test_models_command_on_the_shipped_catalogue(monkeypatch, capsys) -> None:
    monkeypatch.delenv(CATALOG_ENV, raising=False)
    monkeypatch.setenv(DIRS_ENV, "")
    assert main(["models", "--json", "--catalog", str(CATALOG)]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert len(obj["models"]) >= 20
    assert main(["models", "--catalog", str(ROOT / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_every_shipped_config_is_a_catalogue_entry_and_plan_reads_it_offline(monkeypatch, tmp_path, capsys) -> None:
    """specexec/checkpoints/configs/<name>/config.json ships with the package: `plan --model NAME` plans before
    anything is downloaded (an empty Hugging Face cache, offline), and says where its config.json came from."""
    from specexec.checkpoints.catalog import SHIPPED_CONFIGS

    entries = {e.name: e for e in load_catalog()}
    shipped = sorted(p.parent.name for p in SHIPPED_CONFIGS.glob("*/config.json"))
    assert len(shipped) >= 20 and set(shipped) <= set(entries)
    for name in ("qwen3.5-35b-a3b", "qwen3-next-80b-a3b"):                 # the 2026 hybrids, by name
        assert entries[name].shipped_config() == SHIPPED_CONFIGS / name
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["plan", "--model", "llama-3.1-70b-instruct", "--ram-budget", "64GB"]) == 0
    out = capsys.readouterr().out
    assert ("config.json of --model llama-3.1-70b-instruct: the copy shipped with specexec (nothing downloaded)"
            in out), out
    assert main(["plan", "--model", "qwen3.5-35b-a3b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recurrent_state_bytes"] > 0


def test_the_models_table_fits_a_terminal_and_cuts_no_name() -> None:
    import io

    from rich.console import Console

    from cli.catalog import rows, table

    found = rows(load_catalog())
    for width in (100, 160):
        console = Console(width=width, record=True, file=io.StringIO())
        console.print(table(found, "shipped", width))
        text = console.export_text()
        assert max(len(line) for line in text.splitlines()) <= width, width
        assert all(r["name"] in text for r in found), width
    wide = Console(width=240, record=True, file=io.StringIO())
    wide.print(table(found, "shipped", 240))
    assert "meta-llama/Llama-3.1-70B-Instruct" in wide.export_text()          # a log or a pipe: everything
