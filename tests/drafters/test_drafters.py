"""Drafters that read the target (--draft eagle3:PATH; specexec/network/drafter.py, specexec/drafters/).

The maths: a tiny random EAGLE-3 head written in its published layout (tests/drafters/drafter_writer.py) computes
what a plain-torch reading of the published description computes, on the target's tapped states, in both layouts (the
EAGLE repository's midlayer.* and speculators' layers.0.*), and deeper tree levels read the drafter's own output
(a chain's tokens are the recursive reference's argmax chain). Exactness: fp32 greedy output equals the target
alone with every builder that drafts, resident and --offload ssd, a reused chat prefix and a one-token prompt
included; sampling keeps the target's distribution (chi-square). Bad input: one line, exit 2, before any weight
loads.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cli.main import main
from specexec.builders.registry import builder_needs_draft, make_builder, names
from specexec.checkpoints.loading import load_model
from specexec.config import EngineConfig, OffloadConfig, SamplingParams
from specexec.drafters.choose import choose, load_drafter
from specexec.drafters.registry import parse_draft
from specexec.decoding.engine import Engine
from specexec.runtime.assembly import Runtime
from tests.sampling.chi2 import chi2_pvalue
from tests.drafters.drafter_writer import eagle3_reference, write_eagle3
from tests.sampling.sampling_pairs import exact_pairs, sample_pairs
from tests.sync_count import SyncCounter, count_calls
from tests.tiny_models import prompt

F32 = EngineConfig(budget=8, dtype="float32")
DRAFTING = [n for n in names() if builder_needs_draft(n)]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def head(tiny_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An EAGLE-3 head for the 4-layer tiny target: taps 0, 2 and 4 (the embedding, a middle layer's input and
    the last layer's output), its own 200-token vocabulary, the target's embedding."""
    return write_eagle3(tmp_path_factory.mktemp("eagle3") / "head")


def _drafter(target, path: Path):
    return load_drafter(choose(parse_draft(f"eagle3:{path}"), path, target.args), target, torch.float32, CPU)[0]


