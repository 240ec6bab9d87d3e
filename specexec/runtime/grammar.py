"""Grammars over a model's tokenizer, with llguidance: a JSON schema (or a Lark grammar, e.g. a tool call's
envelope around its arguments' schema) -> a fresh Constraint (specexec/constraint.py) for one generation.

Why llguidance: on the tree's access pattern (one parser state walked along the tree by rolling back to the
common prefix and consuming the rest, a mask at every node) it is within a small factor of xgrammar per node,
compiles a per-request schema several times faster, and its wheel has no dependencies (xgrammar's brings triton
and a TVM runtime into a CPU install); the measured costs are in docs/algorithms.md (grammars inside the tree).

`Grammars` holds what is built once per tokenizer (llguidance's tokenizer view, built on first use: seconds for
a 150k vocabulary) and checks a grammar before it is used: a bad schema is a ConfigError naming the problem.
The grammar allows the end-of-sequence tokens only where it is complete.

llguidance's limits (LIMITS, set here explicitly: Earley items per row and per step, lexer fuel and states,
grammar size) are hit while generating, not when compiling: its mask can allow a token whose consumption then
exceeds one (a recursive schema, 1,000 optional properties, `(a{1000}){1000}`), or a mask it cannot compute (a
`$ref` loop: no value at all), and its matcher then stays in an error state. `check` walks the first PROBE
tokens (trying the TRIES lowest ids each mask allows) so that a grammar that fails at once is a ConfigError naming the limit
before a generation starts; one that fails later raises GrammarLimit from the matcher, which rebuilds itself on
the tokens before the call, and the generation ends there (specexec/constraint.py).

Does not know: HTTP, tool formats (specexec/serving/tools.py builds their grammars), models and trees.
"""
from __future__ import annotations

import collections
import json
import threading
from collections.abc import Sequence
from typing import Any

import torch

from specexec.constraint import GrammarLimit, MatcherConstraint, unpack_bits
from specexec.options import ConfigError


JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's parser limits, named (its defaults as of 1.x; verbose errors off: messages are one line, no state)
LIMITS = {"max_items_in_row": 2000, "initial_lexer_fuel": 1_000_000, "step_lexer_fuel": 200_000,
          "step_max_items": 50_000, "max_lexer_states": 250_000, "max_grammar_size": 500_000,
          "verbose_errors": False}
MAX_CHARS = 256_000            # a grammar's text (a schema's JSON) at most: past it, compiling alone takes seconds
CHECKED = 64                   # grammars remembered as checked (a server's worker does not check them again)
PROBE, TRIES = 8, 32          # how far `check` walks before a generation, how many tokens it tries at each step


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise ConfigError("structured output (JSON schemas, tool calls) needs llguidance, which is not "
                          "installed: pip install -e '.[serve]'") from None
    return llguidance


def limit_message(error: str) -> str:
    """llguidance's error as one line naming the limit (its first line; a mask it could not compute says so)."""
    line = error.strip().splitlines()[0] if error.strip() else "unknown error"
    if "NoExtension" in line:
        return "no text can follow here (the schema admits no value, e.g. a $ref loop)"
    return line


class LLMatcher:
    """specexec.constraint.Matcher over an llguidance.LLMatcher. A rejected token never enters its error
    state: try_consume_tokens stops at the first token the grammar rejects. An end-of-sequence token is taken
    only where the grammar is complete, and only here: llguidance's own rollback over one it consumed can undo a
    token too many, so the end is kept beside its state (`ended`), and nothing is consumed after it. A limit
    (the error state llguidance never leaves) raises GrammarLimit after a copy of the last state restored (or
    a fresh matcher, `make`) has consumed the rest of the tokens consumed before the call."""

    def __init__(self, make: Any, eos_ids: Sequence[int], vocab: int) -> None:
        self.make, self.m, self.eos = make, make(), set(eos_ids)
        self.ended = False
        self.done: list[int] = []                      # consumed tokens, end of sequence excepted
        self.masked = False                            # the last call computed the mask here
        self.scratch = torch.empty((vocab + 31) // 32, dtype=torch.int32)
        self.saved: tuple[list[int], Any] = ([], self.m.deep_copy())     # a state to restore from, its tokens

    def _limit(self, keep: int) -> None:
        """Raise GrammarLimit when the matcher is in its error state, first standing on done[:keep] again
        (where it stood before the call)."""
        if not self.m.is_error():
            return
        message = limit_message(self.m.get_error())
        done = self.done[:keep]
        base, copy = self.saved
        if done[:len(base)] != base:
            base, copy = [], self.make()
        self.m, self.masked, self.done = copy.deep_copy(), False, list(base)
        for t in done[len(base):]:                     # they went in before, the same way: the same state again
            self._step(t)
        self.saved = (list(done), self.m.deep_copy())
        raise GrammarLimit(message)

    def consume(self, tokens: Sequence[int]) -> int:
        if self.ended:
            return 0
        tokens = list(tokens)
        cut = next((i for i, t in enumerate(tokens) if t in self.eos), len(tokens))
        done, before = 0, len(self.done)
        for t in tokens[:cut]:
            if not self._step(t):
                break
            done += 1
        self._limit(before)
        if done < cut or cut == len(tokens) or not self.m.is_accepting():
            return done
        self.ended = True
        return done + 1

    def _step(self, token: int) -> bool:
        """Consume one token right after a mask at its parent, as a decoder without a tree does: where
        llguidance hits a limit depends on its calls (a consume after a mask can exceed one that a consume
        alone does not), so every path goes in by the same calls, whatever the tree around it."""
        if not self.masked:
            self.m.unsafe_compute_mask_ptr(self.scratch.data_ptr(), self.scratch.numel() * 4)
            if self.m.is_error():
                return False
        self.masked = False
        if not self.m.try_consume_tokens([token]):
            return False
        self.done.append(token)
        return True

    def rollback(self, n: int) -> None:
        if self.ended and n > 0:
            self.ended, n = False, n - 1
        if n:
            self.m.rollback(n)
            del self.done[len(self.done) - n:]
            self.masked = False

    def fill(self, out: torch.Tensor) -> None:
        self.m.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * out.element_size())
        self._limit(len(self.done))
        self.masked = True


