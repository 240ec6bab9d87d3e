"""Runtime: a loaded target (+ optional draft), their tokenizer and an Engine, ready to generate.

`Runtime.load()` is the one place that turns user-facing choices (model paths, EngineConfig) into running
objects: it resolves the checkpoint paths, reads their configs (unsupported architectures fail before any
weight is read), loads and cross-checks the tokenizers, loads both models on the configured device and dtype,
and makes the tree builder (specexec.builders.registry). `generate_ids()` and `generate_text()` (the ids with
their text as it becomes final) add what the engine deliberately leaves out: the context-length check and stop
strings (which need the tokenizer; the text side is specexec/runtime/detokenizer.py).

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

Does not know: argument parsing, terminal output, chat history, how layers are streamed (specexec.runtime.offloaded).
"""
from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from offload.quant.linear import QuantLinear, quantize_module
from offload.formats.sources import is_gguf
from offload.streaming.timing import stream_summary

from specexec.abilities import has
from specexec.options import ConfigError, check_device, check_draft_vocab, check_prompt_length, is_self_draft
from specexec.tuning import acceptance
from specexec.tuning.calibration import save_target_costs, tuner_for
from specexec.builders.base import TreeBuilder
from specexec.builders.registry import check_builder, make_builder
from specexec.config import EXACT, Acceptance, EngineConfig, ModelArgs, OffloadConfig, SamplingParams
from specexec.constraint import Constraint
from specexec.engine import Engine
from specexec.expert_passes import ExpertPasses
from specexec.drafters.choose import DrafterChoice, choose, load_drafter
from specexec.network.drafter import Drafter
from specexec.checkpoints.loading import (check_checkpoint, expected_shapes, load_model, read_args, resolve_dtype,
                                      resolve_model_path)
from specexec.network.model import Streams, Transformer
from specexec.planning.run_shape import MIN_SELF_LAYERS, DrafterSize, SelfDraftShape, check_self_layers, spaced_layers
from specexec.planning.target import TargetPlan, plan_target
from specexec.runtime.cpu_blocks import fuse_cpu_blocks
from specexec.runtime.expert_stream import expert_passes
from specexec.runtime.offloaded import load_target, quantize_head, quantize_layers
from specexec.runtime.depth_probe import choose_self_depth, probe_window
from specexec.runtime.self_draft import SELF, SelfDraft, build_self_draft, self_draft_shape
from specexec.runtime.detokenizer import Detokenizer, StopWatcher, stream_text
from specexec.runtime.draft_vocab import align_vocab
from specexec.runtime.grammar import Grammars
from specexec.runtime.tokenizer import check_compatible, encode_prompt, eos_ids, load_tokenizer
from specexec.verify import check_verifier
from specexec.tuning.depth import DepthChoice
from specexec.gate import with_depth_verdict
from specexec.tuning.vocab_trim import TrimmedDraft, auto_size, load_or_measure_counts, measure_counts, select_vocab

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ModelInfo:
    """What was loaded, for the load summary."""

    path: Path
    args: ModelArgs
    params: int
    dtype: str
    device: str
    load_s: float

    def describe(self) -> dict:
        return {"path": str(self.path), "family": self.args.family, "layers": self.args.n_layers,
                "params": self.params, "dtype": self.dtype, "device": self.device,
                "load_s": round(self.load_s, 2)}


def load_resident(path: Path, args: ModelArgs, config: EngineConfig, allow_pickle: bool,
              quant: str = "none", draft: bool = False) -> tuple[Transformer, ModelInfo]:
    """A resident model on the configured device; its decoder linears quantized to `quant` (on CUDA block by
    block as they arrive, so the GPU never holds the unquantized model; freed blocks go back to the driver).
    A draft may use batch-dependent fused kernels (quant.kernel_for row_exact=False); a target never does. On a
    CPU an int4/int8 draft's layers run as one compiled call each (cpu_blocks; a target's get theirs from
    runtime/offloaded.py)."""
    t0 = time.perf_counter()
    device = torch.device(config.device)
    run_dtype = resolve_dtype(config.dtype, device)
    dtype = str(run_dtype).removeprefix("torch.")
    if quant != "none" and device.type == "cuda":
        model = load_model(path, "cpu", dtype, allow_pickle)
        params = sum(p.numel() for p in model.parameters())
        for block in model.layers:
            quantize_module(block.to(device), quant, run_dtype, row_exact=not draft)
        model.to(device)
        torch.cuda.empty_cache()
    else:
        model = load_model(path, config.device, config.dtype, allow_pickle)
        params = sum(p.numel() for p in model.parameters())
        quantize_layers(model, quant, row_exact=not draft)
    quantize_head(model, quant, draft=draft)
    if draft:
        fuse_cpu_blocks(model)           # a CPU draft's int4/int8 layers as one compiled call each
    dtype += f" ({_formats(quant, model)})" if quant != "none" else ""
    return model, ModelInfo(path, args, params, dtype, config.device, time.perf_counter() - t0)


