"""Grammars with llguidance (specexec/runtime/grammar.py) inside the tree: the matcher walked along a tree by
rollback gives the masks a fresh matcher fed each path gives; greedy decoding under a JSON schema equals the
target alone under it (every builder that drafts, and Token Recycling, whose trees are not masked), the answer
validates, the draft's trees hold no node the grammar rejects; sampling under a grammar follows the
constrained target's distribution (chi-square); a bad schema is one ConfigError, and so is one beyond
llguidance's limits within its first tokens; a limit met later ends the text where the target alone ends it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("llguidance")

from specexec.builders.registry import make_builder  # noqa: E402
from specexec.builders.specexec import SpecExecBuilder  # noqa: E402
from specexec.checkpoints.loading import load_model  # noqa: E402
from specexec.config import EngineConfig, SamplingParams  # noqa: E402
from specexec.decoding.engine import Engine  # noqa: E402
from specexec.options import ConfigError  # noqa: E402
from specexec.runtime.assembly import Runtime  # noqa: E402
from specexec.runtime.grammar import Grammars  # noqa: E402
from tests.sampling.chi2 import chi2_pvalue  # noqa: E402
from tests.sampling.sampling_pairs import PROMPT, exact_pairs, sample_pairs  # noqa: E402

SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog", "fish"]},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "name": {"type": "string", "maxLength": 6}},
          "required": ["kind", "age", "name"], "additionalProperties": False}


@pytest.fixture(scope="module")
def runtime(tiny_pair, tiny_perturbed_draft) -> Runtime:
    return Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft), EngineConfig(budget=16, dtype="float32"))


def run(runtime: Runtime, ids: list[int], grammar: str | None, n: int = 80) -> tuple[list[int], dict]:
    constraint = runtime.grammars.constraint(grammar) if grammar is not None else None
    out = [t for s in runtime.generate_ids(ids, n, SamplingParams(), constraint=constraint) for t in s]
    return out, runtime.stats()


def test_walked_masks_equal_a_fresh_matcher_per_path(runtime) -> None:
    grammars, V, cpu = runtime.grammars, runtime.target_info.args.vocab_size, torch.device("cpu")
    grammar = grammars.json_schema(SCHEMA)
    text = '{"kind": "dog", "age": 7, "name": "Rex"}'
    ids = runtime.tokenizer(text, add_special_tokens=False)["input_ids"]
    paths = [tuple(ids[:k]) for k in range(len(ids) + 1)] + [tuple(ids[:3]) + (ids[0],), tuple(ids[:2]) + (ids[5],)]

    def fresh(path: tuple[int, ...]) -> torch.Tensor:
        return grammars.constraint(grammar).allowed([path], V, cpu)[0]
    walked = grammars.constraint(grammar)
    for path, row in zip(paths, walked.allowed(paths, V, cpu)):           # one matcher, rolled back between
        assert torch.equal(row, fresh(path)), path
    assert walked.stats["dead"] == sum(fresh(p[:-1])[p[-1]].item() is False for p in paths[1:])
    walked.commit(ids[:5])
    assert torch.equal(walked.allowed([tuple(ids[5:8])], V, cpu)[0], fresh(tuple(ids[:8])))


@pytest.mark.parametrize("builder", ["specexec", "chain", "dynamic", "recycling"])
def test_greedy_under_a_schema_is_the_constrained_target_alone(runtime, builder: str) -> None:
    grammar = runtime.grammars.json_schema(SCHEMA)
    ids = runtime.encode("Describe a pet as JSON.", chat=True)
    alone = runtime.variant(runtime.config, use_draft=False)
    want, _ = run(alone, ids, grammar)
    free, _ = run(runtime, ids, None)
    spec = runtime.variant(runtime.config.replace(builder=builder))
    got, stats = run(spec, ids, grammar)
    assert got == want and got != free
    answer = json.loads(runtime.tokenizer.decode(got, skip_special_tokens=True))
    assert set(answer) == {"kind", "age", "name"} and answer["kind"] in ("cat", "dog", "fish")
    assert 0 <= answer["age"] <= 99 and len(answer["name"]) <= 6
    g = stats["grammar"]
    assert g["target_rows"] >= stats["steps"]
    if builder != "recycling":                                   # masked while growing: nothing dead verified
        assert g["dead"] == 0 and g["draft_rows"] > 0 and stats["tokens_per_step"] > 1


def test_a_bad_schema_is_one_config_error(runtime) -> None:
    with pytest.raises(ConfigError, match="not valid"):
        runtime.grammars.constraint(runtime.grammars.json_schema({"type": "bogus"}))


# schemas llguidance compiles but cannot follow (issue 55): each fails within its first tokens
BEYOND_LIMITS = {"recursive": ({"type": "object", "properties": {"c": {"$ref": "#"}}, "required": ["c"]},
                               "Too many items"),
                 "a $ref loop": ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                  "$ref": "#/$defs/a"}, "admits no value"),
                 "1,000 optional properties": ({"type": "object", "properties": {
                     f"p{i}": {"type": "integer"} for i in range(1000)}}, "max is 2000")}


@pytest.mark.parametrize("name", BEYOND_LIMITS)
def test_a_schema_beyond_the_librarys_limits_is_a_config_error_before_generating(runtime, name: str) -> None:
    schema, limit = BEYOND_LIMITS[name]
    with pytest.raises(ConfigError, match=f"beyond the grammar library's limits .*{limit}"):
        runtime.grammars.check(runtime.grammars.json_schema(schema))


def test_a_limit_met_while_generating_ends_the_text_where_the_target_alone_ends(runtime) -> None:
    """A schema whose limit (a 1,000-property object's Earley row) comes after a free string: the probe
    passes; greedy decoding ends before the token the library cannot take, the same with a tree as without."""
    big = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1000)}}
    schema = {"type": "object", "properties": {"first_property_name": {"type": "string", "maxLength": 12},
                                               "b": big},
              "required": ["first_property_name", "b"], "additionalProperties": False}
    grammar = runtime.grammars.json_schema(schema)
    runtime.grammars.check(grammar)
    ids = runtime.encode("Describe a pet.", chat=True)
    want, alone_stats = run(runtime.variant(runtime.config, use_draft=False), ids, grammar)
    got, stats = run(runtime, ids, grammar)
    assert got == want and 20 < len(got) < 80
    assert runtime.tokenizer.decode(got).startswith('{"first_property_name": "')
    assert "max is 2000" in stats["grammar"]["limit"] and stats["grammar"]["dead"] == 0
    assert alone_stats["grammar"]["limit"] == stats["grammar"]["limit"] and stats["tokens_per_step"] > 1


@pytest.mark.slow
def test_sampling_under_a_grammar_follows_the_constrained_target(tiny_small_pair) -> None:
    target_path, draft_path = tiny_small_pair
    runtime = Runtime.load(str(target_path), None, EngineConfig(dtype="float32"))
    grammars = Grammars(runtime.tokenizer, runtime.target_info.args.vocab_size, sorted(runtime.engine.eos_ids))
    grammar = grammars.lark('start: /[a-m]+ [n-z0-9 ]+/')
    target, draft = load_model(target_path), load_model(draft_path)
    sampling = SamplingParams(temperature=1.0)
    engine = Engine(target, draft, EngineConfig(budget=6), SpecExecBuilder())
    counts = sample_pairs(engine, sampling, 600, PROMPT, lambda: grammars.constraint(grammar))
    exact = exact_pairs(target, sampling, PROMPT, grammars.constraint(grammar))
    assert chi2_pvalue(counts, exact) > 1e-3
    free = exact_pairs(target, sampling, PROMPT)
    assert chi2_pvalue(counts, free) < 1e-6                      # the check can tell the grammar's absence
