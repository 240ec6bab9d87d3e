"""`specexec bench --context` (the cost of context as one table) and `--kv-quant int8` rows, on the tiny pair:
the prompts follow a shared document cut to each context, the first prompt prefills it and the next reuse it,
specexec rows are identical to the target alone at T = 0, int8 rows are marked LOSSY and never called
identical; the built-in document is our own, reproducible text."""
from __future__ import annotations

import json

import pytest

from cli.bench.context import parse_contexts
from cli.main import main
from specexec.options import ConfigError
from specexec.prompts.document import compose, long_document


def bench(capsys, pair, *extra: str) -> tuple[dict, str]:
    target, draft = pair
    code = main(["bench", "--model", str(target), "--draft", str(draft), "--dtype", "float32", "--limit", "2",
                 "--max-new-tokens", "8", "--warmup", "0", "--budgets", "4", "--json", *extra])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out), captured.err


def test_context_sweep_is_one_table(capsys, tiny_pair, tiny_perturbed_draft) -> None:
    obj, err = bench(capsys, (tiny_pair[0], tiny_perturbed_draft), "--context", "300,480")
    assert obj["contexts"] == [300, 480]
    rows = {(r["context"], r["config"]): r for r in obj["rows"]}
    assert set(rows) == {(c, k) for c in (300, 480) for k in ("specexec budget=4", "no-draft")}
    for (c, config), r in rows.items():
        assert r["tok_s"] > 0 and r["pass_s"] > 0 and r["prefill_s"] > 0 and r["tokens_per_pass"] >= 1
        assert c - 8 - 170 <= r["prefill_tokens"] < c - 8                  # the first prompt prefills the document
        assert r["identical_to_baseline"] is True and not r["lossy"]
    assert rows[(480, "no-draft")]["prefill_tokens"] > rows[(300, "no-draft")]["prefill_tokens"]
    for word in ("context", "prefill s", "pass s", "tok/pass"):
        assert word in err


def test_kv_quant_int8_rows_are_lossy(capsys, tiny_pair, tiny_perturbed_draft) -> None:
    obj, err = bench(capsys, (tiny_pair[0], tiny_perturbed_draft), "--kv-quant", "int8", "--configs",
                     "specexec,no-draft")
    rows = {r["config"]: r for r in obj["rows"]}
    assert set(rows) == {"specexec budget=4", "no-draft", "specexec budget=4 kv=int8 LOSSY", "no-draft kv=int8 LOSSY"}
    assert rows["specexec budget=4"]["identical_to_baseline"] is True              # exact rows stay exact
    for name in ("specexec budget=4 kv=int8 LOSSY", "no-draft kv=int8 LOSSY"):
        assert rows[name]["lossy"] and rows[name]["identical_to_baseline"] is None
        assert len(rows[name]["first_mismatch"]) == 2 and rows[name]["tokens_per_pass"] >= 1
    assert "LOSSY" in err


def test_context_lists_and_errors(capsys, tiny_pair) -> None:
    assert parse_contexts("1k,8k,32k") == (1024, 8192, 32768) and parse_contexts("4096, 1K") == (4096, 1024)
    for bad in ("", "1m", "12", "k"):
        with pytest.raises(ConfigError):
            parse_contexts(bad)
    code = main(["bench", "--model", str(tiny_pair[0]), "--no-draft", "--context", "64k", "--limit", "1"])
    assert code == 2 and "exceeds the model's context" in capsys.readouterr().err


def test_the_document_is_our_own_reproducible_text() -> None:
    text = long_document()
    assert text == compose()                                   # generated here, from our own sentences
    assert 150_000 < len(text.encode()) < 300_000 and text.startswith("Operations Handbook")


@pytest.mark.parametrize("command", ["builders", "accept"])
def test_benchmarks_that_check_exactness_refuse_a_lossy_cache(capsys, tiny_pair, command: str) -> None:
    code = main(["bench", command, "--model", str(tiny_pair[0]), "--draft", str(tiny_pair[1]), "--kv-quant", "int8"])
    err = capsys.readouterr().err
    assert code == 2 and "lossy" in err and len(err.strip().splitlines()) == 1
