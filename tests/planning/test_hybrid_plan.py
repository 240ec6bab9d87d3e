"""Planning a hybrid (Gated DeltaNet + attention) target from config.json alone: the ledger counts the
linear-attention layers' recurrent state (per sequence, per tree node at the budget) on a line of its own and
K/V rows for the attention layers only; `plan --json` reports recurrent_state_bytes_per_node and
recurrent_state_bytes; and a real cache never holds more than the plan says.

Configs: specexec/checkpoints/configs/qwen3.5-35b-a3b (the published shapes of Qwen3.5-35B-A3B's text decoder),
qwen3-next-80b-a3b (Qwen3-Next-80B-A3B's), qwen3.5-122b-a10b-sized (a config of 122B-A10B's size: 48 layers of
3072, 256 experts of 1024 top-8, 64 value heads)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from specexec.checkpoints.catalog import SHIPPED_CONFIGS
from cli.main import main
from specexec.checkpoints.loading import load_model
from specexec.network.model import TreeMask
from specexec.planning.ledger import plan_memory
from specexec.planning.run_shape import RunShape
from specexec.tree import TokenTree

CONFIGS = SHIPPED_CONFIGS
Q35 = CONFIGS / "qwen3.5-35b-a3b"


def plan_json(capsys, *flags: str) -> dict:
    assert main(["plan", *flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_recurrent_state_is_counted_by_hand(capsys) -> None:
    """Qwen3.5-35B-A3B, NF4, a 12 GB card, 32 GB RAM, budget 64, 32k context: 30 linear-attention layers (16 key
    heads, 32 value heads of 128, a 4-tap convolution over 8192 channels) and 10 attention layers (2 KV heads of
    256)."""
    got = plan_json(capsys, "--model", str(Q35), "--gpu-memory", "12GB", "--ram-budget", "32GB", "--quant", "nf4",
                    "--budget", "64", "--context", "32768")
    state = 4 * (32 * 128 * 128 + 8192 * 3)                      # fp32 state + window, one layer
    node = 16 + 4 * (16 * 128 + 32 * 128 + 2 * 32) + 2 * 8192    # position, owner, k, u, g, G; x in bf16
    assert got["recurrent_layers"] == 30 and got["recurrent_state_bytes_per_node"] == 30 * node
    assert got["recurrent_state_bytes"] == 30 * (4 * state + 128 * node)    # 4 copies; 65 nodes: 2 x 64 rows
    assert got["ledger"]["target recurrent state"] == got["recurrent_state_bytes"]
    slots = 32768 + 65
    assert got["ledger"]["target KV cache"] == 10 * slots * 2 * 2 * 256 * 2   # the attention layers only


def test_long_context_costs_a_quarter(capsys, tmp_path: Path) -> None:
    """The same model with every layer attending: its KV cache is 4x the hybrid's, at 128k context."""
    cfg = json.loads((Q35 / "config.json").read_text())
    cfg["text_config"]["layer_types"] = ["full_attention"] * 40
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    flags = ("--gpu-memory", "24GB", "--ram-budget", "128GB", "--quant", "nf4", "--budget", "16", "--context",
             "131072")
    hybrid = plan_json(capsys, "--model", str(Q35), *flags)["ledger"]
    dense = plan_json(capsys, "--model", str(tmp_path), *flags)["ledger"]
    kv = lambda ledger: ledger.get("target KV cache", 0) + ledger.get("target KV cache (streamed)", 0)  # noqa: E731
    assert kv(dense) == 4 * kv(hybrid) and "target recurrent state" not in dense


@torch.inference_mode()
def test_a_real_cache_holds_no_more_than_planned(tiny_qwen3_5: Path) -> None:
    """The tiny hybrid's cache at its fullest (a prefill's pending state, the snapshot, a tree of the budget,
    the latest commit's states kept) against the plan's line for the same budget."""
    model = load_model(tiny_qwen3_5)
    shape = RunShape(model.args, None, torch.float32, "cpu", budget=8, context=64)
    planned = plan_memory(shape, ("none",), ram=1 << 34, gpu=None).to_json()["recurrent_state_bytes"]
    cache = model.new_cache(80)
    store, _ = cache.state(0)
    peak = 0
    for n in (20, 20):                                            # two prefill chunks: pending beside last
        model(torch.arange(7, 7 + n)[None], torch.arange(cache.length, cache.length + n)[None],
              TreeMask(cache.length), cache)
        peak = max(peak, store.nbytes)
        cache.advance(n)
        cache.snapshot()
    tree = TokenTree.from_lists(list(range(10, 19)), [-1, 0, 0, 1, 1, 2, 3, 3, 6])
    L = cache.length
    model(tree.tokens[None], tree.positions(L)[None], TreeMask(L, tree.ancestor_mask()), cache)
    cache.keep(L + torch.tensor(tree.path(8)))
    peak = max(peak, store.nbytes)
    assert 0 < peak <= planned
