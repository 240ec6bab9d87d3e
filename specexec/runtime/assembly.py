"""Runtime: a loaded target (+ optional draft), their tokenizer and an Engine, ready to generate.

`Runtime.load()` is the one place that turns user-facing choices (model paths, EngineConfig, OffloadConfig)
into running objects, in named stages listed in its docstring: the names resolved and the configs read
(specexec/runtime/sources.py: unsupported architectures fail before any weight is read), the tokenizers
cross-checked, the memory plan made, the models loaded (specexec/runtime/loaders.py), the self-draft's depth
measured and its verdict given to the gate, the draft's vocabulary fitted to the target's, the pair
fingerprinted, the Engine built. `generate_ids()` and `generate_text()` (the ids with their text as it becomes
final) add what the engine deliberately leaves out: the context-length check and stop strings (which need the
tokenizer; the text side is specexec/runtime/detokenizer.py).

Memory plan and offloading: before any weight is loaded, the run is planned from the configs
(specexec/planning/ledger.py via planning.target.plan_target: the draft counted once in its --draft-quant
format, each KV cache for its own user, budgets measured while nothing of ours holds memory); `on_plan` sees the
ledger first, then the draft loads (resident, optionally quantized) and the target as planned: resident, or with
its decoder layers quantized and streamed (specexec/runtime/offloaded.py). `plan` holds the result; stats() gains
the pager's streaming figures.

Self-draft (--draft self[:FORMAT], --draft-layers): the plan counts it (its copies of streamed layers only) and
picks its layers; it is built after the target, sharing the target's embed/norm/head and resident layers
(specexec/runtime/self_draft.py). Without --draft-layers N the planned layers are the deepest candidate: the
depth is measured (specexec/runtime/depth_probe.py), stats()['draft_depth'] says what was chosen, and when no
depth pays the run gates (--gate auto becomes on).

VocabTrim (--draft-vocab, EngineConfig.draft_vocab): the draft is wrapped in vocab_trim.TrimmedDraft, keeping
the tokens the target samples most on the built-in prompts (measured once per target, cached).

--budget auto: the engine is given a tuner holding the target's saved pass costs and hands back what it
measures when there were none; the files are specexec/tuning/calibration.py's (the engine writes none).

Does not know: argument parsing, terminal output, chat history, how one model loads (loaders.py) or how layers
are streamed (specexec.runtime.offloaded).
"""
from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from offload.formats.sources import is_gguf
from offload.streaming.timing import stream_summary

from specexec.abilities import has
from specexec.options import ConfigError, check_draft_vocab, check_prompt_length
from specexec.tuning import acceptance
from specexec.tuning.calibration import save_target_costs, tuner_for
from specexec.builders.base import TreeBuilder
from specexec.builders.registry import make_builder
from specexec.config import EXACT, Acceptance, EngineConfig, OffloadConfig, SamplingParams
from specexec.constraint import Constraint
from specexec.decoding.engine import Engine
from specexec.companions.experts import ExpertPasses
from specexec.checkpoints.loading import check_checkpoint, resolve_dtype
from specexec.network.model import Streams, Transformer
from specexec.planning.target import TargetPlan, plan_target
from specexec.runtime.expert_stream import expert_passes
from specexec.runtime.loaders import (ModelInfo, load_chosen_drafter, load_planned_target, load_resident,
                                      planned_self_draft, self_draft_info)
from specexec.runtime.depth_probe import choose_self_depth, probe_window
from specexec.runtime.self_draft import SELF, SelfDraft
from specexec.runtime.sources import Sources, resolve_sources
from specexec.runtime.detokenizer import Detokenizer, StopWatcher, stream_text
from specexec.runtime.draft_vocab import align_vocab
from specexec.runtime.grammar import Grammars
from specexec.runtime.tokenizer import check_compatible, encode_prompt, eos_ids, load_tokenizer
from specexec.tuning.depth import DepthChoice
from specexec.companions.gate import with_depth_verdict
from specexec.tuning.vocab_trim import TrimmedDraft, auto_size, load_or_measure_counts, measure_counts, select_vocab

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Draft:
    """The draft as loaded so far: the model (None: the target decodes alone), its load line, and the
    self-draft's measured depth (None: not measured)."""

    model: torch.nn.Module | None = None
    info: ModelInfo | None = None
    depth: DepthChoice | None = None


