"""Engine.generate(): the speculative decoding loop. One step is five stages (Engine._step):

1. draft   - the builder grows a token tree under the root with the draft (the tuner picks its budget);
2. verify  - the target sees the whole tree in one forward (positions = prefix + depth, mask = prefix +
             ancestors) and the acceptance rule picks the accepted path plus one bonus token (what the
             target says at the nodes: specexec/decoding/target_logits.py);
3. commit  - both KV caches keep the accepted rows, the context gains the new tokens;
4. observe - the builder learns from the outcome (accepted path; the target's top-k when it asks);
5. account - the step goes into the one ledger (the profiler's step records, which GenerationStats reads).

All else that takes part in a step is a companion (specexec/companions/: LongRoPE's switch, the pilot of
--gate, the budget tuner, an MoE target's experts, a cost-following builder, the draft's feed): hooks the stages
run in the companions' one order, never asking who is there; the engine is handed them as its roster
(companions/roster.Roster) and imports none of them. With no builder the loop is plain autoregressive decoding
(the baseline); the pilot makes a step such a plain one when the target alone is measured faster. Optional
abilities of the builder, the models and the companions are checked once, when the engine is built. Before
the first step the prompt is prefilled (specexec/decoding/prompt_passes.py); with `--budget auto` and no saved costs
the engine measures target passes and hands them to `on_calibrated` (saving them is the runtime's).

Does not know: tokenizers and text (stop strings come in as a callable), the CLI, files, where weights live
(the target may be resident or an OffloadedTransformer with the same forward signature).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch

from specexec.decoding import prompt_passes, target_logits
from specexec.abilities import has
from specexec.builders.base import DraftState, KeepsDraftProbs, LearnsFromTarget, RowListener, TreeBuilder
from specexec.companions.protocol import Companions, Step
from specexec.companions.roster import Roster
from specexec.network import longrope, mixers
from specexec.config import Acceptance, EngineConfig, SamplingParams
from specexec.constraint import Constraint, tree_paths
from specexec.decoding.finite import checked_pass
from specexec.kv.cache import KVCache, kv_slots_for
from specexec.kv.prefix_cache import PrefixCache
from specexec.network.model import Closes, MakesCache, Transformer, TreeMask
from specexec.profiler import Profiler, Span
from specexec.acceptance.choice import Drafting, rule_for
from specexec.acceptance.relaxed import Neighbours, Relaxation, table_k
from specexec.generation import GenerationStats, PrefillProgress, TokenLogprob
from specexec.sampling import make_generator
from specexec.tree import TokenTree
from specexec.uploads import upload
from specexec.tuning.budget import CurveFit
from specexec.acceptance.rules import RULES, Accepted, Rule, accept_greedy, check_verifier

KV_GROW_QUANTUM = 256    # caches grow past their planned size in steps of this many slots (never doubling)


def new_cache(model: Transformer, slots: int, quant: str, tail: int) -> KVCache:
    """`model`'s KV cache (its own `new_cache`, else a device cache in its dtype, e.g. a wrapped draft)."""
    if has(model, MakesCache):
        return model.new_cache(slots, quant, tail)
    p = next(model.parameters())
    return mixers.new_cache(model.args, slots, p.dtype, p.device, quant)


@dataclass
class StepState:
    """What every step of one generate() call works on: the target's KV cache and the draft's state (its
    cache and pending tokens; None when nothing drafts with a draft model)."""

    cache: KVCache
    draft: DraftState | None


