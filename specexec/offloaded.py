"""OffloadedTransformer: a Transformer whose decoder layers come from offload's LayerPager instead of memory.

Embeddings, final norm and LM head are resident (run dtype, on the device); each decoder layer lives packed
(quantized or not) in one of the pager's tiers: resident on the device, in a RAM region, or in the on-disk
layer cache. `layer_modules()` walks the pager: a streamed layer is bound (quant.bind_module, views only, no
allocation) to the Block of the slot it arrived in; a resident layer has its own Block bound once. forward,
logits and every other method are Transformer's, so the engine cannot tell the two apart. After each pass the
first layers of the next pass start loading (`pager.prefetch_start()`), i.e. while the draft grows its tree.

Also here: the naming of a layer's tensors for the cache (`layer_names`), reading the resident
embed/norm/head from a checkpoint, and `build_offloaded` (checkpoint + layer cache + plan -> model).

Does not know: how bytes move or where they live (offload.pager/tiers), budgets (offload.planner decides the
tiers), the CLI, tokens or trees.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

from offload import cache as layer_cache
from offload.cache import LayerCache, LayerNames
from offload.checkpoint import CheckpointError
from offload.sources import open_source
from offload.pager import LayerPager, build_pager
from offload.planner import Bandwidths, Needs, Plan, PlanError, default_budgets, plan
from offload.quant import auto_format, bind_module, device_problem, quantize_module, swap_linears
from offload.storage import LayerLayout, unpack_layer

from .config import ConfigError, EngineConfig, ModelArgs, OffloadConfig, check_budget_fits
from .loading import check_tensors, expected_shapes
from .model import Block, Transformer, rope_inv_freq

RESIDENT_NAMES = ("embed_tokens.weight", "norm.weight", "lm_head.weight")
PLAN_PROMPT_TOKENS = 2048          # prompt length the KV caches are planned for (plus max_new_tokens)
LOGIT_ROWS = 256                   # rows of fp32 logits the engine computes at once (engine.LOGIT_CHUNK)
N_SLOTS, N_BOUNCE = 2, 2           # device slots streamed layers pass through; SSD bounce buffers (CUDA)
ASSUMED = {"cuda": Bandwidths(ram=20e9, ssd=3e9), "cpu": Bandwidths(ram=8e9, ssd=1.5e9)}


def block_tensor_names(args: ModelArgs) -> tuple[list[str], frozenset[str]]:
    """(every tensor name of one decoder Block in state_dict order, the names of its nn.Linear weights)."""
    with torch.device("meta"):
        block = Block(args)
    names = list(block.state_dict())
    linear = frozenset(f"{path}.weight" for path, m in block.named_modules() if isinstance(m, nn.Linear))
    return names, linear


def checkpoint_prefix(names: Sequence[str]) -> str:
    """'model.' when the checkpoint's tensor names carry it (HF *ForCausalLM checkpoints), else ''."""
    return "model." if any(n.startswith("model.layers.") for n in names) else ""


def layer_names(path: Path, args: ModelArgs) -> list[LayerNames]:
    """For the layer cache: per decoder layer, packed name (as the Block binds it) -> checkpoint name, and
    which of them are Linear weights. CheckpointError unless the checkpoint holds exactly what `args` implies
    (check_tensors: the planner and `convert` call this before anything is cached)."""
    names, linear = block_tensor_names(args)
    source = open_source(path)
    check_tensors(path, source, args)          # before planning or caching: a bad checkpoint caches nothing
    stored = set(source.names())
    prefix = checkpoint_prefix(list(stored))
    out = []
    for i in range(args.n_layers):
        tensors = {n: f"{prefix}layers.{i}.{n}" for n in names}
        missing = [t for t in tensors.values() if t not in stored]
        if missing:
            raise CheckpointError(f"{path}: tensor {missing[0]!r} is missing ({len(missing)} missing for layer {i})")
        out.append(LayerNames(tensors, linear))
    return out


