"""A constraint on the generated tokens (a grammar: JSON schema, tool call) as a mask on both sides of a step.

`Constraint` answers one question for a batch of tree nodes: which tokens may follow each of them. A node is
named by its path: the tokens from just below the tree's root down to the node itself, relative to the text
committed so far (node 0, the root, is the empty path). The draft asks for the rows it expands while a tree
grows (builders/growth.DraftPasses), the engine for every node it verifies; both hand the mask to
sampling.process_logits, which sets every other token to -inf before anything else looks at the logits. So the
draft never proposes a token the grammar forbids, and every emitted token is the constrained target's.
`commit(tokens)` moves the committed state past a step's accepted tokens.

`tree_paths` names every node of a TokenTree by its path. `Matcher` is what a grammar library supplies
(specexec/runtime/grammar.py binds llguidance): one parser state moved along the tree by rolling back to the
common prefix and consuming the rest, never copied per branch; `MatcherConstraint` turns it into a Constraint:
masks memoised per path for the step (the target reuses the draft's), rows in path order so moves are short. A
node after the end of the text, or whose path the grammar rejects ("dead": an unmasked draft's token, or below
such a node or the end), allows nothing as a draft row (the draft grows nothing there) and everything as a target
row (no target row is all -inf; the engine stops at the end, and a dead node is never accepted: its parent's mask
forbids its token).

A grammar library has limits of its own (llguidance: Earley items per row or per step, lexer states): a mask can
allow a token whose consumption the library then refuses, or the library cannot compute a path's mask at all.
That is not a rejection (the grammar allowed the token) but the end of what the library can follow: the matcher
raises GrammarLimit and stands where it stood before the call, and the path is "limited". A limited path grows
nothing as a draft row and allows everything as a target row, like a dead one; but it can be accepted (its token
was allowed), so `commit` keeps the accepted tokens up to the first one the library could not take (or, when it
could not compute a node's mask, up to that node) and returns how many it kept: the engine ends the generation
there (`limit`, the library's message, joins the counters). Exactly where the target alone under the same
library ends: that step commits the same tokens, then fails on the same one.

Counters (`stats`): draft_rows / target_rows masked, `pruned` (over the draft's expanded nodes: the tokens the
grammar forbade that the draft ranked above the best token it allows, i.e. proposals it would have tried
first), `dead` (verified nodes the grammar rejects: zero when the draft was masked), mask_ms.

Does not know: which grammar, tokenizers and text, models, builders, acceptance rules.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from specexec.tree import TokenTree

Path = tuple[int, ...]
DEAD, END, LIMIT = "dead", "end", "limit"          # memo entries of paths without a mask


class GrammarLimit(RuntimeError):
    """The grammar library cannot follow the text past this point (a limit of its own, not a rejection)."""


@runtime_checkable
class Constraint(Protocol):
    """Which tokens may follow each path below the committed text (see the module docstring)."""

    stats: dict

    def allowed(self, paths: Sequence[Path], vocab: int, device: torch.device,
                draft_logits: Tensor | None = None) -> Tensor:
        """bool [R, vocab]: row r = the tokens allowed after paths[r]. draft_logits [R, V] (the draft's own,
        before the mask): the rows are the draft's, counted as such (draft_rows, pruned)."""

    def commit(self, tokens: Sequence[int]) -> int:
        """The step's accepted tokens (then the bonus) become committed text; -> how many of them the grammar
        library could follow (fewer than given: the generation ends after those)."""


class Matcher(Protocol):
    """A grammar library's parser state over token ids (specexec/runtime/grammar.py); `ended`: the last token
    it consumed ended the text (an end-of-sequence token where the grammar is complete). consume and fill
    raise GrammarLimit where the library hits a limit of its own; the matcher then stands where it stood
    before the call."""

    ended: bool

    def consume(self, tokens: Sequence[int]) -> int:
        """Consume as many of `tokens` as the grammar accepts, in order; -> how many it consumed."""

    def rollback(self, n: int) -> None:
        """Undo the last n consumed tokens."""

    def fill(self, out: Tensor) -> None:
        """out int32 [W]: the allowed tokens at this state as a bitmask (bit t % 32 of word t // 32)."""


def tree_paths(tree: TokenTree) -> list[Path]:
    """Every node's path (node 0: ()), from one host transfer of the tree's parents and tokens."""
    n = tree.tokens.numel()
    host = torch.cat([tree.parents, tree.tokens]).tolist()
    parents, tokens = host[:n], host[n:]
    paths: list[Path] = [()]
    for v in range(1, n):
        paths.append(paths[parents[v]] + (tokens[v],))
    return paths


