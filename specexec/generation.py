"""What one generate() call reports: GenerationStats (filled in as the call runs; its steps are the profiler's
step records, read here, never kept twice) and PrefillProgress (how far a long prefill got, for a progress
bar: Engine.on_prefill hears it after every pass).

Does not know: how a step runs (specexec/decoding/engine.py), how the records are timed (specexec/profiler.py), the CLI.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from specexec.profiler import Profiler, StepStat, budget_trace, moe_stats
from specexec.profiler import gate_stats


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability under the target's processed distribution where it was chosen,
    and the `top` (token id, log-prob) alternatives there, best first (-inf for a token the processing rules out)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class PrefillProgress:
    """How far one model's prefill got (Engine.on_prefill hears it after every pass): `which` model
    ("target" | "draft"), tokens done of total, passes done of passes, started: time.perf_counter() then."""

    which: str
    total: int
    passes: int
    started: float
    done: int = 0
    passes_done: int = 0

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started


@dataclass
class GenerationStats:
    """What one generate() call did; filled in as it runs. Its steps are the ledger's (the profiler's step
    records of this call): one ledger, read here, never kept twice."""

    prompt_tokens: int = 0          # prompt tokens prefilled by this call
    reused_tokens: int = 0          # prompt tokens whose KV was kept from the previous call (shared prefix)
    prefill_s: float = 0.0
    generated: int = 0
    ledger: Profiler | None = None  # whose step records are this call's steps (None: no steps)
    constraint: Any = None          # the call's grammar (specexec/constraint.py), whose counters summary() shows
    accept: Any = None              # the call's Acceptance (specexec/config.py; None: exact)
    relaxed_tokens: int = 0         # relaxed acceptance: emitted tokens exact acceptance would not have chosen

    @property
    def steps(self) -> list[StepStat]:
        """Every step of the call with its times (waits for pending CUDA times: not on the step path)."""
        return self.ledger.steps if self.ledger is not None else []

    @property
    def decode_s(self) -> float:
        return sum(s.draft_ms + s.target_ms for s in self.steps) / 1000

    def summary(self, budget: int | str, builder: str) -> dict:
        steps, decode_s = self.steps, self.decode_s
        n = max(len(steps), 1)
        return {
            "steps": len(steps),
            "tokens_per_step": round(self.generated / n, 3),
            "prefill_tok_s": round(self.prompt_tokens / self.prefill_s, 2) if self.prefill_s else None,
            "decode_tok_s": round(self.generated / decode_s, 2) if decode_s else None,
            "draft_ms": round(sum(s.draft_ms for s in steps) / n, 2),
            "target_ms": round(sum(s.target_ms for s in steps) / n, 2),
            "tree_size": round(sum(s.tree_size for s in steps) / n, 1),
            "reused_tokens": self.reused_tokens,
            "budget": budget,
            "budget_trace": budget_trace(s.budget for s in steps),     # what --budget auto picked, per step
            "builder": builder,
            **self.acceptance(),
            **({"moe": moe} if (moe := self.moe()) is not None else {}),
            **({"gate": gate} if (gate := self.gate()) is not None else {}),
            **({"grammar": dict(self.constraint.stats)} if self.constraint is not None else {}),
        }

    def acceptance(self) -> dict:
        """{"accept": "exact"}, or for relaxed acceptance (LOSSY) its parameters and relaxed_tokens: how many
        emitted tokens differ from what exact acceptance would have chosen at their node."""
        if self.accept is None or not self.accept.relaxed:
            return {"accept": "exact"}
        return {"accept": "relaxed", "delta": self.accept.delta, "k": self.accept.k,
                "relaxed_tokens": self.relaxed_tokens}

    def moe(self) -> dict | None:
        """stats.moe of an MoE target (profiler.moe_stats over this call's passes), else None."""
        return moe_stats(self.ledger.counters, self.ledger.gauges) if self.ledger is not None else None

    def gate(self) -> dict | None:
        """stats.gate of a gated run (--gate: switches, plain_steps, speculative_steps, events), else None."""
        return gate_stats(self.ledger.counters, self.ledger.notes) if self.ledger is not None else None