class Engine:
    """Owns the target, the optional draft and their caches; generate() is the only way to run them."""

    def __init__(self, target: Transformer, draft: Transformer | None, config: EngineConfig,
                 builder: TreeBuilder | None, eos_ids: tuple[int, ...] = (),
                 profiler: Profiler | None = None, context: int | None = None,
                 draft_kv_quant: str | None = None, tuner=None, experts=None,
                 roster: type[Roster] = Roster) -> None:
        """context: the tokens (prompt + answer) a memory plan reserved KV cache for; the caches are then
        allocated for it at the first generate() (None: sized for each call's need, growing as it grows).
        draft_kv_quant: the draft cache's format when the plan chose one (None: config.kv_quant's).
        tuner: --budget auto's tuner, e.g. holding saved target costs (None: a fresh one; only used with
        config.auto_budget and a builder). experts: an MoE target's ExpertPasses (its costs and trim mode; None:
        one that learns and counts with every expert held). The builder's and the models' optional abilities
        are checked here, once; `roster` assembles the step's companions (companions/roster.Roster) from the
        run's parts, tuner and experts."""
        if builder is not None and builder.needs_draft and draft is None:
            raise ValueError(f"builder {builder.name!r} needs a draft model")
        check_verifier(config.verifier)
        self.target, self.draft, self.config, self.builder = target, draft, config, builder
        self.planned_context = context
        self.draft_kv_quant = draft_kv_quant or config.kv_quant
        self.on_prefill: Callable[[PrefillProgress], None] | None = None    # progress of long prefills
        self.eos_ids = set(eos_ids)
        self.device = next(target.parameters()).device
        self.profiler = profiler or Profiler(self.device)   # spans/counters/steps of the last generate()
        self.stats = GenerationStats()
        self._caches: tuple[KVCache, KVCache | None] | None = None
        self._prefill_span: Span | None = None
        self._context: list[int] = []   # ids the caches were built from: cache rows [0, length) hold a prefix
        self._generated_from = 0        # where this generate() call's own tokens begin in _context
        self.prefix_cache: PrefixCache | None = None    # prompts' KV blocks kept across calls (kv/prefix_cache.py)
        self.on_calibrated: Callable[[CurveFit], None] | None = None     # hears measured target pass costs
        self.roster = roster(target, draft, config, builder, self.profiler, self.prefill, tuner, experts)
        self.tuner, self.pilot, self.feed = self.roster.tuner, self.roster.pilot, self.roster.feed
        self.follows_costs = self.roster.cost_builder is not None          # width follows the cost ratio
        self.keeps_draft_probs = has(builder, KeepsDraftProbs)            # may be verified with rrs_wor
        self.drafting = Drafting(config.verifier, builder.drafting if builder is not None else "deterministic",
                                 self.keeps_draft_probs, builder.name if builder is not None else None,
                                 target.args.vocab_size, table_k(config.accept))
        self.rule_for(SamplingParams(), config.accept)    # what --accept relaxed cannot run on: refused here
        self.observe_topk = int(builder.observe_topk or 0) if has(builder, LearnsFromTarget) else 0
        self.target_closes = has(target, Closes)
        if self.observe_topk:
            builder.bind(target.args.vocab_size, self.device)
        self.recurrent = any(s is not None for s in mixers.layer_states(target.args))   # a state cannot go back
        self._trims = False                  # this call's drafted trees go through the companions' trim (generate)
        self._check_finite = False           # the next verification pass counts NaN/Inf (specexec/decoding/finite.py)
        self._constraint: Constraint | None = None   # this call's grammar (generate)
        self._grammar_end: int | None = None         # the step's tokens its grammar library could follow, if fewer
        self._top_logprobs: int | None = None        # this call's top_logprobs (None: no logprobs)
        self.logprobs: list[TokenLogprob] = []       # the last call's tokens' target log-probs, when asked
        self._accept = config.accept                 # this call's --accept (generate)
        self.neighbours = Neighbours(target.embed_tokens.weight, self.device,   # relaxed acceptance's, lazily
                                     table_k(config.accept))

    @property
    def experts(self):
        """An MoE target's ExpertPasses (None: a dense target); setting it goes to the roster (Roster.experts)."""
        return self.roster.experts

    @experts.setter
    def experts(self, experts) -> None:
        self.roster.experts = experts

    @property
    def companions(self) -> Companions:
        """The hooks' members in their order (the roster's)."""
        return self.roster.companions

    @companions.setter
    def companions(self, companions: Companions) -> None:
        self.roster.companions = companions

    def _caches_for(self, total: int) -> tuple[KVCache, KVCache | None]:
        """Caches with room for `total` committed tokens plus what each model writes beyond them
        (kv_slots_for); existing caches are kept so a shared prompt prefix can be reused. They are allocated
        for the planned context (self.planned_context) when there is one; past it they grow to what is
        needed, in KV_GROW_QUANTUM steps, never doubling (KVCache.grow). Each model makes its own cache
        (`new_cache`: an offloaded target may stream some layers' rows), in config.kv_quant's format (the
        draft's: draft_kv_quant when the plan chose one)."""
        with_draft = self.draft is not None and self.builder is not None and self.builder.needs_draft
        budget = self.config.budget
        scratch = self.builder.kv_slots(budget) if with_draft else None
        need = kv_slots_for(total, budget, scratch)
        if self._caches is None:
            planned = kv_slots_for(self.planned_context or 0, budget, scratch)
            self._caches = (new_cache(self.target, max(need[0], planned[0]), self.config.kv_quant, budget + 1),
                            new_cache(self.draft, max(need[1], planned[1]), self.draft_kv_quant, 0)
                            if with_draft else None)
        for cache, slots in zip(self._caches, need):
            if cache is not None and cache.capacity < slots:
                cache.grow(-(-slots // KV_GROW_QUANTUM) * KV_GROW_QUANTUM)
        return self._caches

    def reset(self) -> None:
        """Forget the cached conversation (the next generate() prefills everything)."""
        self._context = []
        for cache in self._caches or ():
            if cache is not None:
                cache.reset()

    def close(self) -> None:
        """Stop the target's background work (an offloaded target's pager thread); a later generate() starts
        it again on demand."""
        if self.target_closes:
            self.target.close()

    def prefill_chunk(self, model: Transformer) -> int:
        """Prompt tokens per prefill pass of `model` (prompt_passes.chunk_size under config.prefill_chunk; asked
        each prefill, not once: a plan may set prefill_tokens on a model after the engine was built)."""
        return prompt_passes.chunk_size(model, self.config.prefill_chunk)

    def prefill(self, model: Transformer, cache: KVCache, ids: list[int], which: str = "target",
                states: torch.Tensor | None = None, on_rows: RowListener | None = None) -> None:
        """Run ids through `model` in passes of prefill_chunk(model) and commit them to `cache`; on_rows hears
        each pass's rows, on_prefill (when set) how far it got (prompt_passes.prefill). states [len(ids), D]: a
        drafter's state before each token."""
        prompt_passes.prefill(model, cache, ids, self.prefill_chunk(model), self.device, which, states, on_rows,
                              self.on_prefill)

    def generate(self, prompt_ids: list[int], max_new_tokens: int | None = None,
                 sampling: SamplingParams = SamplingParams(),
                 should_stop: Callable[[list[int]], int | None] | None = None,
                 constraint: Constraint | None = None, logprobs: int | None = None,
                 accept: Acceptance | None = None) -> Iterator[list[int]]:
        """Yield the new token ids of each step until EOS, max_new_tokens or should_stop(generated) returns
        the number of tokens to keep. Stats accumulate in self.stats. constraint: a grammar masking draft and
        target alike (specexec/constraint.py), fresh for this call. logprobs: record each generated token's
        target log-prob and its `logprobs` best alternatives in self.logprobs (None: record nothing).
        accept: this call's acceptance (None: config.accept; relaxed is LOSSY, specexec/acceptance/relaxed.py)."""
        if not prompt_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        limit = max_new_tokens or self.config.max_new_tokens
        rng = make_generator(sampling.seed, self.device)
        self.profiler.begin()
        self._check_finite = True
        self.stats = stats = GenerationStats(ledger=self.profiler, constraint=constraint)
        self._constraint, self._top_logprobs, self.logprobs = constraint, logprobs, []
        self._grammar_end = None
        self._accept = stats.accept = accept or self.config.accept
        rule = self.rule_for(sampling, self._accept)
        self._trims = (self.companions.trims and self.builder is not None and not rule.needs_draft
                       and self.builder.drafting == "deterministic")     # a sub-tree is verified exactly
        self.feed.begin()                            # the target keeps the layers' inputs a drafter reads
        with torch.inference_mode():
            state = self._start(prompt_ids, limit, stats)
            generated: list[int] = []
            root = prompt_ids[-1]
            while len(generated) < limit:
                try:
                    acc = self._step(state, root, sampling, rule, rng)
                except BaseException:                # Ctrl-C mid-step: the step is counted nowhere
                    self.profiler.abandon()
                    raise
                cut, self._grammar_end = self._grammar_end, None     # the grammar library's limit: it ends here
                new, stop = self._trim(acc.tokens[:cut], generated, limit, should_stop)
                stop = stop or cut is not None
                stats.relaxed_tokens += sum(acc.relaxed[:len(new)])
                del self.logprobs[len(generated) + len(new):]
                generated += new
                stats.generated = len(generated)
                self.profiler.count(generated=len(new))
                if new:
                    yield new
                if stop:
                    self._settle(stats)
                    return
                root = acc.tokens[-1]
            self._settle(stats)

    def _settle(self, stats: GenerationStats) -> None:
        """The end of a generation: times still on the device's clock (CUDA events of the last steps) are
        waited for and filled in. The only place the engine waits for timing; never inside a step. (A caller
        that abandons the generator gets them when it reads stats.steps, profiler.steps or summary().)"""
        self.profiler.settle(wait=True)
        if self._prefill_span is not None:
            stats.prefill_s = self._prefill_span.seconds

    def _start(self, prompt_ids: list[int], limit: int, stats: GenerationStats) -> StepState:
        """Prefill what the caches do not already hold: the longest common prefix with the previous call's
        context is kept (chat turns; with a drafter, no more than the drafter holds and at least the state before
        the root recomputed; with recurrent layers, no more than their snapshot or their whole length:
        KVCache.reusable), the rest of prompt[:-1] is prefilled; prompt[-1] is the first root."""
        span = self.profiler.start("prefill")
        target_cache, draft_cache = self._caches_for(len(prompt_ids) + limit)
        shared = prompt_passes.common_prefix(self._context, prompt_ids[:-1])
        self._context = list(prompt_ids)
        self._generated_from = len(prompt_ids)   # earlier turns kept in the cache are prompt, not generated
        keep = self.feed.reusable(target_cache.reusable(shared), target_cache, draft_cache, len(prompt_ids))
        target_cache.truncate(keep)
        longrope.begin(self.target, target_cache, len(prompt_ids))
        cached = self.prefix_cache is not None and not self.feed.reads_target_rows and not target_cache.long_rope
        if cached:
            self.prefix_cache.restore(prompt_ids[:-1], target_cache, target_cache.length)
        stats.reused_tokens = target_cache.length
        stats.prompt_tokens = len(prompt_ids) - 1 - target_cache.length
        draft = self.feed.prefill(prompt_ids, shared, target_cache, draft_cache, self.prefill)
        if cached:
            self.prefix_cache.store(prompt_ids[:-1], target_cache)
        if draft is not None:
            draft.constraint = self._constraint
        span.stop()                                  # CUDA: read at the end (_settle), never waited for here
        self._prefill_span = span
        stats.prefill_s = span.seconds if span.ready else 0.0
        if self.tuner is not None and not self.tuner.costs.target.points:
            self._calibrate(target_cache)
        self.profiler.count(prompt_tokens=stats.prompt_tokens, reused_tokens=stats.reused_tokens)
        self.profiler.keep()
        return StepState(target_cache, draft)

    def _calibrate(self, cache: KVCache) -> None:
        """Measure target pass seconds at a few tree sizes for a budget tuner that has no costs yet, and hand
        them to on_calibrated (the runtime keeps them on disk: specexec/tuning/calibration.py). The trees are
        flat and written to scratch slots only."""
        verify = partial(self._verify, cache=cache, sampling=SamplingParams(), rule=RULES["greedy"], rng=None)
        for rows, seconds in prompt_passes.calibration(verify, self._context[-1], self.config.budget, self.device):
            self.tuner.costs.target.add(rows, seconds)
        if self.on_calibrated is not None:
            self.on_calibrated(self.tuner.costs.target)

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

    def _step(self, state: StepState, root: int, sampling: SamplingParams, rule: Rule,
              rng: torch.Generator) -> Accepted:
        """One decoding step, in its five stages; the target span times verify + commit + observe. The
        companions take part between them, each hook running them in their one order (companions/roster.py)."""
        step = Step(state.cache, state.draft, self._context)
        self.companions.before_step(step)                  # may re-run a cache, make the step plain, cap it
        draft_span = self._draft(step, root, sampling, rng)
        self.companions.before_verify(step)
        with self.profiler.span("target") as target_span:
            acc, hidden = self._verify(step.tree, step.cache, sampling, rule, rng, self._constraint, record=True)
            self._commit(step.tree, acc, step.cache, step.draft, hidden)
            self._observe(step.tree, acc, hidden)
            step.accepted = acc
            self.companions.after_verify(step)
        self._account(step, draft_span, target_span)
        return acc

    def _draft(self, step: Step, root: int, sampling: SamplingParams, rng: torch.Generator) -> Span:
        """Stage 1: the builder grows step.tree under `root` (at most step.cap nodes; the tuner, which first
        hears the steps whose times have settled, picks its budget), trimmed by the companions when this call
        trims; with no builder (or a cap of 0) a root-only tree. -> the draft span, stopped on the host and
        CUDA events, never with a host sync."""
        draft, cap = step.draft, step.cap
        if self.builder is None or cap == 0:         # nothing drafted (a plain step, LongRoPE's cap): span empty
            step.tree = TokenTree.root_only(root, self.device)
            return self.profiler.start("draft").stop()
        span = self.profiler.start("draft")
        self.profiler.settle()                       # the tuner hears finished steps' times (never waits)
        budget = self.tuner.next_budget() if self.tuner is not None else self.config.budget
        step.budget = budget if cap is None else min(budget, cap)
        before = draft.passes if draft is not None else 0
        tree = self.builder.build(draft, root, step.budget, sampling, rng)
        step.tree = self.companions.trim(tree) if self._trims else tree     # the nodes worth their experts
        span.stop()
        step.settling = self.tuner is not None and not self.tuner.settled
        step.passes = draft.passes - before if draft is not None else 0
        return span

    def _commit(self, tree: TokenTree, acc: Accepted, cache: KVCache, draft: DraftState | None,
                hidden: torch.Tensor) -> None:
        """Stage 3: both caches keep the accepted rows (the draft also queues what it has not seen; a drafter
        with the target's states at the accepted nodes) and the context gains the step's tokens."""
        cache.keep(cache.length + upload(acc.nodes, self.device))
        self._context += acc.tokens
        if self._constraint is not None:                     # up to the end of sequence: generation stops there
            end = next((i + 1 for i, t in enumerate(acc.tokens) if t in self.eos_ids), len(acc.tokens))
            kept = self._constraint.commit(acc.tokens[:end])
            if kept is not None and kept < end:        # its library cannot follow further (constraint.py)
                self._grammar_end = kept
        self.feed.committed(draft, tree, acc, hidden)     # the draft's accepted rows (none without a draft)

    def _observe(self, tree: TokenTree, acc: Accepted, hidden: torch.Tensor) -> None:
        """Stage 4: the builder learns from the step: the target's top-k after every node (builders that
        LearnFromTarget, e.g. Token Recycling), then the accepted path and bonus token."""
        if self.builder is None:
            return
        if self.observe_topk:
            self.builder.observe_target(tree, target_logits.topk(self.target, hidden, self.observe_topk))
        self.builder.observe(tree, acc.nodes, acc.tokens[-1])

    def _account(self, step: Step, draft_span: Span, target_span: Span) -> None:
        """Stage 5: the step goes into the ledger (profiler.step, which stats.steps reads); once its spans'
        times are known (CUDA: events, never waited for here) the companions hear them (`timed`, in their
        order: the pilot before the tuner)."""
        tree, acc = step.tree, step.accepted

        def timed(draft_s: float, target_s: float) -> None:
            step.draft_s, step.target_s = draft_s, target_s
            self.companions.timed(step)

        depth = acc.depth if acc.depth >= 0 else tree.max_depth()
        self.profiler.step(tree.size, depth, len(acc.tokens), draft_span, target_span, step.budget, timed)

    def rule_for(self, sampling: SamplingParams, accept: Acceptance | None = None) -> Rule:
        """The acceptance rule of a call (acceptance/choice.rule_for over this engine's Drafting): accept,
        default config.accept; ConfigError about "--accept" or "--verifier" for what cannot run here."""
        return rule_for(sampling, accept or self.config.accept, self.drafting)

    def _verify(self, tree: TokenTree, cache: KVCache, sampling: SamplingParams, rule: Rule,
                rng: torch.Generator | None, constraint: Constraint | None = None,
                record: bool = False) -> tuple[Accepted, torch.Tensor]:
        """Stage 2: one target forward over the whole tree, then the acceptance rule; the constraint (when
        given) masks the target's logits at every node; record: a generation step, whose tokens' log-probs
        are recorded when the call asked for them. -> (accepted, the target's hidden states [N+1, D] for
        the observe stage)."""
        L = cache.length
        positions = tree.positions(L)
        mask = TreeMask(L, tree.ancestor_mask())                 # the whole prefix + each node's ancestors
        if self._check_finite:                   # the generation's first pass: NaN/Inf named at their layer
            self._check_finite = False
            hidden = checked_pass(self.target, lambda: self.target(tree.tokens[None], positions[None], mask, cache),
                                  self.target.args.n_layers)[0]
        else:
            hidden = self.target(tree.tokens[None], positions[None], mask, cache)[0]    # node i at slot L + i
        history, gen_from = target_logits.histories(tree, L, sampling, self._context, self._generated_from,
                                                    self.device)
        allowed = (constraint.allowed(tree_paths(tree), self.target.args.vocab_size, self.device)
                   if constraint is not None else None)
        if rule.target != "probs":
            relax = (Relaxation(tree, self.neighbours, self._accept, sampling.greedy)
                     if record and self._accept.relaxed else None)
            choices = target_logits.choices(self.target, hidden, sampling, rng, history, gen_from, allowed, relax)
            acc = accept_greedy(tree, choices) if relax is None else relax.accept(tree, choices)
        else:                           # rules that need the draft's q: rule_for made sure the builder keeps it
            q = (lambda node: self.builder.draft_probs(tree, node),) if rule.needs_draft else ()
            acc = rule.fn(tree, target_logits.probs_at(self.target, hidden, sampling, history, gen_from, allowed),
                          *q, rng)
        if record and self._top_logprobs is not None:
            self.logprobs += target_logits.logprobs(self.target, hidden, acc, sampling, self._top_logprobs,
                                                    history, gen_from, allowed, self.device)
        return acc, hidden                          # the host synced on the accepted tokens, nothing else
