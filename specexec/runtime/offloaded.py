"""OffloadedTransformer: a Transformer whose decoder layers come from offload's LayerPager instead of memory.

Embeddings, final norm and LM head are resident (run dtype, on the device; the head int8 where the layers run the
CPU integer kernels, `quantize_head`); each decoder layer lives packed
(quantized or not) in one of the pager's tiers: resident on the device, in a RAM region, or in the on-disk
layer cache. `layer_modules()` walks the pager: a streamed layer is bound (quant.bind_module, views only, no
allocation) to the Block of the slot it arrived in; a resident layer has its own Block bound once. forward,
logits and every other method are Transformer's, so the engine cannot tell the two apart. After each pass the
first layers of the next pass start loading (`pager.prefetch_start()`), i.e. while the draft grows its tree.

The embedding table of a streamed, untied target may stay in host RAM (HostEmbedding) when the plan says so
(see specexec/planning/ledger.py). A streamed target carries `prefill_tokens`: how many prompt tokens one
prefill pass takes (the engine reads it), as many as its plan allows.

Also here: `build_offloaded` (checkpoint + layer cache + tiers -> model), `load_target` (a TargetPlan ->
the model, its layer cache built or reused) and `quantize_layers` (a resident model's layers in place).

Does not know: how bytes move or where they live (offload.streaming.pager/tiers), how the tiers are chosen
(offload.planner, specexec/planning/), how a checkpoint names its tensors (specexec/checkpoints/naming.py),
the CLI, tokens or trees.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from offload.cache.store import LayerCache
from offload.quant.linear import QuantLinear, bind_module, quantize_module, swap_linears
from offload.quant.weights import device_problem, head_format, quantize_weight
from offload.streaming.pager import LayerPager, build_pager
from offload.streaming.storage import LayerLayout, unpack_layer

from specexec.checkpoints.naming import layer_form, read_resident, sparse_layer
from specexec.config import ModelArgs, OffloadConfig
from specexec.kv.cache import KVCache
from specexec.network.mixers import new_cache
from specexec.network.model import Block, Execution, Transformer, on_meta
from specexec.options import ConfigError
from specexec.planning.target import TargetPlan
from specexec.runtime.cpu_blocks import fast_block, fast_stack
from specexec.runtime.cpu_experts import CpuExperts, check_cpu_format, cpu_experts
from specexec.runtime.expert_stream import ExpertCache, ExpertStream

N_SLOTS, N_BOUNCE = 2, 2           # minimum device slots / SSD bounce buffers (the plan may deepen them)
DRAFT_HEAD_FORMAT = "int4"         # an int4 draft's LM head on a CPU (quantize_head; a target's stays int8)


class HostEmbedding(nn.Module):
    """An input embedding whose table stays in host RAM: the rows of a pass's tokens are gathered on the CPU
    and copied to the device. The same bits as a device lookup (a gather copies rows); on CUDA the cost is one
    copy of the T token ids to the host and T x dim values back, against GPU memory for more resident layers.
    The table is a plain attribute, not a parameter, so .parameters() / .to() leave it where it is.

    On CUDA the rows are gathered into a pinned staging buffer (grown to the largest pass, kept) and copied
    over without blocking; an event recorded after the copy is waited for before the buffer is written again
    (by the next pass the copy has long finished). Reading the ids is the one wait left: the CPU gathers."""

    def __init__(self, table: torch.Tensor, device: torch.device) -> None:
        super().__init__()
        self.table, self.device = table, torch.device(device)
        self.staging: torch.Tensor | None = None           # pinned [rows, dim] (CUDA only)
        self._copied = None                                 # torch.cuda.Event after the last copy out of it

    @property
    def weight(self) -> torch.Tensor:
        return self.table

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [...] (any device) -> rows [..., dim] on self.device."""
        ids = tokens.reshape(-1).cpu()
        if self.device.type != "cuda":
            rows = self.table.index_select(0, ids)
            return rows.view(*tokens.shape, rows.shape[-1]).to(self.device)
        out = self._stage(ids.numel())
        torch.index_select(self.table, 0, ids, out=out)
        rows = out.to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return rows.view(*tokens.shape, rows.shape[-1])

    def _stage(self, n: int) -> torch.Tensor:
        """The first n rows of the pinned staging buffer, once the last copy out of it has finished."""
        if self._copied is not None:
            self._copied.synchronize()
        if self.staging is None or self.staging.shape[0] < n:
            rows = max(n, 2 * self.staging.shape[0] if self.staging is not None else 64)
            self.staging = torch.empty(rows, self.table.shape[1], dtype=self.table.dtype).pin_memory()
        return self.staging[:n]


