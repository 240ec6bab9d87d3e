"""OffloadedTransformer: a Transformer whose decoder layers come from offload's LayerPager instead of memory.

Embeddings, final norm and LM head are resident (run dtype, on the device; the head int8 where the layers run the
CPU integer kernels, `quantize_head`); each decoder layer lives packed
(quantized or not) in one of the pager's tiers: resident on the device, in a RAM region, or in the on-disk
layer cache. `layer_modules()` walks the pager: a streamed layer is bound (quant.bind_module, views only, no
allocation) to the Block of the slot it arrived in; a resident layer has its own Block bound once. forward,
logits and every other method are Transformer's, so the engine cannot tell the two apart. After each pass the
first layers of the next pass start loading (`pager.prefetch_start()`), i.e. while the draft grows its tree.

The embedding table of a streamed, untied target may stay in host RAM (HostEmbedding) when the plan says so
(see specexec/runtime/ledger.py). A streamed target carries `prefill_tokens`: how many prompt tokens one prefill pass
takes (the engine reads it), as many as its plan allows.

Also here: the naming of a layer's tensors for the cache (`layer_names`), reading the resident
embed/norm/head from a checkpoint, `build_offloaded` (checkpoint + layer cache + plan -> model), and
`plan_target` (the run's memory plan from the configs, specexec/runtime/ledger.py).

Does not know: how bytes move or where they live (offload.streaming.pager/tiers), how the tiers are chosen
(offload.planner, specexec.runtime.ledger), the CLI, tokens or trees.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from offload.cache import store as layer_cache
from offload.cache.identity import LayerNames
from offload.cache.store import LayerCache
from offload.formats.checkpoint import CheckpointError
from offload.memory_plan import PlanError
from offload.platform.mounts import slow_mount_warnings
from offload.formats.sources import open_source
from offload.quant.weights import auto_format, device_problem, head_format, quantize_weight
from offload.streaming.pager import LayerPager, build_pager
from offload.planner import default_budgets
from offload.quant.linear import QuantLinear, bind_module, quantize_module, swap_linears
from offload.streaming.storage import LayerLayout, unpack_layer

from specexec.options import ConfigError, check_budget_fits
from specexec.runtime import ledger, sizes
from specexec.config import EngineConfig, ModelArgs, OffloadConfig
from specexec.kv.cache import KVCache
from specexec.runtime.ledger import ASSUMED, MemoryPlan, plan_memory, what_fits
from specexec.runtime.run_shape import RunShape, SelfDraftShape, plan_context, with_self_draft
from specexec.runtime.loading import check_tensors, expected_shapes
from specexec.model import LOGIT_CHUNK, Block, Transformer, on_meta, rope_inv_freq

RESIDENT_NAMES = ("embed_tokens.weight", "norm.weight", "lm_head.weight")
N_SLOTS, N_BOUNCE = 2, 2           # minimum device slots / SSD bounce buffers (the plan may deepen them)


def block_tensor_names(args: ModelArgs) -> tuple[list[str], frozenset[str]]:
    """(every tensor name of one decoder Block in state_dict order, the names of its nn.Linear weights)."""
    shapes, linear = sizes.block_specs(args)
    return [n for n, _ in shapes], linear


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


def read_resident(path: Path, args: ModelArgs, dtype: torch.dtype, device: torch.device,
                  host: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """embed_tokens / norm / lm_head (unless tied) from the checkpoint, shape-checked, as dtype on device (the
    names in `host` stay in CPU memory)."""
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
        out[name] = ckpt.get(raw).to(device="cpu" if name in host else device, dtype=dtype)
    return out


class HostEmbedding(nn.Module):
    """An input embedding whose table stays in host RAM: the rows of a pass's tokens are gathered on the CPU
    and copied to the device. The same bits as a device lookup (a gather copies rows); on CUDA the cost is one
    copy of the T token ids to the host and T x dim values back, against GPU memory for more resident layers.
    The table is a plain attribute, not a parameter, so .parameters() / .to() leave it where it is."""

    def __init__(self, table: torch.Tensor, device: torch.device) -> None:
        super().__init__()
        self.table, self.device = table, torch.device(device)

    @property
    def weight(self) -> torch.Tensor:
        return self.table

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [...] (any device) -> rows [..., dim] on self.device."""
        rows = self.table.index_select(0, tokens.reshape(-1).cpu())
        return rows.view(*tokens.shape, rows.shape[-1]).to(self.device)


