"""`specexec bench attention`: the subcommand runs on the tiny random model, its rows say the split and dense
passes agree (greedy choice per node identical, logits within fp32 rounding), and bad flags exit 2 in one line.
Times are not asserted (benchmarks, not tests)."""
from __future__ import annotations

import json

import pytest
import torch

from cli.bench.components.attention import parse_contexts
from cli.main import main
from specexec.options import ConfigError


def test_bench_attention_json_rows(capsys) -> None:
    threads = torch.get_num_threads()
    try:
        assert main(["bench", "attention", "--contexts", "100,1k", "--tree", "24", "--threads", "1", "--repeat", "2",
                     "--json"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["model"] == "tiny random" and out["dtype"] == "float32"
    assert [r["context"] for r in out["rows"]] == [100, 1024]
    for r in out["rows"]:
        assert r["greedy_identical"] and r["max_abs_logit_diff"] < 1e-4
        assert r["split_s"] > 0 and r["dense_s"] > 0 and r["tree"] == 24
        assert r["split_mask_bytes"] == 24 * 24 * 4 and r["dense_mask_bytes"] == 24 * (r["context"] + 24) * 4
        assert r["layer_max_abs_diff"] < 1e-5 and min(r[f"layer_{n}_ms"] for n in ("split", "dense", "before")) > 0


def test_bench_attention_table_and_bad_flags(capsys) -> None:
    assert main(["bench", "attention", "--contexts", "64", "--tree", "8", "--threads", "1"]) == 0
    assert "layer ms split" in capsys.readouterr().out
    assert main(["bench", "attention", "--contexts", "32q"]) == 2
    err = capsys.readouterr().err
    assert "--contexts" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert main(["bench", "attention", "--tree", "0"]) == 2


def test_parse_contexts() -> None:
    assert parse_contexts("1k, 8k,32K,100") == [1024, 8192, 32768, 100]
    for bad in ("", "0", "k", "1.5k", "2m"):
        with pytest.raises(ConfigError):
            parse_contexts(bad)
