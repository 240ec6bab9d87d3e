"""--draft-layers auto measured (specexec/runtime/depth_probe.py): a shallower self-draft is a subset of the
planned one (the same modules, nothing copied); the probe's full-depth candidate over every layer of the target
agrees with it exactly; a Runtime without --draft-layers N runs the chosen depth, says it, reports it in
stats, stays exact, and gates when no depth pays; --draft-layers N still means N."""
from __future__ import annotations

import pytest
import torch

from specexec.builders.specexec import SpecExecBuilder
from specexec.checkpoints.loading import load_model
from specexec.config import EngineConfig, OffloadConfig
from specexec.decoding.engine import Engine
from specexec.runtime import depth_probe
from specexec.runtime.assembly import Runtime
from specexec.runtime.depth_probe import candidate_ids, probe_depths, probe_window
from specexec.runtime.self_draft import SelfDraft, build_self_draft
from specexec.tuning.depth import DepthChoice
from tests.runtime.self_draft_cli import self_draft_json
from tests.tiny_models import prompt

F32 = EngineConfig(budget=8, dtype="float32")


def _greedy(engine: Engine, ids: list[int], n: int = 20) -> list[int]:
    return [t for s in engine.generate(ids, n) for t in s]


def test_candidates_keep_the_first_and_last_planned_layer() -> None:
    ids = (0, 2, 5, 7, 9, 12, 14, 17, 19, 21, 24, 27)
    assert candidate_ids(ids, 12) == ids
    assert candidate_ids(ids, 2) == (0, 27)
    picked = candidate_ids(ids, 6)
    assert len(picked) == 6 and picked[0] == 0 and picked[-1] == 27 and set(picked) <= set(ids)


def test_a_subset_shares_the_drafts_modules_and_runs(tiny_pair) -> None:
    target = load_model(tiny_pair[0])
    draft = build_self_draft(target, (0, 1, 2, 3), "none")
    sub = draft.subset((0, 3))
    assert isinstance(sub, SelfDraft) and sub.layer_ids == (0, 3) and sub.args.n_layers == 2
    assert sub.layers[0] is draft.layers[0] and sub.layers[1] is draft.layers[3] and sub.shared == (0, 3)
    assert sub.embed_tokens is draft.embed_tokens and sub.norm is draft.norm
    w, v = sub.layers[1].self_attn.q_proj.weight, target.layers[3].self_attn.q_proj.weight
    assert w.data_ptr() == v.data_ptr()
    assert "_target" not in dict(sub.named_modules())          # the target is not a submodule
    assert sum(1 for _ in sub.parameters()) < sum(1 for _ in target.parameters())
    with pytest.raises(ValueError):
        draft.subset((3, 0))
    with pytest.raises(ValueError):
        build_self_draft(target, (0, 3), "none").subset((0, 2))
    ids = prompt(1)
    got = _greedy(Engine(target, sub, EngineConfig(budget=6), SpecExecBuilder()), ids)
    assert got == _greedy(Engine(target, None, EngineConfig(budget=1), None), ids)


def _pointers(block: torch.nn.Module) -> list[int]:
    return [t.data_ptr() for t in (*block.parameters(), *block.buffers())]


def test_a_subset_of_streamed_copies_reads_nothing_again(tiny_pair, tmp_path) -> None:
    off = OffloadConfig(offload="ssd", cache_dir=str(tmp_path), draft_layers=4)
    rt = Runtime.load(str(tiny_pair[0]), "self", F32, offload=off)
    try:
        draft = rt.engine.draft
        sub = draft.subset((0, 2, 3))
        assert sub.copies == (0, 2, 3) and sub.fmt == draft.fmt
        for j, i in enumerate((0, 2, 3)):
            assert _pointers(sub.layers[j]) == _pointers(draft.layers[i]) and sub.layers[j] is draft.layers[i]
    finally:
        rt.engine.close()


def test_the_full_depth_over_every_layer_agrees_with_the_target(tiny_pair) -> None:
    """A self-draft over all layers of a resident target is the target: agreement exactly 1; a skipping depth
    of a random network agrees less, and every candidate is timed."""
    target = load_model(tiny_pair[0])
    draft = build_self_draft(target, (0, 1, 2, 3), "none")
    gen = torch.Generator().manual_seed(0)
    window = torch.randint(0, target.args.vocab_size, (64,), generator=gen).tolist()
    samples, ref = probe_depths(target, draft, window, (4, 2))
    assert [s.depth for s in samples] == [4, 2] and samples[0].agreement == 1.0
    assert samples[1].agreement < 1.0 and all(s.draft_s > 0 for s in samples)
    assert ref.one_row_s > 0 and ref.predictions.numel() == 32 and ref.rest_rows == 28


def test_unquantized_streamed_copies_agree_with_the_streamed_target(tiny_pair, tmp_path) -> None:
    off = OffloadConfig(quant="none", offload="ssd", cache_dir=str(tmp_path), draft_layers=4)
    rt = Runtime.load(str(tiny_pair[0]), "self:none", F32, offload=off)
    try:
        samples, _ = probe_depths(rt.engine.target, rt.engine.draft, probe_window(rt.tokenizer), (4,))
        assert samples[0].agreement == 1.0
    finally:
        rt.engine.close()