class OffloadedTransformer(Transformer):
    """Transformer with resident embed/norm/head and decoder layers served by a LayerPager."""

    def __init__(self, args: ModelArgs, resident: dict[str, torch.Tensor], layouts: Sequence[LayerLayout],
                 fmt: str, pager_factory, prefetch: bool = True, embed_on_host: bool = False) -> None:
        """resident: embed_tokens/norm/lm_head tensors (run dtype, on the device); layouts[i]: layer i's packed
        layout; fmt: the layers' quantization format; pager_factory(bind) -> LayerPager whose layers(ids)
        yields what bind(i, slot, buffer) returns. embed_on_host: the embedding table (resident[
        "embed_tokens.weight"], on the CPU) serves lookups from host RAM (HostEmbedding; untied models only)."""
        with on_meta():
            super().__init__(args)
        self.layers = nn.ModuleList()                       # decoder layers come from the pager
        device, dtype = resident["norm.weight"].device, resident["norm.weight"].dtype
        if embed_on_host:
            if args.tie_word_embeddings:
                raise ValueError("a tied embedding is the LM head: it cannot stay in host RAM")
            self.embed_tokens = HostEmbedding(resident["embed_tokens.weight"], device)
            resident = {k: v for k, v in resident.items() if k != "embed_tokens.weight"}
        self.load_state_dict(resident, strict=False, assign=True)
        self.inv_freq = rope_inv_freq(args).to(device)
        self.layouts, self.fmt, self.run_dtype = list(layouts), fmt, dtype
        self.prefetch = prefetch
        self._slot_blocks: dict[int, Block] = {}
        self._resident_blocks: dict[int, Block] = {}
        self.pager: LayerPager = pager_factory(self._bind)
        self.kv_streamed: tuple[int, ...] = ()        # layers whose KV rows stream with them (the plan's choice)
        self._kv: KVCache | None = None               # the cache whose streamed rows the pager stages now
        self.eval().requires_grad_(False)

    def _new_block(self) -> Block:
        with on_meta():
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

    def new_cache(self, capacity: int, quant: str = "none", tail: int = 0) -> KVCache:
        """A KV cache whose `kv_streamed` layers keep their rows in host RAM (pinned on CUDA) and travel with
        their layer through the pager's slots (specexec/kv/stream.py); the others on the device."""
        a = self.args
        streamed = [i for i in self.kv_streamed if self.pager.tier_of(i) != "resident"]
        if streamed and self._kv is not None:         # let go of an earlier engine's cache before allocating
            self.pager.discard()
            self.pager.companion, self._kv = None, None
        cache = KVCache(a.n_layers, a.n_kv_heads, a.head_dim, capacity, self.run_dtype, self.norm.weight.device,
                        quant=quant, streamed=streamed, tail=tail)
        if streamed:
            cache.attach(len(self.pager.slots), self.pager.discard)
        return cache

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask=None, cache: KVCache | None = None,
                slots: torch.Tensor | None = None) -> torch.Tensor:
        """Transformer.forward; a cache with streamed layers becomes the pager's companion first (a read-ahead
        made for another cache is discarded)."""
        kv = cache if cache is not None and cache.streams else None
        if kv is not self._kv:
            self.pager.discard()
            self.pager.companion = kv.companion if kv is not None else None
            self._kv = kv
        return super().forward(tokens, positions, mask, cache, slots)
    def resident_block(self, i: int) -> Block | None:
        """Layer i's Block when the plan keeps it resident (bound once: the very Block every pass runs), else
        None. A self-draft runs these as they are (specexec/runtime/self_draft.py)."""
        if self.pager.tier_of(i) != "resident":
            return None
        return self._bind(i, -1, self.pager.resident.buffer(i)[:self.pager.sizes[i]])

    def layer_modules(self) -> Iterator[tuple[int, Block]]:
        """Decoder layers in order, streamed through the pager; then the next pass's first layers start loading."""
        yield from self.pager.layers(range(self.args.n_layers))
        if self.prefetch:
            self.pager.prefetch_start()

    def close(self) -> None:
        """Stop the pager's loader thread."""
        self.pager.close()