class OffloadedTransformer(Transformer):
    """Transformer with resident embed/norm/head and decoder layers served by a LayerPager."""

    def __init__(self, args: ModelArgs, resident: dict[str, torch.Tensor], layouts: Sequence[LayerLayout],
                 fmt: str, pager_factory, prefetch: bool = True, embed_on_host: bool = False,
                 execution: Execution = Execution(), kv_streamed: Sequence[int] = (),
                 prefill_tokens: int | None = None, plan_fingerprint: str = "") -> None:
        """resident: embed_tokens/norm/lm_head tensors (run dtype, on the device); layouts[i]: layer i's packed
        layout; fmt: the layers' quantization format; pager_factory(bind) -> LayerPager whose layers(ids)
        yields what bind(i, slot, buffer) returns. embed_on_host: the embedding table (resident[
        "embed_tokens.weight"], on the CPU) serves lookups from host RAM (HostEmbedding; untied models only).
        execution: how it runs besides its modules (Execution; each layer module is told its part when made);
        kv_streamed: layers whose KV rows stream with them (the plan's choice); prefill_tokens: prompt tokens per
        prefill pass (PlansPrefill; None: the engine's default); plan_fingerprint: the plan's tiers, slots and
        streamed KV (PlannedLayers: the tuner's costs are kept per plan)."""
        with on_meta():
            super().__init__(args, execution)
        if prefill_tokens is not None:
            self.prefill_tokens = prefill_tokens
        self.plan_fingerprint = plan_fingerprint
        self.layers = nn.ModuleList()                       # decoder layers come from the pager
        device, dtype = resident["norm.weight"].device, resident["norm.weight"].dtype
        if embed_on_host:
            if args.tie_word_embeddings:
                raise ValueError("a tied embedding is the LM head: it cannot stay in host RAM")
            self.embed_tokens = HostEmbedding(resident["embed_tokens.weight"], device)
            resident = {k: v for k, v in resident.items() if k != "embed_tokens.weight"}
        self.load_state_dict(resident, strict=False, assign=True)
        self.init_rope(device)
        self.layouts, self.fmt, self.run_dtype = list(layouts), fmt, dtype
        self.prefetch = prefetch
        self._slot_blocks: dict[object, Block] = {}
        self._resident_blocks: dict[int, Block] = {}
        self._examined: set[int] = set()              # modules _with_fast has looked at
        self._stack_examined = False                  # whether _stack_all_resident has looked
        self.current: tuple = (-1, -1, None, None)     # (layer, slot or -1, Block, buffer) the pager handed out last
        self.pager: LayerPager = pager_factory(self._bind)
        self.kv_streamed = tuple(kv_streamed)
        self.cpu_expert_layers: tuple[int, ...] = ()  # sparse layers whose experts compute on the CPU
        self._kv: KVCache | None = None               # the cache whose streamed rows the pager stages now
        self.eval().requires_grad_(False)

    def _new_block(self, i: int) -> Block:
        with on_meta():
            block = Block(self.args, i)
        swap_linears(block, self.fmt, self.run_dtype)
        block.run_as(None, self.execution.row_exact)
        return block.eval().requires_grad_(False)

    def _bind(self, i: int, slot: int, buf: torch.Tensor) -> Block:
        """The Block for layer i held in `buf`: the slot's Block (one per slot and layer form, naming.layer_form:
        an MoE model's dense and sparse layers differ, Gemma 4's full and sliding ones) re-pointed at it, or layer
        i's resident Block."""
        if slot < 0 and i in self._resident_blocks:
            self.current = (i, -1, self._resident_blocks[i], buf)
            return self._with_fast(self._resident_blocks[i])
        blocks = self._resident_blocks if slot < 0 else self._slot_blocks
        key = i if slot < 0 else (slot, layer_form(self.args, i))
        if key not in blocks:
            blocks[key] = self._new_block(i)
        layout = self.layouts[i]
        bind_module(blocks[key], unpack_layer(buf, layout), layout.meta)
        self.current = (i, slot, blocks[key], buf)    # an MoE layer's experts come next (expert_stream.py)
        return self._with_fast(blocks[key])

    def _with_fast(self, block: Block) -> Block:
        """A layer module of the CPU integer kernels gets its compiled path (cpu_blocks) when first handed out;
        a slot's module rebuilds that path's pointers on each pass after a re-bind."""
        if self.execution.row_exact and id(block) not in self._examined:
            self._examined.add(id(block))
            block.run_as(fast_block(self.args, block), True)
        return block

    def expert_counters(self) -> dict[str, float]:
        """(CountsExperts) Cumulative bytes of experts brought onto the device, routed experts looked up in
        streamed layers and found in the expert cache (zeros when no sparse layer streams)."""
        stream = self.routing if isinstance(self.routing, ExpertStream) else None
        return stream.all_counters() if stream is not None else {"expert_bytes": 0.0, "expert_hits": 0.0,
                                                                 "expert_lookups": 0.0}

    def experts_held(self) -> torch.Tensor:
        """(CountsExperts) [L, E] bool over the sparse layers in order: every expert of a resident layer, the
        cached ones of a streamed layer."""
        m = self.args.moe
        rows = []
        for i in (j for j in range(self.args.n_layers) if sparse_layer(self.args, j)):
            row = torch.zeros(m.n_experts, dtype=torch.bool)
            if self.pager.tier_of(i) == "resident" or i in self.cpu_expert_layers:
                row[:] = True                     # (CPU-computed experts move nothing either)
            elif isinstance(self.routing, ExpertStream):
                row[list(self.routing.cache.held(i))] = True
            rows.append(row)
        return torch.stack(rows)

    def new_cache(self, capacity: int, quant: str = "none", tail: int = 0) -> KVCache:
        """A KV cache whose `kv_streamed` layers keep their rows in host RAM (pinned on CUDA) and travel with
        their layer through the pager's slots (specexec/kv/stream.py); the others on the device."""
        a = self.args
        streamed = [i for i in self.kv_streamed if self.pager.tier_of(i) != "resident"]
        if streamed and self._kv is not None:         # let go of an earlier engine's cache before allocating
            self.pager.discard()
            self.pager.companion, self._kv = None, None
        cache = new_cache(a, capacity, self.run_dtype, self.norm.weight.device, quant, streamed=streamed, tail=tail,
                          windows=[k.window for k in a.layer_kinds])
        if streamed:
            cache.attach(len(self.pager.slots), self.pager.discard)
        return cache

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask=None, cache: KVCache | None = None,
                slots: torch.Tensor | None = None) -> torch.Tensor:
        """Transformer.forward; a cache with streamed layers becomes the pager's companion first (a read-ahead
        made for another cache is discarded)."""
        self.begin_pass(cache)
        if not self._stack_examined:
            self._stack_all_resident()
        return super().forward(tokens, positions, mask, cache, slots)

    def begin_pass(self, cache: KVCache | None) -> None:
        """A pass over `cache` starts: when its rows stream with the layers it becomes the pager's companion (a
        read-ahead made for another cache is discarded); a forest pass (specexec/batching/) names None."""
        kv = cache if cache is not None and cache.streams else None
        if kv is not self._kv:
            self.pager.discard()
            self.pager.companion = kv.companion if kv is not None else None
            self._kv = kv

    def _stack_all_resident(self) -> None:
        """When the plan keeps every layer resident and each runs compiled, the whole stack in one call
        (cpu_blocks.fast_stack; decode takes it for the passes it serves, else the pager's path): nothing streams,
        so the pager has nothing to do between layers."""
        self._stack_examined = True
        n = self.args.n_layers
        if self.execution.row_exact and all(self.pager.tier_of(i) == "resident" for i in range(n)):
            stack = fast_stack(self.args, [self.resident_block(i) for i in range(n)])
            self.run_as(replace(self.execution, stack=stack))

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
                    embed_on_host: bool = False, expert_cache: int = 0, cpu_layers: Sequence[int] = (),
                    kv_streamed: Sequence[int] = (), prefill_tokens: int | None = None,
                    plan_key: str = "") -> OffloadedTransformer:
    """The target at `path` with layer i in tiers[i] ("resident" | "ram" | "ssd"), its packed layers read from
    `cache` (built for the same checkpoint, format and dtype); the embedding table in host RAM when
    embed_on_host. A streamed sparse (MoE) layer streams in two phases (expert_stream.py): its dense part
    ahead, then the experts its rows route to, `expert_cache` of each such layer's hottest kept on the device;
    `cpu_layers` (RAM-tier sparse layers) compute their experts on the CPU from the RAM tier's bytes instead.
    kv_streamed, prefill_tokens: OffloadedTransformer's; plan_key: the plan's part of its plan_fingerprint (the
    CPU-computed expert layers are added here)."""
    if cache.n_layers != args.n_layers or cache.dtype != str(dtype).removeprefix("torch."):
        raise ValueError(f"layer cache {cache.path} holds {cache.n_layers} layers in {cache.dtype}; the model "
                         f"needs {args.n_layers} in {dtype}")
    host = frozenset({"embed_tokens.weight"} if embed_on_host else ())
    resident = read_resident(path, args, dtype, device, host)

    layouts = [cache.layout(i) for i in range(args.n_layers)]
    parted = {i: lay for i, lay in enumerate(layouts) if lay.regions and tiers[i] != "resident"}
    heads = [parted[i].dense_nbytes if i in parted else lay.nbytes for i, lay in enumerate(layouts)]

    def factory(bind) -> LayerPager:
        return build_pager(tiers, cache, device, n_slots=n_slots, n_bounce=n_bounce, bind=bind,
                           heads=heads if parted else None)

    row_exact = head_format(cache.fmt, device) == "int8"      # the layers run the CPU integer kernels
    fingerprint = plan_key + (f"|cpu experts {tuple(sorted(cpu_layers))}" if cpu_layers else "")
    model = OffloadedTransformer(args, resident, layouts, cache.fmt, factory, embed_on_host=embed_on_host,
                                 execution=Execution(row_exact=row_exact), kv_streamed=kv_streamed,
                                 prefill_tokens=prefill_tokens, plan_fingerprint=fingerprint)
    if parted:
        cpu = _cpu_experts(model, cpu_layers, cache.fmt, device, dtype)
        cached = {i: lay for i, lay in parted.items() if i not in cpu_layers}
        stream = ExpertStream(model, ExpertCache(cached, args.moe.n_experts, expert_cache, device), cpu)
        model.run_as(replace(model.execution, routing=stream))
    return model