class Runtime:
    """A target (+ draft), the shared tokenizer and the Engine that runs them. Build it with Runtime.load()."""

    def __init__(self, engine: Engine, tokenizer, target: ModelInfo, draft: ModelInfo | None,
                 config: EngineConfig, plan: TargetPlan | None = None) -> None:
        self.engine, self.tokenizer, self.config = engine, tokenizer, config
        self.target_info, self.draft_info = target, draft
        self.plan = plan                                  # where the target's layers live (None: not planned)
        self.pair: str | None = None                      # draft/target fingerprint (acceptance vectors' key)
        self.pair_note: str | None = None                 # what the tokenizer check said of the pair (or None)
        self._stream_base: dict[str, float] = {}
        self.depth: DepthChoice | None = None             # --draft-layers auto: the measured depth (or None)

    @classmethod
    def load(cls, model: str, draft: str | None, config: EngineConfig, allow_pickle: bool = False,
             progress: Progress | None = None, offload: OffloadConfig | None = None,
             on_plan: Callable[[TargetPlan], None] | None = None) -> "Runtime":
        """Load the target at `model` and, unless `draft` is None, the draft `draft` names: a draft model's
        path, "self[:FORMAT]" (the target itself over offload.draft_layers of its layers) or a drafter
        ("eagle3:...", "mtp"). Without a draft the engine decodes with the target alone. `offload` (default
        OffloadConfig()) says how the target's layers are stored and where they live.

        The stages, in order (each a function below, the first in sources.py):
          1. resolve_sources    check the names, resolve the paths, read the configs: which draft (Sources)
          2. _check_pair        the tokenizer(s) loaded and cross-checked, a draft model's checkpoint checked
          3. _plan_memory       the memory plan from the configs alone, handed to `on_plan` (e.g. to print it)
          4. _load_draft_model  a draft model, resident (before the target, as the plan counted it)
          5. _load_target       the target as planned: resident, or quantized and streamed
          6. _build_on_target   a self-draft (built, then its depth probed) or a drafter: they share the target's
                                modules, so they come after it
          7. _gate_verdict      a measured depth that loses to the target alone turns --gate auto on
          8. _fit_vocab         VocabTrim (--draft-vocab), then the draft's logits in the target's rows
          9. _fingerprint       the pair's key (measured acceptance vectors are kept under it)
         10. _make_engine       the builder, the tuner, an MoE target's expert passes -> the Engine
        """
        offload = offload or OffloadConfig()
        say = progress or (lambda _msg: None)
        src = resolve_sources(model, draft, config, offload, allow_pickle)
        tokenizer, note = _check_pair(src, allow_pickle, say)
        plan = _plan_memory(src, config, offload, on_plan, say)
        drafted = _load_draft_model(src, config, offload, allow_pickle, say)
        target, t_info = _load_target(src, config, offload, plan, allow_pickle, say)
        drafted = _build_on_target(target, src, plan, tokenizer, config, offload, allow_pickle, say) or drafted
        config = _gate_verdict(config, drafted.depth)
        eos = eos_ids(tokenizer, src.args.eos_token_ids)
        drafted = _fit_vocab(drafted, target, tokenizer, src, config, eos, say)
        pair = _fingerprint(src, drafted.model, config)
        engine = _make_engine(target, drafted.model, with_measured_acceptance(config, pair), eos,
                              plan.memory.context if plan is not None else None, plan)
        runtime = cls(engine, tokenizer, t_info, drafted.info, config, plan)
        runtime.pair, runtime.pair_note = pair, note       # note: what check_compatible said of the pair
        runtime.depth = drafted.depth
        return runtime

    def variant(self, config: EngineConfig, use_draft: bool = True) -> "Runtime":
        """The same loaded models and tokenizer under another budget/builder, or without the draft."""
        if (config.device, config.dtype) != (self.config.device, self.config.dtype):
            raise ConfigError(f"a variant keeps the loaded device/dtype ({self.config.device}/{self.config.dtype}); "
                              f"got {config.device}/{config.dtype}")
        draft = self.engine.draft if use_draft else None
        if not use_draft:                                    # the target alone: nothing drafted, nothing to relax
            config = config.replace(accept=EXACT)
        if draft is not None:                                # the measured depth's verdict holds for the variant
            config = _gate_verdict(config, self.depth)
        engine = _make_engine(self.engine.target, draft, with_measured_acceptance(config, self.pair),
                              tuple(sorted(self.engine.eos_ids)), self.engine.planned_context,
                              self.plan)
        if engine.neighbours.k == self.engine.neighbours.k:
            engine.neighbours = self.engine.neighbours       # relaxed acceptance's table: once per target and k
        runtime = Runtime(engine, self.tokenizer, self.target_info, self.draft_info if use_draft else None, config,
                          self.plan)
        runtime.pair, runtime.depth = self.pair, self.depth if use_draft else None
        return runtime

    def seated(self, target: torch.nn.Module, draft: torch.nn.Module | None) -> "Runtime":
        """The same run with `target` and `draft` standing in for its loaded models (a forest's seats:
        specexec/batching/seats.py): an engine of its own (caches, builder, tuner, sampler), the same settings and
        tokenizer. draft is ignored when this runtime decodes without one."""
        own = self.engine
        engine = _make_engine(target, draft if own.draft is not None else None, own.config,
                              tuple(sorted(own.eos_ids)), own.planned_context, self.plan)
        engine.neighbours, engine.prefix_cache = own.neighbours, own.prefix_cache    # one prefix cache for all seats
        if hasattr(own.feed, "prefix_cache") and hasattr(engine.feed, "prefix_cache"):
            engine.feed.prefix_cache = own.feed.prefix_cache                         # the draft's, likewise
        runtime = Runtime(engine, self.tokenizer, self.target_info, self.draft_info, self.config, self.plan)
        runtime.pair, runtime.depth = self.pair, self.depth
        return runtime

    @property
    def context(self) -> int:
        """Longest sequence (prompt + generated) every loaded model supports."""
        infos = [i for i in (self.target_info, self.draft_info) if i is not None]
        return min(i.args.max_position_embeddings for i in infos)

    @functools.cached_property
    def grammars(self) -> Grammars:
        """Grammars (JSON schemas, tool calls) over this runtime's tokenizer, for generate_ids' constraint."""
        return Grammars(self.tokenizer, self.target_info.args.vocab_size, sorted(self.engine.eos_ids))

    @property
    def builder_name(self) -> str:
        return self.engine.builder.name if self.engine.builder is not None else "none"

    def encode(self, text: str, chat: bool = False, system: str | None = None) -> list[int]:
        """Prompt ids: the tokenizer's default encoding, or the chat template when chat=True."""
        return encode_prompt(self.tokenizer, text, chat, system)

    def check_prompt(self, prompt_ids: Sequence[int], max_new_tokens: int | None = None) -> None:
        """ConfigError unless the prompt plus max_new_tokens fit every loaded model's context."""
        check_prompt_length(len(prompt_ids), max_new_tokens or self.config.max_new_tokens, self.context)

    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int | None = None,
                     sampling: SamplingParams = SamplingParams(), stop: Sequence[str] = (),
                     constraint: Constraint | None = None, logprobs: int | None = None,
                     accept: Acceptance | None = None) -> Iterator[list[int]]:
        """Yield new token ids as they are accepted. With stop strings: generate_text's ids (held back while
        their text may still begin a stop string; the last kept token may hold the first one's start).
        constraint, logprobs and accept as Engine.generate takes them (the log-probs land in engine.logprobs)."""
        if not any(stop):
            limit = max_new_tokens or self.config.max_new_tokens
            self._begin(prompt_ids, limit)
            yield from self.engine.generate(prompt_ids, limit, sampling, constraint=constraint, logprobs=logprobs,
                                            accept=accept)
            return
        for ids, _ in self.generate_text(prompt_ids, max_new_tokens, sampling, stop, constraint, logprobs, accept):
            if ids:
                yield ids

    def generate_text(self, prompt_ids: list[int], max_new_tokens: int | None = None,
                      sampling: SamplingParams = SamplingParams(), stop: Sequence[str] = (),
                      constraint: Constraint | None = None, logprobs: int | None = None,
                      accept: Acceptance | None = None) -> Iterator[tuple[list[int], str]]:
        """(new ids, new text) as they become final: the generated text, an incomplete character held back and,
        with stop strings, whatever could still begin one; it ends just before the first stop string
        (excluded) wherever token boundaries fall. The ids: the tokens whose text was shown (with a stop string,
        up to the one it begins in). constraint, logprobs and accept as generate_ids."""
        limit = max_new_tokens or self.config.max_new_tokens
        self._begin(prompt_ids, limit)
        detok = Detokenizer(self.tokenizer, prompt_ids)
        watcher = StopWatcher(detok, stop) if any(stop) else None
        steps = self.engine.generate(prompt_ids, limit, sampling, should_stop=watcher, constraint=constraint,
                                     logprobs=logprobs, accept=accept)
        yield from stream_text(steps, detok, watcher)

    def _begin(self, prompt_ids: list[int], limit: int) -> None:
        """A generation starts: the prompt fits, the streamed bytes count from here."""
        self.check_prompt(prompt_ids, limit)
        target = self.engine.target
        self._stream_base = target.pager.counters() if has(target, Streams) else {}

    def kv_summary(self) -> dict:
        return _kv_cache_summary(self.engine)

    def stats(self) -> dict:
        """Summary of the last generate_ids() call (see specexec.generation.GenerationStats.summary)."""
        budget = (("auto" if self.config.auto_budget else self.config.budget)
                  if self.engine.builder is not None else 0)
        out = self.engine.stats.summary(budget, self.builder_name)    # with budget_trace: what auto picked
        out["kv"] = self.kv_summary()
        if self.depth is not None:
            out["draft_depth"] = self.depth.summary()
        target = self.engine.target
        if has(target, Streams):              # offloaded target: what streaming cost during the last call
            out.update(stream_summary(self._stream_base, target.pager.counters()))
            out["offload"] = {"quant": self.plan.fmt, **self.plan.plan.summary()}
        return out


