"""The bench's progress: an estimate of the whole run from its first prompt, a time left known from then on (the
prompts left in this configuration and in every planned one not started), and a line per prompt when stderr is
not a terminal."""
from __future__ import annotations

import io

from rich.console import Console

from cli.bench.progress import PromptBars, RunClock


class Tick:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_time_left_counts_the_configurations_not_started() -> None:
    tick = Tick()
    run = RunClock(planned=3, clock=tick)
    run.tell("a", 0, 10)
    assert run.left() is None                       # nothing finished yet
    tick.now = 2.0
    run.tell("a", 1, 10)
    assert run.per_prompt() == 2.0
    assert run.left() == 2.0 * (9 + 2 * 10)         # 9 more of a, then b and c whole
    assert "3 configurations x 10 prompts, about 60 s in all" in run.estimate()


def test_a_log_gets_the_estimate_then_one_line_per_prompt() -> None:
    tick, out = Tick(), io.StringIO()
    console = Console(file=out, width=200)          # not a terminal: no bar
    with PromptBars(console, planned=2, clock=tick) as bars:
        for done in range(4):
            bars.prompts("specexec budget=8", done, 3)
            tick.now += 30.0
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("estimate from the first prompt (30.0 s): 2 configurations x 3 prompts, about 3 min")
    assert lines[1] == "specexec budget=8 · prompt 2/3 · 30.0 s per prompt · run left 2 min"       # 4 prompts
    assert lines[2] == "specexec budget=8 · prompt 3/3 · 30.0 s per prompt · run left 90 s"


def test_one_line_says_when_drafting_cannot_pay_on_the_pair() -> None:
    from cli.bench.table import cannot_pay

    def row(config: str, tok_s: float, budget: int | None, draft_ms: float | None, target_ms: float) -> dict:
        return {"config": config, "tok_s": tok_s, "budget": budget, "lossy": False, "tokens_per_pass": 2.1,
                "draft_ms_per_step": draft_ms, "target_ms_per_step": target_ms}

    rows = [row("specexec budget=8", 63.0, 8, 9.0, 5.5), row("specexec budget=32", 40.0, 32, 20.0, 6.0),
            row("no-draft", 241.0, None, None, 4.1)]
    line = cannot_pay(rows)
    assert line.startswith("drafting does not pay on this pair: the target alone (241.0 tok/s) beats every drafted "
                           "row (best 63.0): a target pass costs 4.1 ms and specexec budget=8's draft 9.0 ms")
    rows[0]["tok_s"] = 300.0
    assert cannot_pay(rows) is None                              # one row pays: nothing to explain
    assert cannot_pay(rows[2:]) is None                          # no drafted row