def _cpu_experts(model: OffloadedTransformer, layers: Sequence[int], fmt: str, device: torch.device,
                 dtype: torch.dtype) -> CpuExperts | None:
    """The CPU experts of `layers` (RAM-tier sparse layers), bound to the RAM tier's bytes; None for none."""
    if not layers:
        return None
    check_cpu_format(fmt, device)
    bad = [i for i in layers if model.pager.tier_of(i) != "ram" or not sparse_layer(model.args, i)]
    if bad:
        raise ValueError(f"experts computed on the CPU need sparse layers held in RAM; layers {bad} are not")
    model.cpu_expert_layers = tuple(sorted(layers))
    buffers = {i: model.pager.ram.buffer(i) for i in layers}
    return cpu_experts(model.args, layers, buffers, model.layouts, fmt, dtype)


def load_target(path: Path, args: ModelArgs, target_plan: TargetPlan, offload: OffloadConfig,
                device: torch.device, dtype: torch.dtype, log=None) -> OffloadedTransformer:
    """Build (or reuse) the layer cache for the plan's format and assemble the offloaded target."""
    quantize_on = str(device) if device.type == "cuda" else None      # quantizing on the GPU is much faster
    cache = LayerCache.open_or_build(path, target_plan.names, target_plan.fmt, dtype, cache_root=offload.cache_dir,
                                     log=log, quantize_device=quantize_on)
    p = target_plan.plan
    plan_key = f"{p.tiers}|{p.n_slots}|{p.n_bounce}|{target_plan.memory.embed_on_host}" + (
        f"|kv {p.companions_streamed}" if p.companions_streamed else "")
    model = build_offloaded(path, args, cache, p.tiers, device, dtype, p.n_slots or N_SLOTS, p.n_bounce or N_BOUNCE,
                            embed_on_host=target_plan.memory.embed_on_host, expert_cache=p.cached_parts,
                            cpu_layers=target_plan.cpu_expert_layers,
                            kv_streamed=p.companions_streamed,     # their KV rows travel with them
                            prefill_tokens=target_plan.memory.prefill_tokens if p.streams else None,  # as planned
                            plan_key=plan_key)
    quantize_head(model, target_plan.fmt)
    return model


