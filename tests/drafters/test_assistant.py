"""Gemma 4's assistant named as --draft PATH (specexec/drafters/assistant.py, specexec/network/assistant.py): a
tiny Gemma 4 target (6 layers: sliding and full ones, the last two reading earlier layers' K/V, per-layer inputs)
and assistants written by transformers (3 layers of width 48, the plain tied head and the ordered-embedding one).
Its logits and the state it hands on equal transformers' Gemma4AssistantForCausalLM fed as transformers'
candidate generator feeds it (the target's K/V from its own pass, two levels deep, the context past the window);
fp32 greedy output equals the target alone with every drafting builder, resident and --offload ssd; a mismatch
with the target is one line, exit 2, before any weight loads."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cli.main import main
from specexec.builders.registry import builder_needs_draft, names
from specexec.checkpoints.loading import load_model
from specexec.config import EngineConfig, OffloadConfig
from specexec.drafters.choose import choose, load_drafter
from specexec.drafters.registry import parse_draft
from specexec.network.model import TreeMask
from specexec.runtime.assembly import Runtime
from tests.drafters.drafter_writer import write_gemma4_assistant
from tests.tiny_models import family_model, prompt

pytest.importorskip("specexec.families.gemma4", reason="the Gemma 4 family is not in this tree")
F32 = EngineConfig(dtype="float32", max_new_tokens=16, budget=12)
DRAFTING = [b for b in names() if builder_needs_draft(b)]


@pytest.fixture(scope="module")
def gemma4(tiny_root: Path) -> Path:
    return family_model(tiny_root, "gemma4")


@pytest.fixture(scope="module", params=[False, True], ids=["tied", "ordered"])
def assistant(request, gemma4: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gemma4_assistant(tmp_path_factory.mktemp("assistant") / "a", gemma4, seed=int(request.param),
                                  ordered=request.param)


@torch.no_grad()
def test_logits_and_state_equal_transformers(gemma4: Path, assistant: Path) -> None:
    from transformers import AutoModelForCausalLM, Gemma4AssistantForCausalLM

    hf_target = AutoModelForCausalLM.from_pretrained(gemma4, dtype=torch.float32).eval()
    hf = Gemma4AssistantForCausalLM.from_pretrained(assistant, dtype=torch.float32).eval()
    target = load_model(gemma4, "cpu", "float32")
    ours, _ = load_drafter(choose(parse_draft(str(assistant)), gemma4, target.args), target, torch.float32, torch.device("cpu"))
    ids = torch.tensor(prompt(15))                                   # past the window of 6
    n = ids.numel() - 1
    out = hf_target(ids[None, :n], output_hidden_states=True, return_shared_kv_states=True, use_cache=True)
    cache = target.new_cache(n + 4)
    hidden = target(ids[None, :n], torch.arange(n)[None], TreeMask(0), cache)
    cache.advance(n)
    ours.attend_to(cache)
    state_hf, state = out.hidden_states[-1][:, -1:], ours.read_target(hidden[0, -1:], None)[None]
    torch.testing.assert_close(state[..., :target.args.dim], state_hf, rtol=1e-4, atol=1e-4)
    token = ids[None, n:]
    for _level in range(2):                                          # the recursion: its own state, same position
        embeds = torch.cat([hf_target.get_input_embeddings()(token), state_hf], dim=-1)
        got = hf(inputs_embeds=embeds, position_ids=torch.tensor([[n]]), shared_kv_states=out.shared_kv_states)
        state = ours(token, torch.tensor([[n]]), states=state)
        torch.testing.assert_close(ours.logits(state), got.logits[0].float(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(state[..., :target.args.dim], got.last_hidden_state, rtol=1e-4, atol=1e-4)
        token, state_hf = got.logits.argmax(-1), got.last_hidden_state


def _same_as_alone(target: Path, draft: Path, config: EngineConfig, offload: OffloadConfig) -> None:
    rt = Runtime.load(str(target), str(draft), config, offload=offload)
    try:
        alone = rt.variant(config, use_draft=False)
        for ids in (prompt(14), [prompt(3)[0]]):
            assert [t for s in rt.generate_ids(ids, 16) for t in s] == [t for s in alone.generate_ids(ids, 16)
                                                                        for t in s]
    finally:
        rt.engine.close()


@pytest.mark.parametrize("builder", DRAFTING)
def test_greedy_equals_the_target_alone(gemma4, assistant, tmp_path, builder: str) -> None:
    _same_as_alone(gemma4, assistant, F32.replace(builder=builder), OffloadConfig(cache_dir=str(tmp_path)))


@pytest.mark.slow
@pytest.mark.parametrize("builder", ["specexec", "dynamic", "rsd"])
def test_greedy_equals_the_target_alone_offloaded(gemma4, assistant, tmp_path, builder: str) -> None:
    _same_as_alone(gemma4, assistant, F32.replace(builder=builder),
                   OffloadConfig(offload="ssd", cache_dir=str(tmp_path), quant="none"))


@pytest.mark.parametrize("case", ["hidden", "vocab", "target"])
def test_an_assistant_that_does_not_fit_the_target_is_one_line(capsys, gemma4, tiny_pair, tmp_path,
                                                              case: str) -> None:
    path = write_gemma4_assistant(tmp_path / "a", gemma4)
    cfg = json.loads((path / "config.json").read_text())
    model = gemma4
    if case == "hidden":
        cfg["backbone_hidden_size"] = 96
    elif case == "vocab":
        cfg["text_config"]["vocab_size"] = 512
    else:
        model = tiny_pair[0]
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "model.safetensors").write_bytes(b"")                  # never read: the check comes first
    code = main(["generate", "--model", str(model), "--draft", str(path), "--prompt", "hi",
                 "--cache-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "assistant" in err, err


def test_plan_counts_its_layers_and_no_cache_of_its_own(capsys, gemma4, assistant) -> None:
    assert main(["plan", "--model", str(gemma4), "--draft", str(assistant), "--gpu-memory", "24GB",
                 "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "gemma4-assistant: 3 decoder layer(s)" in out and "none: it attends to the target's K/V" in out, out


@torch.no_grad()
def test_a_draft_pass_makes_no_host_sync_and_bounds_its_gather(gemma4: Path, assistant: Path, monkeypatch) -> None:
    """Issue 62, finding 2. Budget: 0 host syncs per draft pass and its logits (the centroid head's floor stays
    on the device; it was float(picked.min()), one per pass), counted the CUDA way (tests/sync_count.py). The
    head's gathered rows [rows, k * per, D] come in steps of at most GATHER_BYTES: one row a step gives the
    same logits. (The attention, now folding queries per KV head, is held to transformers' by the test above.)"""
    from specexec.network import assistant as module
    from tests.sync_count import SyncCounter

    target = load_model(gemma4, "cpu", "float32")
    ours, _ = load_drafter(choose(parse_draft(str(assistant)), gemma4, target.args), target, torch.float32,
                           torch.device("cpu"))
    ids = torch.tensor(prompt(15))
    n = ids.numel()
    cache = target.new_cache(n + 4)
    hidden = target(ids[None], torch.arange(n)[None], TreeMask(0), cache)
    cache.advance(n)
    ours.attend_to(cache)
    state = ours.read_target(hidden[0, -3:], None)[None]                      # 3 rows
    tokens, pos = ids[None, -3:], torch.full((1, 3), n)
    with SyncCounter() as c:
        state = ours(tokens, pos, states=state)
        logits = ours.logits(state)
    assert c.total == 0, c.ops
    monkeypatch.setattr(module, "GATHER_BYTES", 1)
    assert module.gather_rows(64, 48, 4) == 1
    torch.testing.assert_close(ours.logits(state), logits, rtol=0, atol=1e-6)

