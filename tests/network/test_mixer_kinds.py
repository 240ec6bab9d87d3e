"""A new token-mixer kind is one module + one row of network/mixers.MIXERS: a Mamba-2-like stub
(tests/network/stub_ssm.py: its args ride in ModelArgs.mixer_args, its state in a store of its own under kv's
generic protocol, its pass's bytes its own, its layers without a feed-forward) is built, planned and run on a
tiny hybrid through the registry alone: speculative greedy equals the target alone, fp32. A layer type no kind
serves is one line from the registry; a kind without a mixer makes a Block of its feed-forward alone.
"""
from __future__ import annotations

import pytest
import torch

from specexec.builders.registry import make_builder
from specexec.config import EngineConfig, ModelArgs
from specexec.decoding.engine import Engine
from specexec.network import mixers
from specexec.network.model import Block, Transformer
from specexec.options import ConfigError
from specexec.planning.sizes import forward_bytes
from tests.network import stub_ssm
from tests.tiny_models import prompt


def _args(**kw) -> ModelArgs:
    kw = {"n_layers": 2, "layer_types": (stub_ssm.NAME, "full_attention"), **kw}
    return ModelArgs(family="llama", vocab_size=320, dim=32, n_heads=2, n_kv_heads=1, head_dim=16,
                     intermediate_size=64, mixer_args=((stub_ssm.NAME, stub_ssm.StubArgs(24)),), **kw)


def _model(args: ModelArgs, seed: int) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(args)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        for block in model.layers:
            if block.mixer_attribute == "ssm":
                block.ssm.A_log.copy_(torch.linspace(-2, 1, block.ssm.A_log.numel()))
    model.init_rope(torch.device("cpu"))
    return model.eval()


@pytest.fixture
def with_stub(monkeypatch):
    monkeypatch.setattr(mixers, "MIXERS", mixers.MIXERS + (stub_ssm.KIND,))


def test_a_layer_type_no_kind_serves_is_one_line() -> None:
    with pytest.raises(ConfigError, match=f"unknown layer type '{stub_ssm.NAME}'; choose one of: full_attention"):
        Transformer(_args())


def test_the_stub_kind_is_built_and_planned_through_the_registry(with_stub) -> None:
    args = _args()
    block = Block(args, 0)
    assert isinstance(block.mixer, stub_ssm.StubSSM) and block.mlp is None          # no feed-forward: the kind's
    assert not hasattr(block, "post_attention_layernorm")
    assert mixers.fixed_layers(args) == (0,) and mixers.has_tree_plans(args)
    spec = stub_ssm.StubSpec(24)
    rows = mixers.cache_bytes(args, 40, 4, layers=[0], nodes=9)
    assert rows == spec.sequence_bytes() + spec.node_bytes() * 64                  # one ring of 64 scratch rows
    assert forward_bytes(args, 9, 40, 4, "none", "cpu", 1) > stub_ssm.PASS_BYTES   # its pass counted
    assert forward_bytes(replace_types(args), 9, 40, 4, "none", "cpu", 1) < stub_ssm.PASS_BYTES


def replace_types(args: ModelArgs) -> ModelArgs:
    from dataclasses import replace
    return replace(args, layer_types=("full_attention", "full_attention"))


@pytest.mark.parametrize("builder", ["specexec", "chain"])
def test_the_stub_kind_runs_exactly_through_the_engine(with_stub, builder: str) -> None:
    args = _args()
    target, draft = _model(args, 0), _model(args, 1)
    with torch.no_grad():                                      # a draft that agrees often: the target, perturbed
        for p, q in zip(draft.parameters(), target.parameters()):
            p.copy_(q + 0.02 * torch.randn_like(q))
    alone = Engine(target, None, EngineConfig(dtype="float32"), None)
    spec = Engine(target, draft, EngineConfig(budget=8, dtype="float32"), make_builder(builder))
    for ids in (prompt(3), prompt(5, 6)):
        want = [t for s in alone.generate(ids, 24) for t in s]
        assert [t for s in spec.generate(ids, 24) for t in s] == want
    assert len(spec.stats.steps) < 24 and len(set(want)) > 1                 # drafted tokens were accepted


def test_a_kind_without_a_mixer_is_its_feed_forward(monkeypatch) -> None:
    ffn_only = mixers.MixerKind("ffn_only", ("ffn_only",), "none", lambda args, layer: None,
                                lambda args, layer: None, lambda args, layer, slots, elem, quant: 0)
    monkeypatch.setattr(mixers, "MIXERS", mixers.MIXERS + (ffn_only,))
    args = replace_types(_args())
    from dataclasses import replace
    args = replace(args, layer_types=("ffn_only", "full_attention"))
    torch.manual_seed(0)
    block = Block(args, 0)
    assert block.mixer is None and not hasattr(block, "input_layernorm")
    x = torch.randn(1, 3, 32)
    want = x + block.mlp(block.post_attention_layernorm(x))
    assert torch.equal(block(x, None, None, None, None, 0, None), want)


def test_an_mtp_layer_is_of_the_models_attention_kind_whatever_its_recurrent_kinds(with_stub) -> None:
    from specexec.drafters.mtp import layer_args
    assert layer_args(_args()).layer_types == ("full_attention",)
    assert layer_args(_args(n_layers=3, layer_types=("full_attention", stub_ssm.NAME, stub_ssm.NAME))
                      ).layer_types == ("full_attention",)
