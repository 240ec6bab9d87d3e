"""A draft whose embedding table has another number of rows than the target's: its logits in the target's.

Pairs of one family often pad their tables differently (Qwen2.5-0.5B has 151,936 rows, Qwen2.5-72B 152,064,
both beyond the 151,665 tokens of their shared tokenizer), and a draft's vocabulary may be a prefix of the
target's (specexec.runtime.tokenizer.check_compatible says which pairs go). Builders and verifiers compare the
draft's distributions with the target's row for row, so `AlignedDraft.logits` returns exactly the target's V
columns: the draft's own where both tables have a row, -inf beyond (a draft never proposes a token the target
cannot score, and q(x) = 0 for the rows the draft lacks, which keeps every acceptance rule exact: q is still the
distribution the tree was drawn from).

Does not know: tokenizers, builders, the target.
"""
from __future__ import annotations

import torch
from torch import nn


class AlignedDraft(nn.Module):
    """`model` (any draft: forward/logits/args) with logits() over `vocab` columns; forward() delegates."""

    def __init__(self, model: nn.Module, vocab: int) -> None:
        super().__init__()
        self.model, self.args, self.vocab = model, model.args, vocab

    def forward(self, tokens: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """The draft's forward; a token it has no row for (the target's own, e.g. a prompt or bonus token
        beyond a prefix vocabulary) is read as token 0: what the draft proposes after it is then only a guess,
        which verification judges like any other."""
        rows = self.args.vocab_size
        if rows < self.vocab:
            tokens = torch.where(tokens < rows, tokens, torch.zeros_like(tokens))
        return self.model(tokens, *args, **kwargs)

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [..., D] -> fp32 logits [R, vocab]: the draft's first min(V_draft, vocab) columns, -inf after."""
        own = self.model.logits(hidden, rows)
        if own.shape[-1] >= self.vocab:
            return own[:, :self.vocab]
        return torch.nn.functional.pad(own, (0, self.vocab - own.shape[-1]), value=float("-inf"))


def align_vocab(draft: nn.Module | None, vocab: int) -> nn.Module | None:
    """The draft as is when its logits already have `vocab` columns (or there is none), else AlignedDraft."""
    if draft is None or draft.args.vocab_size == vocab:
        return draft
    return AlignedDraft(draft, vocab)
