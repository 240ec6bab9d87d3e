"""What the memory ledger counts of a drafter (planning/needs.py): its own weights in the run dtype (an MoE's MTP
layer with every expert: one sparse decoder layer of the target plus its input projection and norms), its KV cache
(one layer), and the states it keeps (the tapped target layers' inputs of one verification pass, its own state
per tree node); `specexec plan --draft mtp` prints them from config.json alone; a config without an MTP layer
is one line.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from specexec.checkpoints.catalog import SHIPPED_CONFIGS
from cli.main import main
from specexec.builders.registry import make_builder
from specexec.checkpoints.loading import read_args
from specexec.drafters.choose import choose
from specexec.drafters.registry import parse_draft
from specexec.planning.ledger import plan_memory
from specexec.planning.run_shape import RunShape
from specexec.checkpoints.naming import block_specs
from specexec.planning.sizes import kv_bytes
from tests.drafters.drafter_writer import write_eagle3

CONFIGS = SHIPPED_CONFIGS
AIR, L8 = CONFIGS / "glm-4.5-air", CONFIGS / "llama-3.1-8b-instruct"
GB = 10**9


def _plan(target: Path, spec: str, budget: int = 64):
    args = read_args(target)
    choice = choose(parse_draft(spec), target, args, headers=False)
    builder = make_builder("specexec")
    shape = RunShape(args, choice.plan_args(args), torch.bfloat16, "cuda", budget, 4096, draft_kv=builder.kv_slots,
                     drafter=choice.size())
    return choice, shape, plan_memory(shape, ("nf4",), 64 * GB, 22 * GB)


def test_an_moe_mtp_layer_counts_every_expert_once() -> None:
    """GLM-4.5-Air's next-n layer: one of its sparse decoder layers (128 experts) in bf16, eh_proj [D, 2D],
    enorm, hnorm and shared_head.norm; the embedding and LM head are the target's lines, not again."""
    choice, shape, m = _plan(AIR, "mtp")
    t = read_args(AIR)
    sparse = sum(math.prod(s) for _, s in block_specs(t, t.n_layers - 1)[0])    # a sparse layer of the target
    own = 2 * t.dim * t.dim + 3 * t.dim
    ledger = m.ledger()
    assert ledger["draft weights"] == (sparse + own) * 2 and choice.size().experts == 128
    assert ledger["draft KV cache"] == kv_bytes(shape.draft, shape.slots[1], 2)
    assert ledger["drafter states"] == (shape.draft_scratch + 1) * t.dim * 2         # reads the target's output
    assert ledger["draft weights"] > 4 * GB


def test_an_eagle3_head_counts_its_taps_per_tree_row(tmp_path) -> None:
    """Llama 3.1 8B with an EAGLE-3 head (3 taps of 4096, a 32k head, the target's embedding): its weights are
    its layer, fc and head; each pass keeps 3 x (budget + 1) rows of the target's states for it."""
    head = write_eagle3(tmp_path / "h", target_dim=4096, vocab=128256, draft_vocab=32000, taps=(2, 16, 29), dim=4096,
                        heads=32, kv_heads=8, head_dim=128, inter=14336, materialize=False)
    choice, shape, m = _plan(L8, f"eagle3:{head}", budget=128)
    d = 4096
    attn = 2 * d * (32 + 8 + 8) * 128 + 32 * 128 * d
    params = attn + 3 * d * 14336 + 3 * d + 3 * d * d + 32000 * d + d     # layer, its 3 norms, fc, head, norm
    ledger = m.ledger()
    assert choice.params == params and ledger["draft weights"] == params * 2
    assert ledger["drafter states"] == (3 * 129 * d + (shape.draft_scratch + 1) * d) * 2


def test_plan_prints_the_drafters_lines(capsys) -> None:
    assert main(["plan", "--model", str(AIR), "--draft", "mtp", "--gpu-memory", "24GB", "--ram-budget", "64GB"]) == 0
    out = capsys.readouterr().out
    assert "mtp: 1 decoder layer(s), all 128 experts" in out and "drafter states" in out
    assert main(["plan", "--model", str(AIR), "--draft", "mtp", "--gpu-memory", "24GB", "--ram-budget", "64GB",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)


def test_plan_mtp_on_a_config_without_one_is_one_line(capsys) -> None:
    code = main(["plan", "--model", str(L8), "--draft", "mtp", "--gpu-memory", "24GB"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "has no MTP layer to draft with (config.json names none" in err and "\n" not in err


def test_a_drafter_plan_that_does_not_fit_says_what_would(capsys) -> None:
    """DeepSeek-V3's MTP layer (256 experts) in 20 GB of RAM: the plan does not fit, and its 'what would fit'
    tries, the last without a draft, must drop the drafter with the draft (issue 55: an internal AttributeError
    from planning the drafter's states of no draft model)."""
    code = main(["plan", "--model", str(CONFIGS / "deepseek-v3"), "--draft", "mtp", "--device", "cpu",
                 "--ram-budget", "20GB"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "cannot hold" in err and "no draft would fit" in err and "\n" not in err
    assert main(["plan", "--model", str(CONFIGS / "deepseek-v3"), "--draft", "mtp", "--device", "cpu",
                 "--ram-budget", "100GB"]) == 0
    assert "mtp: 1 decoder layer(s), all 256 experts" in capsys.readouterr().out
