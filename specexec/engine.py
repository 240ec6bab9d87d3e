"""Engine.generate(): the speculative decoding loop, one step = grow -> verify -> accept -> commit -> yield.

The target sees the whole tree in one forward (positions = prefix + depth, mask = prefix + ancestors), the
verifier picks the accepted path plus one bonus token, both KV caches keep the accepted rows, and the new
token ids are yielded. With no builder the same loop is plain autoregressive decoding (the baseline).

Does not know: tokenizers and text (stop strings come in as a callable), the CLI, where weights live (the
target may be resident or an OffloadedTransformer with the same forward signature).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from .builders.base import DraftState, TreeBuilder
from .config import EngineConfig, SamplingParams
from .kv_cache import KVCache
from .model import Transformer, prefix_tree_mask
from .sampling import greedy, make_generator, process_logits, sample
from .tree import TokenTree
from .verify import Accepted, accept_greedy

LOGIT_CHUNK = 256        # rows of the LM head computed at once: 256 x 152k fp32 = 155 MB


@dataclass
class StepRecord:
    tree_size: int
    depth: int
    accepted: int          # tokens emitted by this step (accepted path + bonus)
    draft_s: float
    target_s: float


@dataclass
class GenerationStats:
    """What one generate() call did; filled in as it runs."""

    prompt_tokens: int = 0
    prefill_s: float = 0.0
    generated: int = 0
    steps: list[StepRecord] = field(default_factory=list)

    @property
    def decode_s(self) -> float:
        return sum(s.draft_s + s.target_s for s in self.steps)

    def summary(self, budget: int, builder: str) -> dict:
        n = max(len(self.steps), 1)
        return {
            "steps": len(self.steps),
            "tokens_per_step": round(self.generated / n, 3),
            "prefill_tok_s": round(self.prompt_tokens / self.prefill_s, 2) if self.prefill_s else None,
            "decode_tok_s": round(self.generated / self.decode_s, 2) if self.decode_s else None,
            "draft_ms": round(1000 * sum(s.draft_s for s in self.steps) / n, 2),
            "target_ms": round(1000 * sum(s.target_s for s in self.steps) / n, 2),
            "tree_size": round(sum(s.tree_size for s in self.steps) / n, 1),
            "budget": budget,
            "builder": builder,
        }


class Engine:
    """Owns the target, the optional draft and their caches; generate() is the only way to run them."""

    def __init__(self, target: Transformer, draft: Transformer | None, config: EngineConfig,
                 builder: TreeBuilder | None, eos_ids: tuple[int, ...] = ()) -> None:
        if builder is not None and builder.needs_draft and draft is None:
            raise ValueError(f"builder {builder.name!r} needs a draft model")
        self.target, self.draft, self.config, self.builder = target, draft, config, builder
        self.eos_ids = set(eos_ids)
        self.device = next(target.parameters()).device
        self.stats = GenerationStats()
        self._caches: tuple[KVCache, KVCache | None] | None = None

    def _new_caches(self, total: int) -> tuple[KVCache, KVCache | None]:
        """Caches sized for `total` committed tokens plus one tree (and the draft's pending tokens)."""
        extra = 2 * self.config.budget + 4 if self.builder is not None else 2
        cached = self._caches
        if cached is not None and cached[0].capacity >= total + extra:
            for c in cached:
                if c is not None:
                    c.reset()
            return cached

        def make(model: Transformer) -> KVCache:
            a, p = model.args, next(model.parameters())
            return KVCache(a.n_layers, a.n_kv_heads, a.head_dim, total + extra, p.dtype, p.device)

        self._caches = (make(self.target), make(self.draft) if self.draft is not None and self.builder else None)
        return self._caches

    def prefill(self, model: Transformer, cache: KVCache, ids: list[int]) -> None:
        """Run ids through `model` in chunks of config.prefill_chunk and commit them to `cache`."""
        chunk = self.config.prefill_chunk
        for start in range(0, len(ids), chunk):
            part = torch.tensor(ids[start:start + chunk], device=self.device)
            T, L = part.numel(), cache.length
            pos = torch.arange(L, L + T, device=self.device)
            tril = torch.ones(T, T, dtype=torch.bool, device=self.device).tril()
            mask = prefix_tree_mask(L, tril, model.args.sliding_window, pos)
            model(part[None], pos[None], mask, cache)
            cache.advance(T)

    def generate(self, prompt_ids: list[int], max_new_tokens: int | None = None,
                 sampling: SamplingParams = SamplingParams(),
                 should_stop: Callable[[list[int]], int | None] | None = None) -> Iterator[list[int]]:
        """Yield the new token ids of each step until EOS, max_new_tokens or should_stop(generated) returns
        the number of tokens to keep. Stats accumulate in self.stats."""
        if not prompt_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        limit = max_new_tokens or self.config.max_new_tokens
        rng = make_generator(sampling.seed, self.device)
        self.stats = stats = GenerationStats(prompt_tokens=len(prompt_ids))
        with torch.inference_mode():
            state = self._start(prompt_ids, limit, stats)
            generated: list[int] = []
            root = prompt_ids[-1]
            while len(generated) < limit:
                acc = self._step(state, root, sampling, rng, stats)
                new, stop = self._trim(acc.tokens, generated, limit, should_stop)
                generated += new
                stats.generated = len(generated)
                if new:
                    yield new
                if stop:
                    return
                root = acc.tokens[-1]

    def _start(self, prompt_ids: list[int], limit: int, stats: GenerationStats) -> tuple[KVCache, DraftState | None]:
        t0 = time.perf_counter()
        target_cache, draft_cache = self._new_caches(len(prompt_ids) + limit)
        self.prefill(self.target, target_cache, prompt_ids[:-1])
        draft = None
        if draft_cache is not None:
            self.prefill(self.draft, draft_cache, prompt_ids[:-1])
            draft = DraftState(self.draft, draft_cache, [prompt_ids[-1]])
        self._sync()
        stats.prefill_s = time.perf_counter() - t0
        return target_cache, draft

    def _trim(self, tokens: list[int], generated: list[int], limit: int,
              should_stop: Callable[[list[int]], int | None] | None) -> tuple[list[int], bool]:
        """Cut a step's tokens at the first EOS, the token limit and a stop condition; say whether to stop."""
        new = tokens[: limit - len(generated)]
        eos = next((i for i, t in enumerate(new) if t in self.eos_ids), None)
        if eos is not None:
            new = new[: eos + 1]
        stop = eos is not None or len(generated) + len(new) >= limit
        if should_stop is not None:
            keep = should_stop(generated + new)
            if keep is not None:
                return new[: max(keep - len(generated), 0)], True
        return new, stop

    def _step(self, state: tuple[KVCache, DraftState | None], root: int, sampling: SamplingParams,
              rng: torch.Generator, stats: GenerationStats) -> Accepted:
        cache, draft = state
        t0 = time.perf_counter()
        if self.builder is None:
            tree = TokenTree.root_only(root, self.device)
        else:
            tree = self.builder.build(draft, root, self.config.budget, sampling, rng)
        self._sync()
        t1 = time.perf_counter()
        acc = self._verify(tree, cache, sampling, rng)
        cache.keep(cache.length + torch.tensor(acc.nodes, device=self.device))
        if draft is not None:
            draft.commit(tree, acc.nodes, acc.tokens[-1])
        if self.builder is not None:
            self.builder.observe(tree, acc.nodes, acc.tokens[-1])
        t2 = time.perf_counter()
        stats.steps.append(StepRecord(tree.size, tree.max_depth(), len(acc.tokens), t1 - t0, t2 - t1))
        return acc

    def _verify(self, tree: TokenTree, cache: KVCache, sampling: SamplingParams, rng: torch.Generator) -> Accepted:
        """One target forward over the whole tree, then the acceptance rule."""
        L = cache.length
        positions = tree.positions(L)
        mask = prefix_tree_mask(L, tree.ancestor_mask(), self.target.args.sliding_window, positions)
        slots = torch.arange(L, L + tree.tokens.numel(), device=self.device)
        hidden = self.target(tree.tokens[None], positions[None], mask, cache, slots)[0]
        choice = self._target_choices(hidden, sampling, rng)
        acc = accept_greedy(tree, choice)
        self._sync()
        return acc

    def _target_choices(self, hidden: torch.Tensor, sampling: SamplingParams, rng: torch.Generator) -> torch.Tensor:
        """hidden [N+1, D] -> one target choice per node [N+1]: the argmax (greedy) or an independent sample
        of the processed distribution (sample-and-match). The LM head runs in chunks of LOGIT_CHUNK rows."""
        out = []
        for start in range(0, hidden.shape[0], LOGIT_CHUNK):
            logits = self.target.logits(hidden[start:start + LOGIT_CHUNK])
            out.append(greedy(logits) if sampling.greedy else sample(process_logits(logits, sampling), rng))
        return torch.cat(out)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
