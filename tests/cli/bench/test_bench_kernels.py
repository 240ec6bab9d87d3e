"""`specexec bench kernels` (cli/bench/components/kernels.py): every candidate kernel runs at the table's shapes, the table
and JSON rows, and bad input as one line."""
from __future__ import annotations

import json

import torch

from cli.bench.components import kernels
from cli.main import main


def test_every_candidate_runs_at_the_shape() -> None:
    """x [M, K] -> [M, N] for each (their random weights differ: only the shapes and bytes are compared)."""
    gen = torch.Generator().manual_seed(0)
    for name in kernels.kernel_names():
        nbytes, make = kernels.weight(name, 64, 128, gen)
        y = make(torch.randn(3, 128))()
        assert y.shape == (3, 64) and nbytes >= 64 * 128 // 2, name


def test_table_and_json(capsys) -> None:
    assert main(["bench", "kernels", "--shapes", "tiny", "--rows", "1,2", "--reps", "1", "--copies-mb", "1",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["read_gbps"] > 0 and {r["rows"] for r in out["rows"]} == {1, 2}
    assert {r["kernel"] for r in out["rows"]} == set(kernels.kernel_names())
    ours = [r for r in out["rows"] if r["kernel"].startswith("specexec q4")]
    assert all(r["x_ours_q4"] == 1.0 and r["gbps"] > 0 for r in ours)


def test_bad_input_is_one_line(capsys) -> None:
    assert main(["bench", "kernels", "--shapes", "70x"]) == 2
    assert main(["bench", "kernels", "--rows", "1,x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "--shapes '70x'" in err[0] and "--rows" in err[1]
