"""The acceptance rule one generate() call runs (`rule_for`), from plain facts: the sampling, the acceptance
asked for, the configured verifier, how the builder drafts and whether it keeps the draft's probabilities, the
vocabulary. Pure: it reads no engine; the Engine (decoding/engine.py) and a server checking a request before it
queues (cli/serve) ask it alike, and relaxed acceptance is checked here only (relaxed.check_relaxed).

Refusals are ConfigErrors about their setting (`subject`: "--accept" for what relaxed acceptance cannot run on,
"--verifier" for a rule not exact for this drafting at T > 0), so a caller maps them without reading the text.

Does not know: trees, models, the builders beyond the two facts it is told.
"""
from __future__ import annotations

from dataclasses import dataclass

from specexec.acceptance.relaxed import check_relaxed, relaxed_rule
from specexec.acceptance.rules import RULES, Rule, default_rule, exact_rules_for
from specexec.config import Acceptance, SamplingParams
from specexec.options import about


@dataclass(frozen=True)
class Drafting:
    """What the rule depends on beyond a call's sampling and acceptance: the configured verifier ('auto': the
    builder's default), the builder's drafting scheme ("deterministic" without a builder), whether it keeps the
    draft's probabilities, its name (None: no builder), the target's vocabulary size, the width of the run's
    neighbour table (relaxed acceptance's k at most)."""

    verifier: str
    scheme: str
    keeps_draft_probs: bool
    builder: str | None
    vocab_size: int
    max_k: int | None = None            # relaxed acceptance's neighbours per token at most (the run's table)


def rule_for(sampling: SamplingParams, accept: Acceptance, how: Drafting) -> Rule:
    """The acceptance rule: greedy at T = 0; else the verifier ('auto': the builder's default), which must be
    exact for the builder's drafting scheme (docs/algorithms.md §5.5). Relaxed acceptance is checked against the
    run (relaxed.check_relaxed) and runs on greedy / sample_match only (relaxed.relaxed_rule)."""
    check_relaxed(accept, how.vocab_size, how.builder is not None, how.verifier, how.max_k)
    if accept.relaxed:
        return RULES[relaxed_rule(how.verifier, sampling)]
    if sampling.greedy:
        return RULES["greedy"]
    name = how.verifier
    if name == "auto":
        name = default_rule(how.scheme, sampling)
    exact = exact_rules_for(how.scheme, sampling)
    if name not in exact:
        raise about("--verifier", name, f"verifier {name!r} is not exact for {how.scheme} trees at temperature > 0; "
                    f"use one of: {', '.join(exact)}")
    if RULES[name].needs_draft and not how.keeps_draft_probs:
        raise about("--verifier", name, f"verifier {name!r} needs the draft's probabilities, which builder "
                    f"{how.builder or 'none'!r} does not keep")
    return RULES[name]
