"""`specexec bench decode` (cli/bench/components/decode.py): a resident model loaded as a draft is, its decode
passes timed per token count against its weight bytes over the measured bandwidth; the bytes counted once per
tensor (joined projections, a tied head); bad input as one line."""
from __future__ import annotations

import json

from cli.bench.components.decode import weight_bytes
from cli.main import main
from specexec.checkpoints.loading import load_model, read_args


def _run(capsys, path, fmt: str) -> dict:
    assert main(["bench", "decode", "--model", str(path), "--draft-quant", fmt, "--tokens", "1,2", "--reps", "2",
                 "--context", "8", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_rows_and_bytes(capsys, tiny_qwen2) -> None:
    args = read_args(tiny_qwen2)
    plain = _run(capsys, tiny_qwen2, "none")
    layers = sum(p.numel() for p in load_model(tiny_qwen2).layers.parameters())
    head = args.vocab_size * args.dim                       # tied or not: the head's matrix, read once
    assert plain["weight_bytes"] == 4 * (layers + head)
    assert [r["tokens"] for r in plain["rows"]] == [1, 2] and plain["read_gbps"] > 0
    assert all(r["ms"] > 0 and abs(r["x_bound"] * r["bound_ms"] - r["ms"]) <= 1e-3 * r["ms"] for r in plain["rows"])
    int4 = _run(capsys, tiny_qwen2, "int4")
    assert "int4 layers" in int4["dtype"] and plain["weight_bytes"] / 8 < int4["weight_bytes"] < plain["weight_bytes"] / 3


def test_a_joined_projection_counts_once(tiny_qwen2) -> None:
    """q/k/v joined into one qkv_proj (cpu_blocks): the pieces are gone, the bytes are the joined tensor's."""
    from specexec.runtime.cpu_blocks import fuse_cpu_blocks
    from specexec.runtime.offloaded import quantize_layers
    model = load_model(tiny_qwen2)
    quantize_layers(model, "int4", row_exact=False)
    before = weight_bytes(model)
    fuse_cpu_blocks(model)
    assert hasattr(model.layers[0].self_attn, "qkv_proj") and weight_bytes(model) == before


def test_bad_input_is_one_line(capsys, tiny_qwen2) -> None:
    assert main(["bench", "decode", "--model", str(tiny_qwen2), "--tokens", "1,x"]) == 2
    assert main(["bench", "decode", "--model", str(tiny_qwen2), "--context", "100000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "--tokens '1,x'" in err[0] and "--context" in err[1]
