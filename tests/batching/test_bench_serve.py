"""`specexec bench serve` on the tiny pair: every row's completions equal the solo run's, passes carried several
requests, the no-draft rows are batched too; a run whose passes cannot be shared is seated one at a time."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.main import main
from specexec.batching.pool import SeatPool, seating
from specexec.config import EngineConfig
from specexec.runtime.assembly import Runtime

pytest.importorskip("uvicorn")
pytest.importorskip("openai")


@pytest.mark.slow
def test_bench_serve_rows_are_identical_to_solo_and_share_passes(capsys, tiny_pair: tuple[Path, Path],
                                                                  tiny_perturbed_draft: Path) -> None:
    code = main(["bench", "serve", "--model", str(tiny_pair[0]), "--draft", str(tiny_perturbed_draft), "--budget", "8",
                 "--dtype", "float32", "--clients", "1,3", "--no-draft-clients", "3", "--limit", "3",
                 "--max-new-tokens", "8", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    rows = {(r["config"], r["clients"]): r for r in json.loads(out.out.strip().splitlines()[-1])["rows"]}
    assert set(rows) == {("specexec", 1), ("specexec", 3), ("no-draft", 1), ("no-draft", 3)}
    assert all(r["identical"] == "3/3" for r in rows.values())
    assert rows[("specexec", 3)]["forest_size_mean"] > 1 and rows[("no-draft", 3)]["forest_size_mean"] > 1
    assert rows[("specexec", 1)]["forest_size_mean"] is None and rows[("no-draft", 1)]["vs_no_draft_solo"] == 1.0


def test_a_target_whose_passes_cannot_be_shared_is_seated_one_at_a_time(tiny_qwen3_moe: Path) -> None:
    rt = Runtime.load(str(tiny_qwen3_moe), None, EngineConfig(dtype="float32", max_new_tokens=8))
    assert "mixture of experts" in SeatPool.why_not(rt)
    seats = seating(rt, 4)
    assert seats.parallel == 1 and seats.line().startswith("parallel: 1 request at a time, as the target has a mixture")
    with pytest.raises(ValueError, match="cannot batch requests"):
        SeatPool(rt, 2)