def quantize_head(model: Transformer, layer_fmt: str, draft: bool = False) -> None:
    """Give `model` the LM head its layer format calls for (offload.quant.weights.head_format): an int8 copy of
    the head (the embedding when tied; the embedding table itself stays for lookups) computed by the CPU
    integer kernel, as `model.lm_head`. Row-exact like the layers, so the target's tree pass and one-token
    pass still agree; the fp32 head of an untied model is freed. A draft with int4 layers gets an int4 head
    (group 64; DRAFT_HEAD_FORMAT): its head is ~40 % of a small draft's bytes per token, and a draft's
    rounding changes what it proposes, never what is accepted."""
    weight = model.head_weight
    fmt = head_format(layer_fmt, weight.device)
    if fmt == "none" or isinstance(model._modules.get("lm_head"), QuantLinear):
        return
    if draft and layer_fmt == "int4":
        fmt = DRAFT_HEAD_FORMAT
    head = QuantLinear(weight.shape[1], weight.shape[0], False, fmt, weight.dtype)
    head.set_parts(*quantize_weight(weight.detach(), fmt, weight.dtype), None)
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
    exact = row_exact and head_format(fmt, model.embed_tokens.weight.device) == "int8"
    model.run_as(replace(model.execution, row_exact=exact))
    for block in model.layers:
        block.run_as(block.fast, exact)