# ------------------------------------------------------------------ the stages of Runtime.load, in order

def _check_pair(src: Sources, allow_pickle: bool, say: Progress) -> tuple[object, str | None]:
    """Stage 2: (the target's tokenizer, what the compatibility check said of the pair or None). A draft
    model's tokenizer must agree with the target's, and its checkpoint is checked, so a broken draft fails
    before the plan is shown."""
    say(f"loading tokenizer from {src.target}")
    tokenizer = load_tokenizer(src.target)
    d_tok = load_tokenizer(src.draft) if src.draft is not None else tokenizer
    d_vocab = src.draft_args.vocab_size if src.draft_args else src.args.vocab_size
    note = check_compatible(tokenizer, d_tok, src.args.vocab_size, d_vocab)
    if src.draft is not None:
        check_checkpoint(src.draft, src.draft_args, allow_pickle)
    return tokenizer, note


def _plan_memory(src: Sources, config: EngineConfig, offload: OffloadConfig,
                 on_plan: Callable[[TargetPlan], None] | None, say: Progress) -> TargetPlan | None:
    """Stage 3: the run's memory plan from the configs, before anything of ours is loaded (None: a resident
    pickle target), handed to `on_plan`. The draft is counted once in its own format: a draft model's
    config, a self-draft's copies, a drafter's size."""
    say("planning memory")
    drafter = src.drafter
    d_args = drafter.plan_args(src.args) if drafter is not None else src.draft_args
    drafter_size = drafter.size() if drafter is not None else None
    if not _plannable(src.target, offload):
        return None
    device = torch.device(config.device)
    builder = make_builder(config.builder, config.builder_options)
    drafts = d_args is not None or src.self_spec is not None
    draft_kv = builder.kv_slots if drafts and builder.needs_draft else None
    plan = plan_target(src.target, src.args, d_args, offload, config, device, resolve_dtype(config.dtype, device),
                       draft_kv, src.self_spec, drafter_size)
    if on_plan is not None:
        on_plan(plan)
    return plan


