"""Grammars over a model's tokenizer, with llguidance: a JSON schema (or a Lark grammar, e.g. a tool call's
envelope around its arguments' schema) -> a fresh Constraint (specexec/constraint.py) for one generation.

Why llguidance: on the tree's access pattern (one parser state walked along the tree by rolling back to the
common prefix and consuming the rest, a mask at every node) it is within a small factor of xgrammar per node,
compiles a per-request schema several times faster, and its wheel has no dependencies (xgrammar's brings triton
and a TVM runtime into a CPU install); the measured costs are in docs/algorithms.md (grammars inside the tree).

`Grammars` holds what is built once per tokenizer (llguidance's tokenizer view, built on first use: seconds for
a 150k vocabulary) and checks a grammar before it is used: a bad schema is a ConfigError naming the problem.
The grammar allows the end-of-sequence tokens only where it is complete.

Does not know: HTTP, tool formats (specexec/serving/tools.py builds their grammars), models and trees.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

import torch

from specexec.constraint import MatcherConstraint
from specexec.options import ConfigError


JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise ConfigError("structured output (JSON schemas, tool calls) needs llguidance, which is not "
                          "installed: pip install 'specexec[serve]'") from None
    return llguidance


class LLMatcher:
    """specexec.constraint.Matcher over an llguidance.LLMatcher. Consuming never enters its error state:
    try_consume_tokens stops at the first token the grammar rejects. An end-of-sequence token is taken only
    where the grammar is complete, and only here: llguidance's own rollback over one it consumed can undo a
    token too many, so the end is kept beside its state (`ended`), and nothing is consumed after it."""

    def __init__(self, matcher: Any, eos_ids: Sequence[int]) -> None:
        self.m, self.eos = matcher, set(eos_ids)
        self.ended = False

    def consume(self, tokens: Sequence[int]) -> int:
        if self.ended:
            return 0
        tokens = list(tokens)
        cut = next((i for i, t in enumerate(tokens) if t in self.eos), len(tokens))
        done = self.m.try_consume_tokens(tokens[:cut]) if cut else 0
        if done < cut or cut == len(tokens) or not self.m.is_accepting():
            return done
        self.ended = True
        return done + 1

    def rollback(self, n: int) -> None:
        if self.ended and n > 0:
            self.ended, n = False, n - 1
        if n:
            self.m.rollback(n)

    def fill(self, out: torch.Tensor) -> None:
        self.m.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * out.element_size())


class Grammars:
    """Grammars for one tokenizer: vocab (the logits' width: ids past the tokenizer's are never allowed) and
    the end-of-sequence ids the grammar allows once complete."""

    def __init__(self, tokenizer, vocab: int, eos_ids: Sequence[int]) -> None:
        self.tokenizer, self.vocab, self.eos_ids = tokenizer, vocab, sorted(eos_ids)
        self._view = None
        self._lock = threading.Lock()

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

    def check(self, grammar: str) -> None:
        """ConfigError with llguidance's message when the grammar is not valid for this tokenizer."""
        error = _llguidance().LLMatcher.validate_grammar(grammar, self.view())
        if error:
            raise ConfigError(f"the grammar is not valid: {error.splitlines()[0]}")

    def constraint(self, grammar: str) -> MatcherConstraint:
        """A fresh constraint for one generation under `grammar` (checked first)."""
        ll = _llguidance()
        self.check(grammar)
        matcher = ll.LLMatcher(self.view(), grammar, log_level=0)
        if matcher.is_error():
            raise ConfigError(f"the grammar is not valid: {matcher.get_error()}")
        return MatcherConstraint(LLMatcher(matcher, self.eos_ids), self.vocab)


def schema_text(schema: dict) -> str:
    """A schema as compact JSON (for embedding it in a Lark grammar)."""
    return json.dumps(schema, separators=(",", ":"))