def unpack_bits(words: Tensor, vocab: int) -> Tensor:
    """int32 bitmasks [R, W] -> bool [R, vocab] (bit t % 32 of word t // 32; bits past vocab dropped)."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words[:, :, None] >> shifts) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab].bool()


class MatcherConstraint:
    """A Constraint over one Matcher whose state is the committed text plus `_at` (the path it stands on)."""

    def __init__(self, matcher: Matcher, vocab: int) -> None:
        self.matcher, self.vocab = matcher, vocab
        self.words = (vocab + 31) // 32
        self._at: list[int] = []                       # tokens consumed beyond the committed text
        self._memo: dict[Path, Tensor | str] = {}      # path -> bitmask [W], DEAD, END or LIMIT, this step
        self._why: dict[Path, str] = {}                # a limited path -> the library's message, this step
        self.stats: dict = {"draft_rows": 0, "target_rows": 0, "pruned": 0, "dead": 0, "mask_ms": 0.0}

    def _move(self, path: Path) -> bool:
        """Stand on `path`: roll back to the common prefix, consume the rest; False when the grammar rejects
        it (the matcher then stands on its longest accepted prefix). GrammarLimit: it stands on the common
        prefix."""
        at, common = self._at, 0
        for a, b in zip(at, path):
            if a != b:
                break
            common += 1
        if len(at) > common:
            self.matcher.rollback(len(at) - common)
            del at[common:]
        rest = path[common:]
        done = self.matcher.consume(rest) if rest else 0
        at.extend(rest[:done])
        return done == len(rest)

    def _masks(self, paths: Sequence[Path]) -> tuple[Tensor, list[bool], int]:
        """int32 [R, W] bitmasks, whether each path has no mask (dead or past the end; its row all ones), and
        how many are dead; unknown paths filled in path order."""
        for path in sorted({p for p in paths if p not in self._memo}):
            if path[:-1] in self._memo and not isinstance(self._memo[path[:-1]], Tensor):
                self._memo[path] = DEAD                # below a dead or limited node, or the end
                continue
            try:
                if not self._move(path):
                    self._memo[path] = DEAD
                elif self.matcher.ended:
                    self._memo[path] = END
                else:
                    row = torch.empty(self.words, dtype=torch.int32)
                    self.matcher.fill(row)
                    self._memo[path] = row
            except GrammarLimit as e:
                self._memo[path] = LIMIT
                self._why[path] = str(e)
        rows = [self._memo[p] for p in paths]
        none = [not isinstance(r, Tensor) for r in rows]
        full = torch.full((self.words,), -1, dtype=torch.int32)
        return torch.stack([full if n else r for r, n in zip(rows, none)]), none, sum(r is DEAD for r in rows)

    def allowed(self, paths: Sequence[Path], vocab: int, device: torch.device,
                draft_logits: Tensor | None = None) -> Tensor:
        t0 = time.perf_counter()
        words, none, dead = self._masks(paths)
        if draft_logits is not None and any(none):
            words[torch.tensor(none)] = 0
        mask = unpack_bits(words, self.vocab).to(device)
        if mask.shape[1] < vocab:                      # logits rows past the grammar's vocabulary: never allowed
            mask = torch.nn.functional.pad(mask, (0, vocab - mask.shape[1]))
        mask = mask[:, :vocab]
        if draft_logits is None:
            self.stats["target_rows"] += len(paths)
            self.stats["dead"] += dead
        else:
            x = draft_logits.float()
            best = x.masked_fill(~mask, float("-inf")).amax(dim=-1, keepdim=True)
            self.stats["draft_rows"] += len(paths)
            self.stats["pruned"] += int(((x > best) & ~mask & mask.any(dim=-1, keepdim=True)).sum())
        self.stats["mask_ms"] += 1000 * (time.perf_counter() - t0)
        return mask

    def commit(self, tokens: Sequence[int]) -> int:
        """Stand on the accepted path and make it the committed text (the masks of this step are dropped);
        -> how many tokens it kept: all, or up to the first the grammar library could not follow (a limited
        node's token, or the token after a node whose mask it could not compute)."""
        path, kept = tuple(tokens), len(tokens)
        for i in range(len(path)):                     # one token at a time: the matcher stands on path[:i]
            if self._memo.get(path[:i]) is LIMIT:      # no mask here: the token below was not the grammar's
                self.stats["limit"], kept = self._why[path[:i]], i
                break
            try:
                moved = self._move(path[:i + 1])
            except GrammarLimit as e:
                self.stats["limit"], kept = str(e), i
                break
            if not moved:
                raise ValueError(f"the grammar rejects the accepted tokens {list(path)}: a step emitted a "
                                 "token its own mask forbids")
        self._at, self._memo, self._why = [], {}, {}
        return kept