def test_nothing_to_choose_keeps_the_plan(tiny_pair, tmp_path) -> None:
    """A resident 4-layer target: the plan drafts with half, 2 layers, the fewest a self-draft runs."""
    off = OffloadConfig(offload="auto", cache_dir=str(tmp_path), draft_layers="auto")
    rt = Runtime.load(str(tiny_pair[0]), "self", F32, offload=off)
    assert rt.plan.memory.draft_layers == (0, 3) and rt.depth is None and rt.engine.draft.layer_ids == (0, 3)


@pytest.mark.parametrize("layers,offload", [("auto", "ssd"), (None, "ssd"), ("auto", "ram")])
def test_auto_runs_the_chosen_depth_and_stays_exact(tiny_pair, tmp_path, layers, offload: str) -> None:
    said: list[str] = []
    off = OffloadConfig(offload=offload, cache_dir=str(tmp_path), draft_layers=layers)
    rt = Runtime.load(str(tiny_pair[0]), "self", F32, offload=off, progress=said.append)
    try:
        planned = rt.plan.memory.draft_layers
        choice = rt.depth
        assert choice is not None and choice.n_layers == 4 and 2 <= choice.depth <= len(planned)
        assert rt.engine.draft.layer_ids == candidate_ids(planned, choice.depth)
        assert rt.draft_info.args.n_layers == choice.depth
        assert any(s.startswith(f"draft depth {choice.depth} of 4: agreement ") for s in said)
        assert rt.config.gate == ("on" if choice.loses else "auto")
        for seed in (0, 3):
            ids = prompt(seed)
            got = [t for s in rt.generate_ids(ids, 20) for t in s]
            assert got == [t for s in rt.variant(F32, use_draft=False).generate_ids(ids, 20) for t in s]
        assert rt.stats()["draft_depth"] == choice.summary()
    finally:
        rt.engine.close()


def test_when_no_depth_pays_the_gate_is_on_with_a_fixed_budget(monkeypatch, tiny_pair, tmp_path) -> None:
    losing = DepthChoice(2, 4, 0.05, 1, tok_s=5.0, alone_tok_s=10.0)
    monkeypatch.setattr(depth_probe, "choose_depth", lambda *a, **k: losing)
    off = OffloadConfig(offload="ssd", cache_dir=str(tmp_path))
    rt = Runtime.load(str(tiny_pair[0]), "self", F32, offload=off)
    try:
        assert rt.config.gate == "on" and not rt.config.auto_budget and rt.engine.pilot is not None
        assert rt.engine.draft.args.n_layers == 2 and rt.stats()["draft_depth"]["loses"]
        ids = prompt(2)
        got = [t for s in rt.generate_ids(ids, 20) for t in s]
        assert got == [t for s in rt.variant(F32, use_draft=False).generate_ids(ids, 20) for t in s]
        assert rt.stats()["gate"]["plain_steps"] >= 1
        assert rt.variant(F32.replace(budget=4)).engine.pilot is not None        # a variant keeps the verdict
        assert rt.variant(F32, use_draft=False).engine.pilot is None
    finally:
        rt.engine.close()
    off_gate = Runtime.load(str(tiny_pair[0]), "self", F32.replace(gate="off"), offload=off)
    assert off_gate.config.gate == "off" and off_gate.engine.pilot is None      # --gate off stays off
    off_gate.engine.close()


def test_a_fixed_layer_count_is_not_probed(monkeypatch, tiny_pair, tmp_path) -> None:
    def never(*a, **k):
        raise AssertionError("--draft-layers N must not be probed")

    monkeypatch.setattr(depth_probe, "probe_depths", never)
    said: list[str] = []
    off = OffloadConfig(offload="ssd", cache_dir=str(tmp_path), draft_layers=3)
    rt = Runtime.load(str(tiny_pair[0]), "self", F32, offload=off, progress=said.append)
    try:
        assert rt.depth is None and rt.engine.draft.layer_ids == rt.plan.memory.draft_layers
        assert rt.engine.draft.args.n_layers == 3 and rt.config.gate == "auto"
        assert "draft_depth" not in rt.stats() and not any("draft depth" in s for s in said)
    finally:
        rt.engine.close()


def test_generate_json_reports_the_chosen_depth(capsys, tiny_pair, tmp_path) -> None:
    out, err, want = self_draft_json(capsys, tiny_pair[0], tmp_path, "--draft", "self", "--draft-layers", "auto")
    depth = out["stats"]["draft_depth"]
    assert out["token_ids"] == want and depth["of"] == 4 and 2 <= depth["layers"] <= 4
    assert f"draft depth {depth['layers']} of 4: agreement" in err


@pytest.mark.gpu
def test_on_cuda_the_probe_runs_on_the_gpu_and_stays_exact(tiny_pair, tmp_path) -> None:
    """CUDA (timed with the device synchronised): the chosen depth's draft is a subset of the planned one and
    fp32 greedy output equals the target alone."""
    off = OffloadConfig(offload="ssd", cache_dir=str(tmp_path), draft_layers="auto")
    config = EngineConfig(budget=8, dtype="float32", device="cuda")
    rt = Runtime.load(str(tiny_pair[0]), "self", config, offload=off)
    try:
        assert rt.depth is not None and set(rt.engine.draft.layer_ids) <= set(rt.plan.memory.draft_layers)
        ids = prompt(4)
        got = [t for s in rt.generate_ids(ids, 16) for t in s]
        assert got == [t for s in rt.variant(config, use_draft=False).generate_ids(ids, 16) for t in s]
    finally:
        rt.engine.close()
