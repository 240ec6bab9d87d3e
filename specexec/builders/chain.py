"""Chain builder: classic speculative decoding, one sequence of k = budget draft tokens.

Leviathan et al., ICML'23 (arXiv 2211.17192); Chen et al. (arXiv 2302.01318). Each draft pass extends the
chain by one token: its argmax at temperature 0, else a sample from the processed draft distribution q. A
sampled chain is a tree with one child per node drawn from q, i.e. a without-replacement sample of size 1, so
rrs_wor is exactly ordinary speculative sampling (accept with min(1, p/q), else draw
from norm(max(p - q, 0))). `draft_probs` hands the verifier the q each token was drawn from.

`min_path_prob` (default 0: off) stops the chain once the draft's probability of the whole chain falls below
it; the decision looks only at tokens already drawn, so exactness is unaffected. Without it a chain makes no
host sync at all while drafting (a top-1 or a single draw never comes back empty); with it, one per pass.

Does not know: the target model, verification, the draft's internals (growth.Passes runs it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specexec.config import SamplingParams
from specexec.tree import TokenTree
from specexec.builders.growth import DrawsWithoutReplacement, Growth, draft_passes, host_values, pick_children
from specexec.builders.registry import register


@register
@dataclass
class ChainBuilder(DrawsWithoutReplacement):
    min_path_prob: float = 0.0
    name: str = "chain"
    drafting: str = "without_replacement"
    needs_draft: bool = True

    def build(self, draft, root_token: int, budget: int, sampling: SamplingParams,
              rng: torch.Generator | None = None) -> TokenTree:
        """A chain of up to `budget` draft tokens under `root_token` (budget draft passes at most)."""
        passes = draft_passes(draft, budget + 1, sampling)
        logq = passes.root(root_token)
        self._q.reset(logq, passes, keep=not sampling.greedy)
        g = Growth(root_token, budget + 1, logq.device)
        stop = math.log(self.min_path_prob) if self.min_path_prob > 0 else -math.inf
        for depth in range(1, budget + 1):
            last = g.n - 1
            _, _, tok, lp = pick_children(logq, 1, not sampling.greedy, rng)
            node = g.add(tok, g.parents.new_full((1,), last), g.scores[last:last + 1] + lp)
            if depth == budget or (stop > -math.inf and host_values(g.scores[last + 1])[0] < stop):
                break
            logq = g.expand(passes, node)
            self._q.add(logq)
        finite = torch.isfinite(g.scores[:g.n])                     # where the draft could propose nothing
        return g.tree(passes, torch.arange(int(host_values(finite.sum())[0]), device=finite.device))
