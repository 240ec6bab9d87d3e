"""Logits processing and sampling: SamplingParams -> processed log-probabilities, samples, seeded generators.

`process_logits` applies what transformers' generate() applies, in the same order: repetition penalty,
temperature, top-k, top-p, min-p. Draft and target must both go through it (ALGORITHMS.md §0.3, pitfall 2),
because every acceptance rule assumes p and q are the very distributions plain decoding would sample from.
Samples use the exponential race / Gumbel-max trick with an explicit torch.Generator, so one seed reproduces
a whole run and sampling without replacement (`gumbel_topk`, §0.4) comes from the same construction.

Does not know: models, caches, acceptance rules; trees only to list each node's history (`node_histories`).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .config import SamplingParams
from .tree import TokenTree


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch.Generator on `device`, seeded with `seed` (None: a fresh non-deterministic seed)."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed))
    return gen


def apply_repetition_penalty(logits: Tensor, history: Tensor, penalty: float) -> Tensor:
    """logits float [R, V], history long [R, H] (-1 = padding) -> penalised copy [R, V].

    HF semantics: each distinct id seen in the row's history is penalised once; a logit > 0 is divided by
    `penalty`, any other is multiplied by it.
    """
    if history.shape[0] != logits.shape[0]:
        raise ValueError(f"history has {history.shape[0]} rows but logits have {logits.shape[0]}")
    vocab = logits.shape[-1]
    idx = torch.where(history < 0, vocab, history).clamp(max=vocab)        # padding -> spare column V
    padded = torch.nn.functional.pad(logits, (0, 1))
    seen = padded.gather(1, idx)
    seen = torch.where(seen > 0, seen / penalty, seen * penalty)
    return padded.scatter(1, idx, seen)[:, :vocab]


def _top_k(x: Tensor, k: int) -> Tensor:
    """Keep every logit >= the k-th largest of its row (ties kept, as HF does). x [R, V]."""
    if k <= 0 or k >= x.shape[-1]:
        return x
    kth = torch.topk(x, k, dim=-1).values[:, -1:]
    return x.masked_fill(x < kth, float("-inf"))


def _top_p(x: Tensor, top_p: float) -> Tensor:
    """Keep the smallest most-probable set whose mass reaches top_p; the top token always stays. x [R, V]."""
    if top_p >= 1.0:
        return x
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    p = sorted_x.softmax(dim=-1)
    mass_above = p.cumsum(dim=-1) - p                     # mass of the strictly more probable tokens
    drop_sorted = mass_above >= top_p
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return x.masked_fill(drop, float("-inf"))


def _min_p(x: Tensor, min_p: float) -> Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability. x [R, V]."""
    if min_p <= 0.0:
        return x
    p = x.softmax(dim=-1)
    return x.masked_fill(p < min_p * p.amax(dim=-1, keepdim=True), float("-inf"))


def process_logits(logits: Tensor, sampling: SamplingParams, history: Tensor | None = None) -> Tensor:
    """logits [R, V] (or [V]) -> float32 log-probabilities of the same shape; masked tokens get -inf.

    Order as in transformers' generate: repetition penalty (over each row's `history` [R, H], -1 = padding),
    temperature, top-k, top-p, min-p. At temperature 0 the log-softmax of the penalised logits is returned:
    greedy decoding only uses its argmax, and no warper can change that.
    """
    one_row = logits.dim() == 1
    x = logits.float()[None] if one_row else logits.float()
    if history is not None and sampling.repetition_penalty != 1.0:
        hist = history[None] if history.dim() == 1 else history
        x = apply_repetition_penalty(x, hist.to(x.device), sampling.repetition_penalty)
    if not sampling.greedy:
        x = x / sampling.temperature
        x = _min_p(_top_p(_top_k(x, sampling.top_k), sampling.top_p), sampling.min_p)
    out = torch.log_softmax(x, dim=-1)
    return out[0] if one_row else out


def probs(logits: Tensor, sampling: SamplingParams, history: Tensor | None = None) -> Tensor:
    """Processed probabilities: softmax of `process_logits` (same shapes, float32)."""
    return process_logits(logits, sampling, history).exp()


def _gumbel(like: Tensor, generator: torch.Generator | None) -> Tensor:
    """Standard Gumbel noise shaped like `like` (float32): -log(E), E ~ Exp(1) kept away from 0."""
    e = torch.empty(like.shape, dtype=torch.float32, device=like.device).exponential_(generator=generator)
    return -torch.log(e.clamp_min(torch.finfo(torch.float32).tiny))


def sample(logprobs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One independent draw per row: logprobs [R, V] (or [V]) -> long [R] (or scalar). Gumbel-max: argmax of
    log p + Gumbel noise is distributed as p; -inf entries are never chosen. No host sync."""
    return torch.argmax(logprobs.float() + _gumbel(logprobs, generator), dim=-1)


def greedy(logits: Tensor) -> Tensor:
    """Argmax per row: logits [R, V] (or [V]) -> long [R] (or scalar); ties -> the lowest id."""
    return torch.argmax(logits, dim=-1)


def gumbel_topk(logprobs: Tensor, k: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """k draws without replacement from p = exp(logprobs), in draw order (ALGORITHMS.md §0.4).

    logprobs [V]: returns (tokens long [k'], keys float [k']) with keys = log p + Gumbel, descending, and
    k' = min(k, |support|): zero-probability tokens are dropped rather than proposed (one host sync).
    logprobs [R, V] (a whole frontier at once): returns tokens [R, k], keys [R, k], no host sync; where a row's
    support is smaller than k the tail has token -1 and key -inf.
    """
    if logprobs.dim() not in (1, 2):
        raise ValueError(f"gumbel_topk takes [V] or [R, V] log-probabilities, got shape {tuple(logprobs.shape)}")
    keys = logprobs.float() + _gumbel(logprobs, generator)
    top = torch.topk(keys, min(k, keys.shape[-1]), dim=-1)
    finite = torch.isfinite(top.values)
    if logprobs.dim() == 2:
        return torch.where(finite, top.indices, -1), top.values
    keep = int(finite.sum())
    return top.indices[:keep], top.values[:keep]


def node_histories(tree: TokenTree, prefix_ids: Tensor) -> Tensor:
    """Per node, the ids target-only decoding would have seen before choosing that node's next token.

    prefix_ids long [L]: the committed ids before the root (including the root's own id too is harmless: the
    penalty counts each distinct id once). Returns long [N+1, L + D + 1], -1 padded: the prefix, then the
    node's own token and its ancestors' (root included), deepest first. Row r feeds
    `process_logits(..., history=...)` for the logits computed at node r. Vectorised over depth.
    """
    n = tree.tokens.numel()
    cols, cur = [], torch.arange(n, device=tree.device)
    for _ in range(tree.max_depth() + 1):
        valid = cur >= 0
        cols.append(torch.where(valid, tree.tokens[cur.clamp(min=0)], -1))
        cur = torch.where(valid, tree.parents[cur.clamp(min=0)], cur)
    prefix = prefix_ids.to(device=tree.device, dtype=torch.long).reshape(1, -1).expand(n, -1)
    return torch.cat([prefix, torch.stack(cols, dim=1)], dim=1)