def build_offloaded(path: Path, args: ModelArgs, cache: LayerCache, tiers: Sequence[str], device: torch.device,
                    dtype: torch.dtype, n_slots: int = 2, n_bounce: int = 2,
                    embed_on_host: bool = False) -> OffloadedTransformer:
    """The target at `path` with layer i in tiers[i] ("resident" | "ram" | "ssd"), its packed layers read from
    `cache` (built for the same checkpoint, format and dtype); the embedding table in host RAM when
    embed_on_host."""
    if cache.n_layers != args.n_layers or cache.dtype != str(dtype).removeprefix("torch."):
        raise ValueError(f"layer cache {cache.path} holds {cache.n_layers} layers in {cache.dtype}; the model "
                         f"needs {args.n_layers} in {dtype}")
    host = frozenset({"embed_tokens.weight"} if embed_on_host else ())
    resident = read_resident(path, args, dtype, device, host)

    def factory(bind) -> LayerPager:
        return build_pager(tiers, cache, device, n_slots=n_slots, n_bounce=n_bounce, bind=bind)

    return OffloadedTransformer(args, resident, [cache.layout(i) for i in range(args.n_layers)], cache.fmt, factory,
                                embed_on_host=embed_on_host)


# ----------------------------------------------------------------------------------------- planning

def module_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer (quantized layers count their packed parts)."""
    tensors = list(model.parameters()) + [b for b in model.buffers() if b is not None]
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def activation_bytes(args: ModelArgs, tokens: int, context: int, elem: int, fmt: str, device: str = "cpu") -> int:
    """Peak transient bytes of one target pass over `tokens` rows and `context` slots (sizes.forward_bytes
    with one LM-head chunk of logits)."""
    return sizes.forward_bytes(args, tokens, context, elem, fmt, device, LOGIT_CHUNK)


def target_formats(quant: str, device_type: str) -> tuple[str, ...]:
    """The formats plan_memory tries: --quant auto -> unquantized while every layer stays resident, else the
    device's streamed format (quant.auto_format: int4 on a CPU, nf4 on CUDA); any other --quant is the one
    format. ConfigError when that format cannot run on the device."""
    if quant == "auto":
        return ("none", auto_format(device_type))
    problem = device_problem(quant, device_type)
    if problem:
        raise ConfigError(f"--quant {quant}: {problem}")
    return (quant,)


def run_shape(args: ModelArgs, draft: ModelArgs | None, engine: EngineConfig, offload: OffloadConfig,
              device_type: str, dtype: torch.dtype, draft_kv: Callable[[int], int] | None = None,
              self_draft: SelfDraftShape | None = None) -> RunShape:
    """The ledger's view of a run: the models, run dtype, tree budget, planned context (--context, default
    DEFAULT_CONTEXT of run_shape.py, at most what the models support), the draft's format and KV scratch, and the KV
    caches' format (--kv-quant) and where the target's KV rows may live (--kv-offload). With self_draft (the
    target itself as the draft; `draft` is then None) its format and layer count."""
    context = plan_context(offload.context, args, draft)
    shape = RunShape(args, draft, dtype, device_type, engine.budget, context,
                     offload.draft_quant if draft is not None else "none", draft_kv if draft is not None else None,
                     kv_quant=engine.kv_quant, kv_offload=offload.kv_offload)
    if self_draft is None:
        return shape
    return with_self_draft(replace(shape, draft_kv=draft_kv), self_draft.fmt, self_draft.layers)


class TargetPlan:
    """The run's memory plan (format, tiers, ledger: ledger.MemoryPlan) and the layer naming the cache is
    built with."""

    def __init__(self, memory: MemoryPlan, names: list[LayerNames]) -> None:
        self.memory, self.names = memory, names
        self.fmt, self.plan = memory.fmt, memory.plan

    @property
    def offloaded(self) -> bool:
        """False when the plain resident loader serves (every layer resident, unquantized)."""
        return self.fmt != "none" or self.plan.streams

    def describe(self) -> str:
        return self.memory.describe()

    def notice(self) -> str:
        """What to print before loading: the ledger when anything is offloaded or the run is on a GPU, else
        only the plan's warnings."""
        if self.offloaded or self.plan.device == "cuda":
            return self.describe()
        return "\n".join(f"warning: {w}" for w in self.plan.warnings)