def _formats(layer_fmt: str, model: Transformer) -> str:
    """'int4 layers, int8 head' (what the load line and --json say a quantized model computes with)."""
    head = model._modules.get("lm_head")
    return f"{layer_fmt} layers" + (f", {head.fmt} head" if isinstance(head, QuantLinear) else "")


def _plannable(path: Path, offload: OffloadConfig) -> bool:
    """Whether the target gets a memory plan: always, except a pickle checkpoint that stays resident as it is
    (the planner reads safetensors/GGUF headers)."""
    plain = offload.quant in ("auto", "none") and offload.offload in ("auto", "none")
    return not plain or is_gguf(path) or any(path.glob("*.safetensors"))


def _plan(path: Path, args: ModelArgs, d_args: ModelArgs | None, config: EngineConfig, offload: OffloadConfig,
          self_spec: SelfDraftShape | None = None, drafter: DrafterSize | None = None) -> TargetPlan | None:
    """The run's memory plan from the configs, before anything is loaded (None: a resident pickle target)."""
    if not _plannable(path, offload):
        return None
    device = torch.device(config.device)
    builder = make_builder(config.builder, config.builder_options)
    drafts = d_args is not None or self_spec is not None
    draft_kv = builder.kv_slots if drafts and builder.needs_draft else None
    return plan_target(path, args, d_args, offload, config, device, resolve_dtype(config.dtype, device), draft_kv,
                       self_spec, drafter)


def _self_spec(draft: str | None, config: EngineConfig, offload: OffloadConfig) -> SelfDraftShape | None:
    """--draft self[:FORMAT] and --draft-layers, checked (None for a model draft or none)."""
    if not is_self_draft(draft):
        if offload.draft_layers is not None:
            raise ConfigError("--draft-layers applies to --draft self (a draft made of the target's own layers)")
        return None
    if offload.draft_quant != "none":
        raise ConfigError(f"--draft-quant is for a draft model; a self-draft's copies take --draft self:FORMAT "
                          f"(e.g. self:{offload.draft_quant})")
    return self_draft_shape(draft, offload.draft_layers, config.device)


