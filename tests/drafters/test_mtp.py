"""--draft mtp: the MTP layer stored in the target's own checkpoint drafts for it (specexec/drafters/mtp.py).

A tiny GLM-4.5 and DeepSeek-V3 (the next-n layout: layer N = num_hidden_layers holds eh_proj, enorm, hnorm,
shared_head and a sparse decoder layer under the family's own names, latent attention for DeepSeek;
drafter_writer.write_nextn) and a tiny Qwen3.5-MoE and
Qwen3-Next (mtp.*: fc, the two pre-fc norms, a gated full-attention MoE layer, mtp.norm; write_qwen_mtp): the
drafter is that layer with all its experts, the target's embedding and LM head shared; fp32 greedy output equals
the target alone with every drafting builder, resident and --offload ssd. A checkpoint without MTP tensors
(transformers drops them on save, so the plain tiny GLM is one) is one line, exit 2, before any weight loads.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.main import main
from specexec.builders.registry import builder_needs_draft, names
from specexec.config import EngineConfig, OffloadConfig
from specexec.network.drafter import MtpDrafter
from specexec.runtime.assembly import Runtime
from tests.drafters.drafter_writer import write_nextn, write_qwen_mtp
from tests.tiny_models import hybrid_model, prompt

F32 = EngineConfig(budget=8, dtype="float32")
DRAFTING = [n for n in names() if builder_needs_draft(n)]


@pytest.fixture(scope="module")
def glm_mtp(tiny_glm4_moe: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_nextn(tiny_glm4_moe, tmp_path_factory.mktemp("mtp") / "glm")


@pytest.fixture(scope="module")
def deepseek_mtp(tiny_deepseek_v3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_nextn(tiny_deepseek_v3, tmp_path_factory.mktemp("mtp") / "deepseek")


@pytest.fixture(scope="module")
def qwen_mtp(tiny_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen-mtp")
    return {name: write_qwen_mtp(hybrid_model(tiny_root, name), root / name) for name in ("qwen3_5_moe", "qwen3_next")}


def test_the_drafter_is_the_next_n_layer_with_the_targets_embedding_and_head(glm_mtp) -> None:
    rt = Runtime.load(str(glm_mtp), "mtp", F32)
    drafter, target = rt.engine.draft, rt.engine.target
    assert drafter.embed_tokens is target.embed_tokens and drafter.lm_head is target.lm_head
    assert isinstance(drafter, MtpDrafter) and drafter.shape.mask_first and drafter.taps == ()
    experts = drafter.layers[0].mlp.experts
    assert len(experts) == target.args.moe.n_experts                     # an MoE's MTP layer: every expert
    assert rt.draft_info.args.n_layers == 1 and "mtp" in rt.draft_info.dtype


CASES = [(b, "none") for b in DRAFTING] + [pytest.param(b, "ssd", marks=() if b == "dynamic" else pytest.mark.slow)
                                           for b in DRAFTING]


def _same_as_alone(path: Path, config: EngineConfig, offload: OffloadConfig, prompts) -> None:
    rt = Runtime.load(str(path), "mtp", config, offload=offload)
    try:
        alone = rt.variant(config, use_draft=False)
        for ids in prompts:
            assert [t for s in rt.generate_ids(ids, 16) for t in s] == [t for s in alone.generate_ids(ids, 16)
                                                                        for t in s]
    finally:
        rt.engine.close()


@pytest.mark.parametrize("builder,offload", CASES)
def test_greedy_equals_the_target_alone(glm_mtp, tmp_path, builder: str, offload: str) -> None:
    _same_as_alone(glm_mtp, F32.replace(builder=builder), OffloadConfig(offload=offload, cache_dir=str(tmp_path),
                                                                        quant="none"), (prompt(21), [prompt(22)[0]]))


@pytest.mark.parametrize("builder,offload", [("specexec", "none"), ("rsd", "none"), ("dynamic", "ssd")])
def test_deepseek_mtp_greedy_equals_the_target_alone(deepseek_mtp, tmp_path, builder: str, offload: str) -> None:
    """DeepSeek-V3's next-n layer: latent attention (its own one-layer latent cache) and the routed experts."""
    _same_as_alone(deepseek_mtp, F32.replace(builder=builder),
                   OffloadConfig(offload=offload, cache_dir=str(tmp_path), quant="none"), (prompt(24),))


QWEN = [pytest.param("qwen3_5_moe", *c.values, marks=c.marks) if hasattr(c, "values") else ("qwen3_5_moe", *c)
        for c in CASES] + [("qwen3_next", "specexec", "none"), ("qwen3_next", "rsd", "none")]


@pytest.mark.parametrize("name,builder,offload", QWEN)
def test_qwen_mtp_greedy_equals_the_target_alone(qwen_mtp, tmp_path, name: str, builder: str, offload: str) -> None:
    _same_as_alone(qwen_mtp[name], F32.replace(builder=builder),
                   OffloadConfig(offload=offload, cache_dir=str(tmp_path), quant="none"), (prompt(23),))


@pytest.mark.parametrize("spec,needle", [
    ("mtp", "has no MTP layer to draft with (config.json names 1 MTP layer(s) but this copy of the checkpoint "
            "holds none of their tensors)"),
    ("mtp:x", "mtp reads the target's own checkpoint; write --draft mtp alone"),
    ("eagle3", "name the head's checkpoint, e.g. --draft eagle3:PATH"),
])
def test_bad_drafter_names_are_one_line(capsys, tiny_glm4_moe, tmp_path, spec: str, needle: str) -> None:
    code = main(["generate", "--model", str(tiny_glm4_moe), "--draft", spec, "--prompt", "hi",
                 "--cache-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and needle in err, err


def test_a_dense_model_without_mtp_is_one_line(capsys, tiny_pair, tmp_path) -> None:
    code = main(["generate", "--model", str(tiny_pair[0]), "--draft", "mtp", "--prompt", "hi"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "config.json names no MTP layer" in err and "\n" not in err, err


def test_generate_with_mtp_equals_no_draft(capsys, glm_mtp) -> None:
    common = ["generate", "--model", str(glm_mtp), "--prompt", "the cat", "--max-new-tokens", "10",
              "--dtype", "float32", "--json"]
    assert main([*common, "--draft", "mtp"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert main([*common, "--no-draft"]) == 0
    assert out["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]


def test_chat_without_a_draft_drafts_with_the_mtp_layer(monkeypatch, capsys, glm_mtp, tiny_glm4_moe) -> None:
    """specexec chat with no draft named: the MTP layer when the checkpoint has one (the answer is still the
    target's), the self-draft when it has none."""
    import io
    import sys
    from cli import args as cli_args
    from specexec.config import EngineConfig as Config

    for path, want in ((glm_mtp, "mtp"), (tiny_glm4_moe, "self")):
        ns = type("A", (), {"draft": None, "no_draft": False, "model": str(path)})()
        assert cli_args.check_draft(ns, Config(), default_self=True) and ns.draft == want
    common = ["--model", str(glm_mtp), "--max-new-tokens", "8", "--dtype", "float32"]
    assert main(["generate", *common, "--no-draft", "--chat", "--prompt", "Hello there", "--json"]) == 0
    expected = json.loads(capsys.readouterr().out)["text"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there\n"))
    assert main(["chat", *common]) == 0
    assert capsys.readouterr().out == expected + "\n"