def read_resident(path: Path, args: ModelArgs, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """embed_tokens / norm / lm_head (unless tied) from the checkpoint, shape-checked, as dtype on device."""
    ckpt = open_source(path)
    prefix = checkpoint_prefix(ckpt.names())
    shapes = expected_shapes(args)
    out: dict[str, torch.Tensor] = {}
    for name in RESIDENT_NAMES:
        if name not in shapes:                    # lm_head of a tied model
            continue
        raw = name if name == "lm_head.weight" else prefix + name
        if tuple(ckpt.shape(raw)) != shapes[name]:
            raise CheckpointError(f"{path}: {raw} has shape {list(ckpt.shape(raw))}, config.json implies "
                                  f"{list(shapes[name])}")
        out[name] = ckpt.get(raw).to(device=device, dtype=dtype)
    return out


class OffloadedTransformer(Transformer):
    """Transformer with resident embed/norm/head and decoder layers served by a LayerPager."""

    def __init__(self, args: ModelArgs, resident: dict[str, torch.Tensor], layouts: Sequence[LayerLayout],
                 fmt: str, pager_factory, prefetch: bool = True) -> None:
        """resident: embed_tokens/norm/lm_head tensors (run dtype, on the device); layouts[i]: layer i's packed
        layout; fmt: the layers' quantization format; pager_factory(bind) -> LayerPager whose layers(ids)
        yields what bind(i, slot, buffer) returns."""
        with torch.device("meta"):
            super().__init__(args)
        self.layers = nn.ModuleList()                       # decoder layers come from the pager
        self.load_state_dict(resident, strict=False, assign=True)
        device, dtype = resident["embed_tokens.weight"].device, resident["embed_tokens.weight"].dtype
        self.inv_freq = rope_inv_freq(args).to(device)
        self.layouts, self.fmt, self.run_dtype = list(layouts), fmt, dtype
        self.prefetch = prefetch
        self._slot_blocks: dict[int, Block] = {}
        self._resident_blocks: dict[int, Block] = {}
        self.pager: LayerPager = pager_factory(self._bind)
        self.eval().requires_grad_(False)

    def _new_block(self) -> Block:
        with torch.device("meta"):
            block = Block(self.args)
        swap_linears(block, self.fmt, self.run_dtype)
        return block.eval().requires_grad_(False)

    def _bind(self, i: int, slot: int, buf: torch.Tensor) -> Block:
        """The Block for layer i held in `buf`: the slot's Block re-pointed at it, or layer i's resident Block."""
        if slot < 0 and i in self._resident_blocks:
            return self._resident_blocks[i]
        blocks = self._resident_blocks if slot < 0 else self._slot_blocks
        key = i if slot < 0 else slot
        if key not in blocks:
            blocks[key] = self._new_block()
        layout = self.layouts[i]
        bind_module(blocks[key], unpack_layer(buf, layout), layout.meta)
        return blocks[key]

    def layer_modules(self) -> Iterator[tuple[int, Block]]:
        """Decoder layers in order, streamed through the pager; then the next pass's first layers start loading."""
        yield from self.pager.layers(range(self.args.n_layers))
        if self.prefetch:
            self.pager.prefetch_start()

    def close(self) -> None:
        """Stop the pager's loader thread."""
        self.pager.close()


def build_offloaded(path: Path, args: ModelArgs, cache: LayerCache, tiers: Sequence[str], device: torch.device,
                    dtype: torch.dtype, n_slots: int = 2, n_bounce: int = 2) -> OffloadedTransformer:
    """The target at `path` with layer i in tiers[i] ("resident" | "ram" | "ssd"), its packed layers read from
    `cache` (built for the same checkpoint, format and dtype)."""
    if cache.n_layers != args.n_layers or cache.dtype != str(dtype).removeprefix("torch."):
        raise ValueError(f"layer cache {cache.path} holds {cache.n_layers} layers in {cache.dtype}; the model "
                         f"needs {args.n_layers} in {dtype}")
    resident = read_resident(path, args, dtype, device)

    def factory(bind) -> LayerPager:
        return build_pager(tiers, cache, device, n_slots=n_slots, n_bounce=n_bounce, bind=bind)

    return OffloadedTransformer(args, resident, [cache.layout(i) for i in range(args.n_layers)], cache.fmt, factory)


# ----------------------------------------------------------------------------------------- planning

def module_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer (quantized layers count their packed parts)."""
    tensors = list(model.parameters()) + [b for b in model.buffers() if b is not None]
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def kv_bytes(args: ModelArgs, capacity: int, elem: int) -> int:
    """One model's KV cache: K and V [n_layers, H_kv, capacity, head_dim]."""
    return 2 * args.n_layers * args.n_kv_heads * args.head_dim * capacity * elem


def activation_bytes(args: ModelArgs, tokens: int, context: int, elem: int, fmt: str) -> int:
    """Peak transient memory of one target pass over `tokens` rows attending to `context` slots: hidden and
    MLP activations, attention scores, one chunk of fp32 logits and (quantized) one dequantized weight."""
    acts = tokens * (4 * args.dim + 3 * args.intermediate_size) * elem
    scores = args.n_heads * tokens * context * elem
    logits = min(tokens, LOGIT_ROWS) * args.vocab_size * 4
    dequant = args.intermediate_size * args.dim * elem if fmt != "none" else 0
    return acts + scores + logits + dequant


def target_needs(args: ModelArgs, layer_bytes: Sequence[int], draft: Transformer | None, engine: EngineConfig,
                 elem: int, fmt: str) -> Needs:
    """What a run holds besides the streamed layers, for the planner."""
    shapes = expected_shapes(args)
    head = sum(_numel(shapes[n]) for n in RESIDENT_NAMES if n in shapes) * elem
    context = min(args.max_position_embeddings, PLAN_PROMPT_TOKENS + engine.max_new_tokens)
    capacity = context + 2 * engine.budget + 4
    kv = kv_bytes(args, capacity, elem) + (kv_bytes(draft.args, capacity, elem) if draft is not None else 0)
    fixed = (("target embed/norm/head", head), ("draft", module_bytes(draft) if draft is not None else 0),
             ("KV caches", kv), ("activations", activation_bytes(args, engine.budget + 1, capacity, elem, fmt)))
    return Needs(tuple(layer_bytes), fixed, N_SLOTS, N_BOUNCE)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


class TargetPlan:
    """The chosen layer format, the plan, and the layer naming the cache is built with."""

    def __init__(self, fmt: str, plan: Plan, names: list[LayerNames]) -> None:
        self.fmt, self.plan, self.names = fmt, plan, names

    @property
    def offloaded(self) -> bool:
        """False when the plain resident loader serves (every layer resident, unquantized)."""
        return self.fmt != "none" or self.plan.streams

    def describe(self) -> str:
        return f"target layers {self.fmt}; " + self.plan.describe()

    def notice(self) -> str:
        """What to print before generation: the plan when anything is offloaded, else only its warnings."""
        if self.offloaded:
            return self.describe()
        return "\n".join(f"warning: {w}" for w in self.plan.warnings)


def plan_target(path: Path, args: ModelArgs, draft: Transformer | None, offload: OffloadConfig,
                engine: EngineConfig, device: torch.device, dtype: torch.dtype) -> TargetPlan:
    """Pick the layer format (auto: none while everything stays resident, else streamed_formats) and each
    layer's tier.
    ConfigError (one line, what would fit) when the budgets cannot hold the run."""
    names = layer_names(path, args)
    _check_budgets_fit(offload, device)
    budgets = default_budgets(str(device))
    gpu = offload.gpu_budget if offload.gpu_budget is not None else budgets.gpu      # None on CPU unless given
    ram = offload.ram_budget if offload.ram_budget is not None else budgets.ram
    elem = torch.empty((), dtype=dtype).element_size()
    candidates = streamed_formats(offload.quant, device)
    for k, fmt in enumerate(candidates):
        sizes = [lay.nbytes for lay in layer_cache.plan(path, names, fmt, dtype, False)]
        needs = target_needs(args, sizes, draft, engine, elem, fmt)
        try:
            chosen = plan(needs, device.type, ram, gpu, offload.offload, ASSUMED[device.type])
        except PlanError as e:
            if k + 1 < len(candidates):
                continue
            raise ConfigError(str(e)) from None
        if fmt == "none" and k + 1 < len(candidates) and chosen.streams:
            continue                                  # auto: streaming layers go int4 (CPU) / nf4 (CUDA)
        return TargetPlan(fmt, chosen, names)
    raise AssertionError("unreachable")


def streamed_formats(quant: str, device: torch.device) -> list[str]:
    """The formats plan_target tries in order: auto -> none, then the device's streamed format (int4 on a CPU,
    nf4 on CUDA); else just the one asked for. ConfigError when that format cannot run on the device."""
    if quant == "auto":
        return ["none", auto_format(device)]
    problem = device_problem(quant, device)
    if problem:
        raise ConfigError(f"--quant {quant}: {problem}")
    return [quant]


def _check_budgets_fit(offload: OffloadConfig, device: torch.device) -> None:
    """Budgets above the machine's total RAM / the GPU's total memory are refused, not planned with."""
    import psutil

    check_budget_fits("--ram-budget", offload.ram_budget, psutil.virtual_memory().total, "RAM")
    if device.type == "cuda":                      # on CPU --gpu-budget is ignored (the plan warns)
        check_budget_fits("--gpu-budget", offload.gpu_budget, torch.cuda.mem_get_info(device)[1], "GPU memory")


def load_target(path: Path, args: ModelArgs, target_plan: TargetPlan, offload: OffloadConfig,
                device: torch.device, dtype: torch.dtype, log=None) -> OffloadedTransformer:
    """Build (or reuse) the layer cache for the plan's format and assemble the offloaded target."""
    quantize_on = str(device) if device.type == "cuda" else None      # quantizing on the GPU is much faster
    cache = LayerCache.open_or_build(path, target_plan.names, target_plan.fmt, dtype, cache_root=offload.cache_dir,
                                     log=log, quantize_device=quantize_on)
    return build_offloaded(path, args, cache, target_plan.plan.tiers, device, dtype, N_SLOTS, N_BOUNCE)


def quantize_layers(model: Transformer, fmt: str, row_exact: bool = True) -> None:
    """Quantize every decoder layer's linears in place (resident use, e.g. --draft-quant); embed/head stay.
    row_exact=False for a draft: fused kernels whose rows may depend on the batch are allowed (quant.kernel_for)."""
    if fmt == "none":
        return
    dtype = model.embed_tokens.weight.dtype
    problem = device_problem(fmt, model.embed_tokens.weight.device)
    if problem:
        raise ConfigError(f"{fmt} layers: {problem}")
    for block in model.layers:
        quantize_module(block, fmt, dtype, row_exact=row_exact)