class Grammars:
    """Grammars for one tokenizer: vocab (the logits' width: ids past the tokenizer's are never allowed) and
    the end-of-sequence ids the grammar allows once complete."""

    def __init__(self, tokenizer, vocab: int, eos_ids: Sequence[int]) -> None:
        self.tokenizer, self.vocab, self.eos_ids = tokenizer, vocab, sorted(eos_ids)
        self._view = None
        self._lock = threading.Lock()
        self._checked: collections.OrderedDict[str, None] = collections.OrderedDict()

    def view(self) -> Any:
        """llguidance's tokenizer view (built once, on first use)."""
        with self._lock:
            if self._view is None:
                ll = _llguidance()
                try:
                    self._view = ll.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab, eos_token=self.eos_ids)
                except ValueError as e:
                    raise ConfigError(f"structured output needs a fast (tokenizer.json) tokenizer: {e}") from None
            return self._view

    @staticmethod
    def json_schema(schema: dict | None) -> str:
        """A grammar for JSON that validates against `schema` (None: any JSON object), on one line with
        json.dumps' separators (", ", ": "): free whitespace would let a model pad forever."""
        ll = _llguidance()
        try:
            return ll.LLMatcher.grammar_from_json_schema(schema if schema is not None else {"type": "object"},
                                                         defaults=JSON_STYLE)
        except ValueError as e:
            raise ConfigError(f"the JSON schema is not usable: {e}") from None

    @staticmethod
    def lark(text: str) -> str:
        """A grammar from Lark text (llguidance's dialect: %json{...} embeds a JSON schema)."""
        return _llguidance().LLMatcher.grammar_from_lark(text)

    def _matcher(self, grammar: str) -> Any:
        ll = _llguidance()
        return ll.LLMatcher(self.view(), grammar, log_level=0, limits=ll.LLParserLimits(**LIMITS))

    def check(self, grammar: str) -> None:
        """ConfigError when the grammar is longer than MAX_CHARS, with llguidance's message when it is not valid
        for this tokenizer, or when it hits one of llguidance's limits near its start: along the first PROBE
        tokens (the lowest id each mask allows), each of the TRIES lowest allowed tokens is consumed (after a mask,
        as a generation does) and rolled back. The last CHECKED grammars that passed are not checked again."""
        with self._lock:
            if grammar in self._checked:
                return
        if len(grammar) > MAX_CHARS:
            raise ConfigError(f"the grammar is {len(grammar):,} characters long, over the {MAX_CHARS:,} this server "
                              "compiles (e.g. thousands of properties): simplify the schema")
        ll = _llguidance()
        error = ll.LLMatcher.validate_grammar(grammar, self.view(), limits=ll.LLParserLimits(**LIMITS))
        if error:
            raise ConfigError(f"the grammar is not valid: {error.splitlines()[0]}")
        m = self._matcher(grammar)
        words = torch.empty((self.vocab + 31) // 32, dtype=torch.int32)
        for _ in range(PROBE):
            m.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
            tries = [t for t in unpack_bits(words[None], self.vocab)[0].nonzero()[:, 0].tolist()
                     if t not in self.eos_ids][:TRIES]
            for t in tries if not m.is_error() else ():
                m.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)   # as a generation consumes
                consumed = not m.is_error() and m.try_consume_tokens([t])
                if m.is_error():
                    break
                if consumed:
                    m.rollback(1)
            if m.is_error():
                raise ConfigError(f"the grammar is beyond the grammar library's limits (llguidance: "
                                  f"{limit_message(m.get_error())}); simplify the schema (fewer alternatives or "
                                  "properties, no unbounded recursion, smaller repetition counts)")
            m.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
            if not tries or not m.try_consume_tokens(tries[:1]):
                break
        with self._lock:
            self._checked[grammar] = None
            while len(self._checked) > CHECKED:
                self._checked.popitem(last=False)

    def constraint(self, grammar: str) -> MatcherConstraint:
        """A fresh constraint for one generation under `grammar` (checked first)."""
        self.check(grammar)
        matcher = LLMatcher(lambda: self._matcher(grammar), self.eos_ids, self.vocab)
        if matcher.m.is_error():
            raise ConfigError(f"the grammar is not valid: {matcher.m.get_error()}")
        return MatcherConstraint(matcher, self.vocab)


def schema_text(schema: dict) -> str:
    """A schema as compact JSON (for embedding it in a Lark grammar)."""
    return json.dumps(schema, separators=(",", ":"))