def plan_target(path: Path, args: ModelArgs, draft: ModelArgs | None, offload: OffloadConfig,
                engine: EngineConfig, device: torch.device, dtype: torch.dtype,
                draft_kv: Callable[[int], int] | None = None, self_draft: SelfDraftShape | None = None
                ) -> TargetPlan:
    """Plan the run from the configs (no weight is read; the checkpoint's tensor names and shapes are
    checked): layer format, each layer's tier, the ledger. `draft` is the draft's config (counted once, in
    --draft-quant's format), draft_kv its builder's kv_slots (None: no draft cache); self_draft: the draft is
    the target itself (with_self_draft; its layer count chosen here when auto). Budgets: --gpu-budget /
    --ram-budget, else what is free now (call this before anything of the run is loaded). ConfigError (one
    line, with what would fit) when the budgets cannot hold the run."""
    names = layer_names(path, args)
    _check_budgets_fit(offload, device)
    budgets = default_budgets(str(device))
    gpu = offload.gpu_budget if offload.gpu_budget is not None else budgets.gpu      # None on CPU unless given
    ram = offload.ram_budget if offload.ram_budget is not None else budgets.ram
    shape = run_shape(args, draft, engine, offload, device.type, dtype, draft_kv, self_draft)
    formats = target_formats(offload.quant, device.type)
    try:
        memory = plan_memory(shape, formats, ram, gpu, offload.offload, ASSUMED[device.type])
    except PlanError as e:
        hint = what_fits(shape, formats, ram, gpu, offload.offload, ASSUMED[device.type])
        raise ConfigError(str(e) + (f"; {hint}" if hint else "")) from None
    uses_cache = memory.fmt != "none" or memory.plan.streams
    root = (offload.cache_dir or layer_cache.default_cache_root()) if uses_cache else None
    return TargetPlan(ledger.with_warnings(memory, slow_mount_warnings(path, root)), names)



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
    p = target_plan.plan
    model = build_offloaded(path, args, cache, p.tiers, device, dtype, p.n_slots or N_SLOTS, p.n_bounce or N_BOUNCE,
                            embed_on_host=target_plan.memory.embed_on_host)
    if p.streams:                                  # one prefill pass streams every layer: as long as planned
        model.prefill_tokens = target_plan.memory.prefill_tokens
    model.kv_streamed = tuple(p.companions_streamed)   # their KV rows travel with them (KVCache streamed layers)
    model.plan_fingerprint = f"{p.tiers}|{p.n_slots}|{p.n_bounce}|{target_plan.memory.embed_on_host}" + (
        f"|kv {p.companions_streamed}" if p.companions_streamed else "")
    quantize_head(model, target_plan.fmt)
    return model


def quantize_head(model: Transformer, layer_fmt: str) -> None:
    """Give `model` the LM head its layer format calls for (offload.quant.weights.head_format): an int8 copy of
    the head (the embedding when tied; the embedding table itself stays for lookups) computed by the CPU
    integer kernel, as `model.lm_head`. Row-exact like the layers, so the target's tree pass and one-token
    pass still agree; the fp32 head of an untied model is freed."""
    weight = model.head_weight
    if head_format(layer_fmt, weight.device) == "none" or isinstance(model._modules.get("lm_head"), QuantLinear):
        return
    head = QuantLinear(weight.shape[1], weight.shape[0], False, "int8", weight.dtype)
    head.set_parts(*quantize_weight(weight.detach(), "int8", weight.dtype), None)
    model.lm_head = head.eval()


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