def _plannable(path: Path, offload: OffloadConfig) -> bool:
    """Whether the target gets a memory plan: always, except a pickle checkpoint that stays resident as it is
    (the planner reads safetensors/GGUF headers)."""
    plain = offload.quant in ("auto", "none") and offload.offload in ("auto", "none")
    return not plain or is_gguf(path) or any(path.glob("*.safetensors"))


def _load_draft_model(src: Sources, config: EngineConfig, offload: OffloadConfig, allow_pickle: bool,
                      say: Progress) -> Draft:
    """Stage 4: a draft model, resident on the device (quantized to --draft-quant); no draft otherwise."""
    if src.draft is None:
        return Draft()
    say(f"loading draft {src.draft}")
    return Draft(*load_resident(src.draft, src.draft_args, config, allow_pickle, offload.draft_quant, draft=True))


def _load_target(src: Sources, config: EngineConfig, offload: OffloadConfig, plan: TargetPlan | None,
                 allow_pickle: bool, say: Progress) -> tuple[Transformer, ModelInfo]:
    """Stage 5: the target as planned (loaders.load_planned_target) and its load line."""
    say(f"loading target {src.target}")
    return load_planned_target(src.target, src.args, config, offload, plan, allow_pickle)


def _build_on_target(target: Transformer, src: Sources, plan: TargetPlan | None, tokenizer, config: EngineConfig,
                     offload: OffloadConfig, allow_pickle: bool, say: Progress) -> Draft | None:
    """Stage 6: what drafts with the target's own modules, so it comes after the target (None: neither). A
    self-draft is built over the planned layers; unless --draft-layers N, its depth is then measured
    (depth_probe.py: the planned layers are the deepest candidate). A drafter may share the target's
    embedding and head."""
    if src.self_spec is not None:
        t0 = time.perf_counter()
        model = planned_self_draft(target, src.target, src.self_spec, plan, offload, say)
        depth = None
        if src.self_spec.layers is None and tokenizer is not None:          # --draft-layers auto: measured
            model, depth = choose_self_depth(target, model, probe_window(tokenizer), say)
        return Draft(model, self_draft_info(model, src.target, config, t0), depth)
    if src.drafter is not None:
        say(f"loading drafter {src.drafter.describe()}")
        return Draft(*load_chosen_drafter(src.drafter, target, src.args, config))
    return None


