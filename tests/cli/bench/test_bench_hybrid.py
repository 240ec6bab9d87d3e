"""`specexec bench hybrid`: one Gated DeltaNet layer's tree pass against a dense layer of the same bytes. The
subcommand runs (small tree sizes, a short context), its dense layer holds the hybrid layer's bytes to within
one MLP step, its rows carry the state per node the planner counts, and bad flags exit 2 in one line. Times are
not asserted (benchmarks, not tests)."""
from __future__ import annotations

import json

import pytest
import torch

from cli.bench.components.hybrid import LINEAR, _model, layer_args, same_bytes_mlp, tree
from cli.main import main
from specexec.network.linear_attention import spec_of
from specexec.planning.sizes import module_bytes


@pytest.mark.slow
def test_bench_hybrid_json_rows(capsys) -> None:
    threads = torch.get_num_threads()
    try:
        assert main(["bench", "hybrid", "--tokens", "1,5", "--context", "8", "--mlp", "64", "--reps", "1",
                     "--threads", "1", "--json"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["tokens"] for r in out["rows"]] == [1, 5] and out["context"] == 8 and out["quant"] == "none"
    node = spec_of(layer_args(True, 64)).node_bytes(4)
    assert out["state_bytes_per_node"] == node
    for r in out["rows"]:
        assert r["state_bytes"] == r["tokens"] * node and min(r["copy_ms"], r["hybrid_ms"], r["dense_ms"]) > 0
        assert r["compute_ratio"] == pytest.approx(r["hybrid_ms"] / r["dense_ms"], rel=0.01)


@pytest.mark.slow
def test_the_dense_layer_has_the_hybrid_layers_bytes() -> None:
    """The dense layer's MLP width is solved from two small layers; its bytes are within one 64-wide MLP step
    (3 x 64 x dim weights) of the hybrid layer's."""
    hybrid = _model(layer_args(True, 64), "none")
    dense, nbytes = same_bytes_mlp(hybrid, "none")
    step = 3 * 64 * dense.args.dim * 4
    assert abs(nbytes - module_bytes(hybrid.layers[0])) <= step // 2
    assert "linear_attention" not in dense.args.layer_types
    assert hybrid.args.linear == LINEAR


def test_the_tree_branches_by_four() -> None:
    t = tree(5)
    assert t.tokens.numel() == 6 and t.parents.tolist() == [-1, 0, 0, 0, 0, 1]


def test_bad_flags_are_one_line(capsys) -> None:
    for argv in (["--tokens", "0"], ["--context", "0"], ["--reps", "0"], ["--mlp", "8"]):
        assert main(["bench", "hybrid", *argv]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, argv
