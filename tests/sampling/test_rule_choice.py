"""specexec/acceptance/choice.rule_for: the rule a call runs, from plain facts (no engine); each refusal a
ConfigError about its setting ("--accept" or "--verifier", the subject a server maps to a parameter without
reading the message); relaxed acceptance checked there alone; the memory plan's neighbours line is
Neighbours.table_bytes.
"""
from __future__ import annotations

import pytest

from specexec.acceptance.choice import Drafting, rule_for
from specexec.acceptance.parsing import parse as parse_acceptance, parse_accept
from specexec.acceptance.relaxed import Neighbours
from specexec.config import Acceptance, SamplingParams
from specexec.options import ConfigError

HOT = SamplingParams(temperature=1.0)
RELAXED = parse_acceptance("relaxed")


def _how(verifier: str = "auto", scheme: str = "deterministic", keeps: bool = False, builder: str | None = "x",
         vocab: int = 320) -> Drafting:
    return Drafting(verifier, scheme, keeps, builder, vocab)


def test_the_rule_follows_the_facts() -> None:
    exact = Acceptance()
    assert rule_for(SamplingParams(), exact, _how()).name == "greedy"
    assert rule_for(HOT, RELAXED, _how()).name == "sample_match"
    assert rule_for(SamplingParams(), RELAXED, _how()).name == "greedy"
    assert rule_for(HOT, exact, _how("sample_match")).name == "sample_match"


@pytest.mark.parametrize("sampling,accept,how,subject,said", [
    (SamplingParams(), Acceptance("relaxed", 0.1, 320), _how(), "--accept", "above the target's vocabulary"),
    (SamplingParams(), RELAXED, _how(builder=None), "--accept", "nothing drafts here"),
    (HOT, RELAXED, _how("rrs_wor"), "--accept", "runs on the greedy and sample_match rules"),
    (HOT, Acceptance(), _how("rrs_wor", "deterministic"), "--verifier", "is not exact for deterministic trees"),
    (HOT, Acceptance(), _how("rrs_wor", "without_replacement"), "--verifier", "needs the draft's probabilities"),
])
def test_each_refusal_names_its_setting(sampling, accept, how, subject: str, said: str) -> None:
    with pytest.raises(ConfigError, match=said) as e:
        rule_for(sampling, accept, how)
    assert e.value.subject == subject


def test_an_accept_value_refused_names_accept() -> None:
    for bad in ("lossy", "relaxed:delta=2", "relaxed:k=x", "exact:k=3"):
        with pytest.raises(ConfigError) as e:
            parse_accept(bad)
        assert e.value.subject.startswith("--accept"), bad


def test_the_plan_counts_the_neighbours_table_it_will_hold() -> None:
    assert Neighbours.table_bytes(50, 5) == 50 * (4 * 5 + 1)