def _gate_verdict(config: EngineConfig, depth: DepthChoice | None) -> EngineConfig:
    """Stage 7: when no measured depth pays, the gate decides when to draft (specexec/companions/gate.py); the config as
    it was without a measured depth."""
    if depth is None:
        return config
    return config.replace(gate=with_depth_verdict(config.gate, depth.loses))


def _fit_vocab(drafted: Draft, target: Transformer, tokenizer, src: Sources, config: EngineConfig,
               eos: tuple[int, ...], say: Progress) -> Draft:
    """Stage 8: with --draft-vocab the draft's head trimmed (VocabTrim, its load line says how far); then its
    logits in the target's rows (draft_vocab.align_vocab: padded otherwise, or a prefix vocabulary)."""
    model, info = drafted.model, drafted.info
    if config.draft_vocab is not None and model is not None:
        model = _trim_draft(model, target, tokenizer, src.target, config, eos, say)
        info = replace(info, dtype=f"{info.dtype} (head: {model.n_kept} of {info.args.vocab_size} tokens)")
    return Draft(align_vocab(model, src.args.vocab_size), info, drafted.depth)


VOCAB_CALIBRATION_TOKENS = 64     # --draft-vocab: target samples per built-in prompt (then cached)


def _trim_draft(draft: Transformer, target: Transformer, tokenizer, t_path: Path, config: EngineConfig,
                eos: tuple[int, ...], say: Progress) -> TrimmedDraft:
    """VocabTrim: the draft head keeps the --draft-vocab tokens the target samples most often on the built-in
    prompts (T = 1; drawn through speculative sampling, which is exact; counts cached per target)."""
    from specexec.prompts import load_prompts

    vocab = draft.args.vocab_size
    check_draft_vocab(config.draft_vocab, vocab)
    prompts = [encode_prompt(tokenizer, p.prompt, True, p.system) for p in load_prompts()]
    key = (f"draft-vocab|{t_path.resolve()}|{vocab}|{len(prompts)}|{sum(map(len, prompts))}|T=1|"
           f"{VOCAB_CALIBRATION_TOKENS}")

    def measure() -> torch.Tensor:
        say(f"--draft-vocab: sampling the target on {len(prompts)} prompts to count its tokens (cached)")
        calib = config.replace(budget=16, auto_budget=False, builder="specexec", draft_vocab=None, verifier="auto",
                               accept=EXACT)
        engine = Engine(target, draft, calib, make_builder("specexec"), eos)
        sampling = SamplingParams(temperature=1.0, seed=0)
        return measure_counts(lambda ids: [t for s in engine.generate(ids, VOCAB_CALIBRATION_TOKENS, sampling)
                                           for t in s], prompts, vocab)

    counts = load_or_measure_counts(key, vocab, measure)
    n = auto_size(counts) if config.draft_vocab == "auto" else int(config.draft_vocab)
    always = set(eos) | set(getattr(tokenizer, "all_special_ids", None) or ())
    return TrimmedDraft(draft, select_vocab(counts, n, sorted(t for t in always if 0 <= t < vocab)))