def _load_self(target: Transformer, path: Path, spec: SelfDraftShape, target_plan: TargetPlan | None,
               offload: OffloadConfig, config: EngineConfig, say: Progress,
               tokenizer=None) -> tuple[SelfDraft, ModelInfo, DepthChoice | None]:
    """The self-draft over the planned layers (unplanned, i.e. a resident pickle target: --draft-layers N, or
    half its layers), sharing what the target holds resident, copies of the rest. Unless N was given, its
    depth is then measured (depth_probe.py: the planned layers are the deepest candidate) and the choice
    returned (None: N given, or nothing to choose)."""
    t0 = time.perf_counter()
    n = target.args.n_layers
    if target_plan is not None:
        ids = target_plan.memory.draft_layers
    else:
        if spec.layers is not None:
            check_self_layers(spec.layers, n)
        ids = spaced_layers(n, spec.layers or max(min(MIN_SELF_LAYERS, n), n // 2))
    names = target_plan.names if target_plan is not None else None
    say(f"building the self-draft ({len(ids)} of {n} layers)")
    draft = build_self_draft(target, ids, spec.fmt, path, names, offload.cache_dir, say)
    choice = None
    if spec.layers is None and tokenizer is not None:          # --draft-layers auto: measured
        draft, choice = choose_self_depth(target, draft, probe_window(tokenizer), say)
    params = sum(math.prod(s) for s in expected_shapes(draft.args).values())
    dtype = str(resolve_dtype(config.dtype, torch.device(config.device))).removeprefix("torch.")
    return draft, ModelInfo(path, draft.args, params, f"{dtype} ({draft.describe()})", config.device,
                            time.perf_counter() - t0), choice


def _choose_drafter(draft: str | None, t_path: Path, t_args: ModelArgs, config: EngineConfig,
                    offload: OffloadConfig, allow_pickle: bool) -> DrafterChoice | None:
    """The drafter --draft names (eagle3:..., mtp), checked against the target before any weight loads; None
    for a draft model or none."""
    choice = choose(draft, t_path, t_args, allow_pickle) if draft is not None else None
    if choice is not None:
        if config.draft_vocab is not None:
            raise ConfigError(f"--draft-vocab trims a draft model's head; the {choice.kind} drafter drafts over "
                              f"its own head (drop --draft-vocab)")
        if offload.draft_quant != "none":
            raise ConfigError(f"--draft-quant is for a draft model; the {choice.kind} drafter runs in the run dtype")
    return choice


def _load_drafter(choice: DrafterChoice, target: Transformer, t_args: ModelArgs, config: EngineConfig,
                  allow_pickle: bool) -> tuple[Drafter, ModelInfo]:
    """The chosen drafter for the loaded target, and its load line (its context is the target's: RoPE is
    relative, so a head trained on shorter sequences still runs)."""
    t0 = time.perf_counter()
    device = torch.device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    model, params = load_drafter(choice, target, dtype, device, allow_pickle)
    return model, ModelInfo(choice.path, choice.plan_args(t_args), params, f"{str(dtype).removeprefix('torch.')} ({choice.kind})",
                            config.device, time.perf_counter() - t0)


def _load_target(path: Path, args: ModelArgs, config: EngineConfig, offload: OffloadConfig,
                 target_plan: TargetPlan | None, allow_pickle: bool) -> tuple[Transformer, ModelInfo]:
    """The resident loader when every layer stays resident and unquantized, else the offloaded target."""
    if target_plan is None or not target_plan.offloaded:
        return load_resident(path, args, config, allow_pickle)
    t0 = time.perf_counter()
    device = torch.device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    model = load_target(path, args, target_plan, offload, device, dtype)
    params = sum(math.prod(s) for s in expected_shapes(args).values())
    name = f"{str(dtype).removeprefix('torch.')} ({_formats(target_plan.fmt, model)})"
    return model, ModelInfo(path, args, params, name, config.device, time.perf_counter() - t0)


def _expert_passes(target: Transformer, plan: TargetPlan | None, mode: str) -> ExpertPasses | None:
    """An MoE target's ExpertPasses priced by its plan's tiers and bandwidths, trimming trees by `mode` (None
    for a dense target)."""
    if plan is None or not plan.offloaded:
        return expert_passes(target, mode=mode)
    p = plan.plan
    return expert_passes(target, p.tiers, p.bandwidths.ram, p.bandwidths.ssd, next(target.parameters()).device,
                         mode)


def _make_engine(target: Transformer, draft: Transformer | None, config: EngineConfig,
                 eos: tuple[int, ...], context: int | None = None, plan: TargetPlan | None = None) -> Engine:
    """The configured builder; none (target-only decoding) when it needs a draft and there is none. context:
    the tokens the memory plan reserved KV cache for (None: not planned); the plan may have chosen an int8
    draft cache to fit (exact: the draft only proposes)."""
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
        """Load the target at `model` and, unless `draft` is None, the draft at `draft` ("self[:FORMAT]": the
        target itself over offload.draft_layers of its layers, specexec/runtime/self_draft.py; it loads after the
        target). Without a draft the engine decodes with the target alone (when the configured builder needs a
        draft model). `offload`
        (default OffloadConfig()) says how the target's layers are stored and where they live. The memory plan
        is made from the configs before any weight is loaded and handed to `on_plan` (e.g. to print its
        ledger); then the draft loads, then the target as planned."""
        offload = offload or OffloadConfig()
        say = progress or (lambda _msg: None)
        check_device(config.device)
        check_builder(config.builder)              # the names an EngineConfig leaves to their registries
        check_verifier(config.verifier)
        t_path = resolve_model_path(model)
        t_args = read_args(t_path)
        self_spec = _self_spec(draft, config, offload)
        drafter = _choose_drafter(draft, t_path, t_args, config, offload, allow_pickle) if self_spec is None else None
        d_path = resolve_model_path(draft) if draft is not None and self_spec is None and drafter is None else None
        d_args = read_args(d_path) if d_path is not None else None
        say(f"loading tokenizer from {t_path}")
        tokenizer = load_tokenizer(t_path)
        d_tok = load_tokenizer(d_path) if d_path is not None else tokenizer
        note = check_compatible(tokenizer, d_tok, t_args.vocab_size, d_args.vocab_size if d_args else t_args.vocab_size)
        if d_path is not None:                  # a broken draft fails before the plan is shown
            check_checkpoint(d_path, d_args, allow_pickle)
        say("planning memory")
        plan = _plan(t_path, t_args, drafter.plan_args(t_args) if drafter is not None else d_args, config, offload,
                     self_spec, drafter.size() if drafter is not None else None)    # nothing of ours loaded yet
        if plan is not None and on_plan is not None:
            on_plan(plan)
        draft_model, d_info = None, None
        if d_path is not None:
            say(f"loading draft {d_path}")
            draft_model, d_info = load_resident(d_path, d_args, config, allow_pickle, offload.draft_quant, draft=True)
        say(f"loading target {t_path}")
        target, t_info = _load_target(t_path, t_args, config, offload, plan, allow_pickle)
        depth = None
        if self_spec is not None:               # the target itself, so it comes after the target
            draft_model, d_info, depth = _load_self(target, t_path, self_spec, plan, offload, config, say, tokenizer)
            if depth is not None:               # no depth pays: the gate decides when to draft (specexec/gate.py)
                config = config.replace(gate=with_depth_verdict(config.gate, depth.loses))
        if drafter is not None:                 # it may share the target's embedding and head: after the target
            say(f"loading drafter {drafter.describe()}")
            draft_model, d_info = _load_drafter(drafter, target, t_args, config, allow_pickle)
        eos = eos_ids(tokenizer, t_args.eos_token_ids)
        if config.draft_vocab is not None and draft_model is not None:       # VocabTrim (--draft-vocab)
            draft_model = _trim_draft(draft_model, target, tokenizer, t_path, config, eos, say)
            d_info = replace(d_info, dtype=f"{d_info.dtype} (head: {draft_model.n_kept} of "
                                          f"{d_info.args.vocab_size} tokens)")
        draft_model = align_vocab(draft_model, t_args.vocab_size)     # rows padded otherwise: draft_vocab.py
        pair = (acceptance.pair_fingerprint(t_path, d_path, t_args, d_args, config.draft_vocab)
                if d_path is not None else None)
        if self_spec is not None:
            pair = acceptance.pair_fingerprint(t_path, t_path, t_args, (SELF, draft_model.fmt, draft_model.layer_ids),
                                               config.draft_vocab)
        if drafter is not None:
            pair = acceptance.pair_fingerprint(t_path, drafter.path, t_args, (drafter.kind, drafter.args), None)
        engine = _make_engine(target, draft_model, with_measured_acceptance(config, pair), eos,
                              plan.memory.context if plan is not None else None, plan)
        runtime = cls(engine, tokenizer, t_info, d_info, config, plan)
        runtime.pair, runtime.pair_note = pair, note       # note: what check_compatible said of the pair
        runtime.depth = depth
        return runtime

    def variant(self, config: EngineConfig, use_draft: bool = True) -> "Runtime":
        """The same loaded models and tokenizer under another budget/builder, or without the draft."""
        if (config.device, config.dtype) != (self.config.device, self.config.dtype):
            raise ConfigError(f"a variant keeps the loaded device/dtype ({self.config.device}/{self.config.dtype}); "
                              f"got {config.device}/{config.dtype}")
        draft = self.engine.draft if use_draft else None
        if not use_draft:                                    # the target alone: nothing drafted, nothing to relax
            config = config.replace(accept=EXACT)
        if draft is not None and self.depth is not None:     # the measured depth's verdict holds for the variant
            config = config.replace(gate=with_depth_verdict(config.gate, self.depth.loses))
        engine = _make_engine(self.engine.target, draft, with_measured_acceptance(config, self.pair),
                              tuple(sorted(self.engine.eos_ids)), self.engine.planned_context,
                              self.plan)
        engine.neighbours = self.engine.neighbours           # relaxed acceptance's table: once per target
        runtime = Runtime(engine, self.tokenizer, self.target_info, self.draft_info if use_draft else None, config,
                          self.plan)
        runtime.pair, runtime.depth = self.pair, self.depth if use_draft else None
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


def _kv_cache_summary(engine: Engine) -> dict:
    """The target cache's format (int8 marked LOSSY: outside every exactness claim) and streamed layers."""
    caches = engine._caches
    quant = engine.config.kv_quant
    out = {"quant": quant, "lossy": quant != "none", "draft_quant": engine.draft_kv_quant}
    if caches is not None:
        out["streamed_layers"] = len(caches[0].streamed_layers)
    return out
