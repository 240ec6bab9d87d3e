"""What the target says at a verified tree's nodes, read from its hidden states [N+1, D] after the pass (the
engine's verify and observe stages): one choice per node, the processed probabilities at the nodes a rule
visits, the raw top-k after each node, each emitted token's log-prob, and the per-node histories the penalties
read. The LM head runs on LOGIT_CHUNK rows at a time or on the rows asked for, never on the whole tree at once.

Does not know: acceptance rules, caches, the draft, how the hidden states were computed.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from specexec.config import SamplingParams
from specexec.generation import TokenLogprob
from specexec.network.model import LOGIT_CHUNK, Transformer
from specexec.acceptance.relaxed import Relaxation
from specexec.sampling import greedy, is_plain, node_histories, process_logits, sample
from specexec.tree import TokenTree
from specexec.uploads import upload
from specexec.acceptance.rules import Accepted


def histories(tree: TokenTree, L: int, sampling: SamplingParams, context: list[int], generated_from: int,
              device: torch.device) -> tuple[torch.Tensor | None, int]:
    """Per node, the ids target-only decoding would have seen before that node's next token, and the column
    where this call's generated ids begin: ([N+1, H], generated_from), or (None, 0) when no penalty reads them.
    The committed context [0, L) plus the root (context[L]) then the node's path below the root, each id as
    often as in the sequence (frequency counts); this call's ids begin at context[generated_from]. Only the
    repetition penalty reads the prompt, so without it the rows start where generation began (H = generated +
    depth)."""
    if not sampling.needs_history:
        return None, 0
    start = 0 if sampling.repetition_penalty != 1.0 else min(generated_from, L + 1)
    prefix = upload(context[start:L + 1], device)
    return node_histories(tree, prefix, with_root=False), generated_from - start


def choices(target: Transformer, hidden: torch.Tensor, sampling: SamplingParams, rng: torch.Generator | None,
            history: torch.Tensor | None, generated_from: int = 0, allowed: torch.Tensor | None = None,
            relax: Relaxation | None = None) -> torch.Tensor:
    """hidden [N+1, D] -> one target choice per node [N+1]: the argmax (greedy) or an independent sample of the
    processed distribution (sample-and-match). history [N+1, H] (penalties per node over prefix + ancestors,
    see `histories`) when a penalty is set; allowed bool [N+1, V] the constraint's mask per node; relax:
    relaxed acceptance's choice instead (it keeps the exact one)."""
    out = []
    for start in range(0, hidden.shape[0], LOGIT_CHUNK):
        logits = target.logits(hidden[start:start + LOGIT_CHUNK])
        plain = is_plain(sampling, allowed)
        if plain and relax is None:
            out.append(greedy(logits))
            continue
        hist = None if history is None else history[start:start + LOGIT_CHUNK]
        ok = None if allowed is None else allowed[start:start + LOGIT_CHUNK]
        logp = process_logits(logits, sampling, hist, generated_from, ok)
        choice = greedy(logits) if plain else greedy(logp) if sampling.greedy else sample(logp, rng)
        out.append(choice if relax is None else relax.choose(start, logp, choice))
    return torch.cat(out)


def probs_at(target: Transformer, hidden: torch.Tensor, sampling: SamplingParams, history: torch.Tensor | None,
             generated_from: int = 0, allowed: torch.Tensor | None = None) -> Callable[[int], torch.Tensor]:
    """node -> the target's processed probabilities [V] there, computed lazily (only visited nodes)."""
    def probs(node: int) -> torch.Tensor:
        logits = target.logits(hidden[node:node + 1])
        hist = None if history is None else history[node:node + 1]
        ok = None if allowed is None else allowed[node:node + 1]
        return process_logits(logits, sampling, hist, generated_from, ok).exp()[0]
    return probs


def topk(target: Transformer, hidden: torch.Tensor, k: int) -> torch.Tensor:
    """hidden [N+1, D] -> the target's top-k token ids after each node [N+1, k] (raw logits, chunked)."""
    return torch.cat([target.logits(hidden[s:s + LOGIT_CHUNK]).topk(k, dim=-1).indices
                      for s in range(0, hidden.shape[0], LOGIT_CHUNK)])


def logprobs(target: Transformer, hidden: torch.Tensor, acc: Accepted, sampling: SamplingParams, top: int,
             history: torch.Tensor | None, generated_from: int, allowed: torch.Tensor | None,
             device: torch.device) -> list[TokenLogprob]:
    """Each emitted token's log-prob under the target's processed distribution at its parent node (the rows the
    acceptance rule read), and the `top` best there: the LM head on the accepted rows only (one transfer)."""
    rows = upload(acc.nodes, device)
    logp = process_logits(target.logits(hidden[rows]), sampling, None if history is None else history[rows],
                          generated_from, None if allowed is None else allowed[rows])
    tokens = upload(acc.tokens, device)
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    best = logp.topk(min(top, logp.shape[-1]), dim=-1)
    host = torch.cat([chosen, best.values.flatten(), best.indices.flatten().to(chosen.dtype)]).tolist()
    n, k = len(acc.tokens), best.values.shape[1]
    values, ids = host[n:n + n * k], host[n + n * k:]
    return [TokenLogprob(token, host[i], tuple((int(ids[i * k + j]), values[i * k + j]) for j in range(k)))
            for i, token in enumerate(acc.tokens)]