@torch.inference_mode()
@pytest.mark.parametrize("layout", ["eagle", "speculators"])
def test_eagle3_logits_are_the_published_computation(tiny_pair, tmp_path, layout: str) -> None:
    target = load_model(tiny_pair[0])
    path = write_eagle3(tmp_path / layout, speculators=layout == "speculators", seed=3)
    drafter = _drafter(target, path)
    assert drafter.taps == (0, 2, 4) and drafter.embed_tokens is target.embed_tokens
    ids = torch.tensor(prompt(0))
    target.run_as(replace(target.execution, taps=drafter.taps))
    hidden = target(ids[None], torch.arange(ids.numel())[None])[0]
    taps = [t[0] for t in target.tapped]
    assert torch.equal(taps[0], target.embed(ids[None])[0])
    states = drafter.read_target(hidden, taps)[:-1]                   # the state before tokens 1 .. T-1
    out = drafter(ids[None, 1:], torch.arange(ids.numel() - 1)[None], states=states[None])
    got = drafter.logits(out)
    want = eagle3_reference(path, target.embed_tokens.weight, ids[1:], [t[:-1] for t in taps])
    assert torch.equal(got.isinf(), want.isinf()) and (got.isinf().sum(-1) == 320 - 200).all()
    torch.testing.assert_close(got.nan_to_num(0, 0, 0), want.nan_to_num(0, 0, 0), rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_deeper_levels_read_the_drafters_own_output(tiny_pair, head) -> None:
    """A chain of 6 from the root: each level's token is the argmax of the reference applied to its own output
    state at the level above (the root's row reads the target's state)."""
    target = load_model(tiny_pair[0])
    drafter = _drafter(target, head)
    engine = Engine(target, drafter, F32.replace(budget=6, builder="chain"), make_builder("chain"))
    trees, build = [], engine.builder.build
    engine.builder.build = lambda *a, **k: trees.append(build(*a, **k)) or trees[-1]
    ids = prompt(5)
    next(engine.generate(ids, 1))
    hidden = target(torch.tensor(ids)[None], torch.arange(len(ids))[None])[0]      # taps still set
    taps = [t[0] for t in target.tapped]
    tokens, states = torch.tensor(ids[1:]), drafter.read_target(hidden, taps)[:-1]
    chain = []
    for _ in range(6):
        out = drafter(tokens[None], torch.arange(tokens.numel())[None], states=states[None])[0]
        chain.append(int(drafter.logits(out[-1:]).argmax()))
        tokens, states = torch.cat([tokens, torch.tensor(chain[-1:])]), torch.cat([states, out[-1:]])
    first = eagle3_reference(head, target.embed_tokens.weight, torch.tensor(ids[1:]), [t[:-1] for t in taps])
    assert chain[0] == int(first[-1].argmax())
    assert trees[0].tokens[1:].tolist() == chain


CASES = [(b, "none") for b in DRAFTING] + [pytest.param(b, "ssd", marks=() if b == "specexec" else pytest.mark.slow)
                                           for b in DRAFTING]


@pytest.mark.parametrize("builder,offload", CASES)
def test_greedy_equals_the_target_alone(tiny_pair, head, tmp_path, builder: str, offload: str) -> None:
    config = F32.replace(builder=builder)
    off = OffloadConfig(offload=offload, cache_dir=str(tmp_path), quant="none")
    rt = Runtime.load(str(tiny_pair[0]), f"eagle3:{head}", config, offload=off)
    try:
        alone = rt.variant(config, use_draft=False)
        for ids in ([prompt(9)[0]], prompt(8, 3), prompt(7)):
            got = [t for s in rt.generate_ids(ids, 20) for t in s]
            assert got == [t for s in alone.generate_ids(ids, 20) for t in s]
            assert rt.stats()["steps"] <= 20
        turn = prompt(7) + got + prompt(10, 4)              # a second turn: the shared prefix stays cached
        assert [t for s in rt.generate_ids(turn, 12) for t in s] == [t for s in alone.generate_ids(turn, 12)
                                                                     for t in s]
        assert rt.engine.stats.reused_tokens > len(prompt(7))
    finally:
        rt.engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("builder,verifier,temperature", [("specexec", "sample_match", 1.0), ("rsd", "rrs_wor", 0.7)])
def test_sampling_keeps_the_target_distribution(tiny_pair, head, builder: str, verifier: str,
                                                temperature: float) -> None:
    target = load_model(tiny_pair[0])
    engine = Engine(target, _drafter(target, head), EngineConfig(budget=4, verifier=verifier),
                    make_builder(builder))
    sampling = SamplingParams(temperature=temperature, top_p=0.95)
    counts = sample_pairs(engine, sampling, 320)
    assert chi2_pvalue(counts, exact_pairs(target, sampling)) > 1e-3


BAD = {
    "hidden size": (dict(target_dim=48), "reads target states of size 48, the target's hidden size is 64"),
    "vocabulary": (dict(vocab=300), "is for a vocabulary of 300 tokens, the target has 320"),
    "tapped layer": (dict(taps=(0, 2, 9)), "reads target layer 9, the target has 4 layers"),
    "layer count": (dict(num_hidden_layers=2), "has 2 decoder layers; an EAGLE-3 head has one"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_head_that_does_not_fit_the_target_is_one_line(capsys, tiny_pair, tmp_path, case: str) -> None:
    kwargs, needle = BAD[case]
    path = write_eagle3(tmp_path / "bad", **kwargs)
    code = main(["generate", "--model", str(tiny_pair[0]), "--draft", f"eagle3:{path}", "--prompt", "hi",
                 "--cache-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and needle in err, err


@pytest.mark.parametrize("offset", [10**6, -100])
def test_a_head_whose_d2t_leaves_the_targets_vocabulary_is_one_line(capsys, tiny_pair, tmp_path, offset) -> None:
    """d2t maps draft id i to target id i + d2t[i]: one past the target's vocabulary (or below 0) is one line at
    load (issue 55: 'internal error IndexError')."""
    from safetensors.torch import load_file, save_file

    path = write_eagle3(tmp_path / "bad-d2t")
    tensors = load_file(path / "model.safetensors")
    tensors["d2t"][7] = offset
    save_file(tensors, path / "model.safetensors")
    code = main(["generate", "--model", str(tiny_pair[0]), "--draft", f"eagle3:{path}", "--prompt", "hi",
                 "--cache-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and f"d2t maps draft token 7 to target token {7 + offset}" in err, err
    assert "outside the target's vocabulary of 320" in err


def test_generate_with_a_head_equals_no_draft(capsys, tiny_pair, head) -> None:
    common = ["generate", "--model", str(tiny_pair[0]), "--prompt", "the cat", "--max-new-tokens", "12",
              "--dtype", "float32", "--json"]
    assert main([*common, "--draft", f"eagle3:{head}", "--builder", "dynamic"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert main([*common, "--no-draft"]) == 0
    assert out["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]


@pytest.mark.parametrize("builder", ["specexec", "dynamic", "rsd"])
def test_at_most_one_host_sync_per_drafter_pass(tiny_pair, head, builder: str) -> None:
    target = load_model(tiny_pair[0])
    drafter = _drafter(target, head)
    engine = Engine(target, drafter, F32.replace(budget=24, builder=builder), make_builder(builder))
    counts, build = [], engine.builder.build

    def counted(draft, *args, **kwargs):
        with count_calls(drafter) as calls, SyncCounter() as syncs:
            tree = build(draft, *args, **kwargs)
        counts.append((calls[0], syncs.total, dict(syncs.ops)))
        return tree

    engine.builder.build = counted
    for sampling in (SamplingParams(), SamplingParams(temperature=0.8, seed=1)):
        list(engine.generate(prompt(11), 12, sampling))
    assert sum(p for p, _, _ in counts) > 10
    assert all(syncs <= passes for passes, syncs, _ in counts), counts


class Alternate:
    """A scripted gate: plain, speculative, plain, ... (tests a drafter's catch-up after plain steps)."""

    drafting = True

    def __init__(self) -> None:
        self.n = 0

    def next_plain(self) -> bool:
        self.n += 1
        return self.n % 3 != 0

    def observe(self, speculative: bool, tokens: int, seconds: float) -> None:
        return None

    def charge(self, seconds: float) -> None:
        pass


def test_plain_steps_between_drafted_ones_keep_the_target_output(tiny_pair, head) -> None:
    """With the gate on, the drafter sits out two steps of three; the tokens of the plain steps come back as
    pending with the target's states and the catch-up feeds them: output still the target alone's."""
    target = load_model(tiny_pair[0])
    engine = Engine(target, _drafter(target, head), F32.replace(gate="on"), make_builder("specexec"))
    engine.pilot.gate = Alternate()
    alone = Engine(target, None, F32, None)
    for ids in (prompt(12), [prompt(13)[0]]):
        assert [t for s in engine.generate(ids, 24) for t in s] == [t for s in alone.generate(ids, 24) for t in s]
    assert engine.stats.summary(8, "specexec")["gate"]["speculative_steps"] > 3


def test_a_head_by_hub_name_is_fetched_then_loaded(capsys, tiny_pair, head, tmp_path, monkeypatch) -> None:
    """--draft eagle3:ORG/NAME downloads the head (from a Hub stand-in on 127.0.0.1) into the Hugging Face cache
    and keeps its kind: the output is the target alone's."""
    from huggingface_hub import constants

    from tests.checkpoints.hub_server import LocalHub, serve, stop

    hub = LocalHub()
    hub.add_dir("tiny-org/eagle3-head", head)
    server, thread = serve(hub)
    try:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        for name in ("HF_HUB_OFFLINE", "HF_TOKEN", "HF_HUB_CACHE"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        common = ["generate", "--model", str(tiny_pair[0]), "--prompt", "the cat", "--max-new-tokens", "8",
                  "--dtype", "float32", "--json"]
        assert main([*common, "--draft", "eagle3:tiny-org/eagle3-head"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert any("model.safetensors" in r.path for r in hub.log)
        assert main([*common, "--no-draft"]) == 0
        assert out["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]
    finally:
        stop(server, thread)


def test_draft_vocab_does_not_apply_to_a_head(capsys, tiny_pair, head) -> None:
    code = main(["generate", "--model", str(tiny_pair[0]), "--draft", f"eagle3:{head}", "--draft-vocab", "64",
                 "--prompt", "hi"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--draft-vocab trims a draft model's head" in err and "\n" not in err, err
