"""`specexec bench agents` on the tiny pair (a 300-token prefix: the tiny models' context is 512): two agents
alternate, each turn after its first computes only what the prompt cache lacks,
the restarted server finds the prefix on disk, and the cache's directory is gone afterwards; a loop longer than
the context is one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.main import main

pytest.importorskip("uvicorn")
pytest.importorskip("openai")


@pytest.mark.slow
def test_turns_after_the_first_and_a_restart_read_the_cache(capsys, tiny_pair: tuple[Path, Path],
                                                           tiny_perturbed_draft: Path, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPECEXEC_CACHE", str(tmp_path))
    code = main(["bench", "agents", "--model", str(tiny_pair[0]), "--draft", str(tiny_perturbed_draft),
                 "--budget", "8", "--dtype", "float32", "--turns", "3", "--prefix-tokens", "300",
                 "--turn-tokens", "10", "--max-new-tokens", "4", "--json"])
    out = capsys.readouterr()
    report = json.loads(out.out.strip().splitlines()[-1])
    turns = report["turns"]
    assert [(t["run"], t["turn"], t["agent"]) for t in turns] == \
        [("live", t, k) for t in range(3) for k in range(2)] + [("restart", 0, 0)]
    assert all(t["cached_tokens"] < 20 for t in turns[:2])                   # two different prefixes, cold
    assert all(t["cached_tokens"] >= 256 and t["computed_tokens"] < 100 for t in turns[2:6])
    assert report["restart_cached_share"] >= 0.9 and code in (0, 1)       # 5 % needs a long prefix
    assert "after the restart" in out.err and not list((tmp_path / "prefix").iterdir())


def test_a_loop_longer_than_the_context_is_one_line(capsys, tiny_pair: tuple[Path, Path]) -> None:
    assert main(["bench", "agents", "--model", str(tiny_pair[0]), "--no-draft", "--prefix-tokens", "100000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "lower --prefix-tokens" in err[-1] and err[-1].startswith("error:"), err
