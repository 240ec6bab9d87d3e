"""VocabTrim: the draft's LM head restricted to the N tokens the target samples most often.

Goel et al., "VocabTrim" (ICML'25, arXiv 2506.22694); docs/algorithms.md §15 (EAGLE-3's reduced draft vocabulary is
the same mechanism). A drafter's V x D head is a large share of its bytes per pass; most of the vocabulary is
never proposed. `TrimmedDraft` wraps the draft model: forward() is unchanged, logits() multiplies by the N kept
rows only and returns full-vocabulary logits with -inf elsewhere, so q(x) = 0 outside the set: every builder
and verifier keeps working unchanged, tokens outside the set are never drafted, and exactness is unaffected
(q is still the distribution the children were drawn from; the target's p is untouched).

The kept set: token counts measured from target samples (`measure_counts`: target-distributed samples on a
prompt set, drawn through any Engine - speculative sampling is exact, so a draft may speed it up; cached as
JSON under the cache root by `load_or_measure_counts`, specexec/tuning/store.py), or from any token list for
tests (`counts_from_tokens`). `select_vocab` ranks by count (ties: lower id, i.e. the earlier BPE merge) and
always keeps `always` (EOS, chat tokens). `auto_size` picks N when the user says `--draft-vocab auto`.

Does not know: tokenizers and prompts beyond the ids it is handed, builders, verification.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from offload.quant.linear import QuantLinear

from specexec.network.model import soft_cap
from specexec.tuning.store import read_json, store_path, write_json

AUTO_MIN = 8192          # --draft-vocab auto: at least this many tokens (or the whole vocabulary)


class TrimmedDraft(nn.Module):
    """A draft Transformer whose logits() only scores `keep` (long [N], sorted ids); forward() delegates. A
    quantized head (a QuantLinear, e.g. --draft-quant int4's int8 head on a CPU) stays quantized in the same
    format over the kept rows, so trimming cuts the head's bytes per pass by V/N instead of trading 8-bit rows
    for fp32 ones."""

    def __init__(self, model: nn.Module, keep: torch.Tensor) -> None:
        super().__init__()
        vocab = model.args.vocab_size
        keep = torch.unique(keep.long().cpu())
        if keep.numel() == 0 or int(keep[0]) < 0 or int(keep[-1]) >= vocab:
            raise ValueError(f"the kept ids must be non-empty and in [0, {vocab}), got {keep.numel()} ids")
        self.model, self.args = model, model.args
        weight = model.head_weight
        self.register_buffer("keep", keep.to(weight.device), persistent=False)
        kept = weight.detach().index_select(0, self.keep).clone()
        head = model._modules.get("lm_head")
        self.head: QuantLinear | None = None
        if isinstance(head, QuantLinear) and head.fmt != "none":
            rows = nn.Linear(kept.shape[1], kept.shape[0], bias=False, device="meta")
            rows.weight = nn.Parameter(kept, requires_grad=False)
            self.head = QuantLinear.from_linear(rows, head.fmt, head.dtype)
            kept = None
        self.register_buffer("weight", kept, persistent=False)

    @property
    def n_kept(self) -> int:
        return int(self.keep.numel())

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self.model(*args, **kwargs)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.embed(tokens)

    def decode(self, *args, **kwargs) -> torch.Tensor:
        return self.model.decode(*args, **kwargs)

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [..., D] -> fp32 logits [R, V]: the kept rows' scores, -inf for every other token."""
        h = hidden.reshape(-1, hidden.shape[-1])
        if rows is not None:
            h = h.index_select(0, rows)
        scores = F.linear(h, self.weight) if self.head is None else self.head(h)
        small = soft_cap(scores.float(), self.args.logit_softcap)                      # [R, N] (Gemma 2: capped)
        out = small.new_full((h.shape[0], self.args.vocab_size), float("-inf"))
        return out.index_copy_(1, self.keep, small)


def counts_from_tokens(tokens: Iterable[int] | torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Occurrence counts [V] (float64) of the ids in `tokens`."""
    ids = torch.as_tensor(list(tokens) if not isinstance(tokens, torch.Tensor) else tokens, dtype=torch.long)
    return torch.bincount(ids.flatten().cpu(), minlength=vocab_size)[:vocab_size].double()


def select_vocab(counts: torch.Tensor, n: int, always: Sequence[int] = ()) -> torch.Tensor:
    """The n ids with the highest counts (ties: lower id), plus every id in `always`; sorted long [>= n]."""
    V = counts.numel()
    n = max(1, min(n, V))
    order = torch.sort(counts.double() - torch.arange(V, dtype=torch.float64) / (2 * V), descending=True).indices
    return torch.unique(torch.cat([order[:n], torch.tensor(list(always), dtype=torch.long)]))


def auto_size(counts: torch.Tensor) -> int:
    """--draft-vocab auto: four times the number of distinct sampled ids, a power of two, at least AUTO_MIN
    (a calibration run sees only part of what the target will say), at most the vocabulary."""
    distinct = int((counts > 0).sum())
    return min(counts.numel(), max(AUTO_MIN, 1 << max(0, (4 * distinct - 1).bit_length())))


def measure_counts(generate: Callable[[list[int]], list[int]], prompts: Sequence[list[int]],
                   vocab_size: int) -> torch.Tensor:
    """Counts [V] of the ids `generate(prompt_ids)` returns (target samples) over every prompt."""
    total = torch.zeros(vocab_size, dtype=torch.float64)
    for ids in prompts:
        total += counts_from_tokens(generate(list(ids)), vocab_size)
    return total


def cache_path(key: str) -> Path:
    """Where counts for `key` (target, prompts and settings) are cached: <cache root>/vocab/ (tuning/store.py)."""
    return store_path("vocab", hashlib.sha256(key.encode()).hexdigest()[:16])


def load_or_measure_counts(key: str, vocab_size: int, measure: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Cached counts for `key`, else measure() them and write the cache (atomically; a damaged or foreign
    file is measured again)."""
    path = cache_path(key)
    data = read_json(path)
    if data is not None and data.get("key") == key and data.get("vocab_size") == vocab_size:
        try:
            counts = torch.zeros(vocab_size, dtype=torch.float64)
            for token, c in data["counts"].items():
                counts[int(token)] = float(c)
            return counts
        except (AttributeError, KeyError, IndexError, TypeError, ValueError):
            pass
    counts = measure()
    sparse = {str(i): float(counts[i]) for i in torch.nonzero(counts).flatten().tolist()}
    write_json(path, {"key": key, "vocab_size": vocab_size, "counts": sparse})
    return counts