def _fingerprint(src: Sources, draft: torch.nn.Module | None, config: EngineConfig) -> str | None:
    """Stage 9: the pair's fingerprint, the key of its measured acceptance vectors (None: no draft). A
    self-draft is named by its format and layers, a drafter by its kind and config."""
    if src.self_spec is not None:
        return acceptance.pair_fingerprint(src.target, src.target, src.args, (SELF, draft.fmt, draft.layer_ids),
                                           config.draft_vocab)
    if src.drafter is not None:
        return acceptance.pair_fingerprint(src.target, src.drafter.path, src.args,
                                           (src.drafter.kind, src.drafter.args), None)
    if src.draft is not None:
        return acceptance.pair_fingerprint(src.target, src.draft, src.args, src.draft_args, config.draft_vocab)
    return None


def _make_engine(target: Transformer, draft: torch.nn.Module | None, config: EngineConfig,
                 eos: tuple[int, ...], context: int | None = None, plan: TargetPlan | None = None) -> Engine:
    """Stage 10 (and Runtime.variant's engine): the configured builder; none (target-only decoding) when it
    needs a draft and there is none. context: the tokens the memory plan reserved KV cache for (None: not
    planned); the plan may have chosen an int8 draft cache to fit (exact: the draft only proposes)."""
    builder: TreeBuilder | None = make_builder(config.builder, config.builder_options)
    if builder.needs_draft and draft is None:
        builder = None
    draft_kv = "int8" if plan is not None and plan.memory.shape.draft_kv_quant == "int8" else None
    tuner = tuner_for(config.budget, target) if config.auto_budget and builder is not None else None
    engine = Engine(target, draft, config, builder, eos, context=context, draft_kv_quant=draft_kv, tuner=tuner,
                    experts=_expert_passes(target, plan, config.expert_trim))
    if engine.experts is not None and isinstance(draft, SelfDraft) and draft.hot is not None:
        engine.experts.listeners.append(draft.observe_routing)      # its hot experts follow the target's routing
    if tuner is not None:                 # --budget auto: what the engine measures is kept for the next run
        engine.on_calibrated = lambda curve: save_target_costs(target, curve)
    if has(target, Streams):              # offloaded target: per step, the profiler records what streaming cost
        engine.profiler.watch(target.pager.counters)
    return engine


def with_measured_acceptance(config: EngineConfig, pair: str | None) -> EngineConfig:
    """--builder static without an acceptance_file option: the pair's vectors from `specexec bench accept`,
    when they were measured (else the builder's default profile)."""
    if config.builder != "static" or pair is None or any(k == "acceptance_file" for k, _ in config.builder_options):
        return config
    path = acceptance.default_path(pair)
    if not path.is_file():
        return config
    return config.replace(builder_options=(*config.builder_options, ("acceptance_file", str(path))))


def _expert_passes(target: Transformer, plan: TargetPlan | None, mode: str) -> ExpertPasses | None:
    """An MoE target's ExpertPasses priced by its plan's tiers and bandwidths, trimming trees by `mode` (None
    for a dense target)."""
    if plan is None or not plan.offloaded:
        return expert_passes(target, mode=mode)
    p = plan.plan
    return expert_passes(target, p.tiers, p.bandwidths.ram, p.bandwidths.ssd, next(target.parameters()).device,
                         mode)


def _kv_cache_summary(engine: Engine) -> dict:
    """The target cache's format (int8 marked LOSSY: outside every exactness claim) and streamed layers."""
    caches = engine._caches
    quant = engine.config.kv_quant
    out = {"quant": quant, "lossy": quant != "none", "draft_quant": engine.draft_kv_quant}
    if caches is not None:
        out["streamed_layers"] = len(caches[0].streamed_layers)
    return out
