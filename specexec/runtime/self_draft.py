"""The self-draft: the target's own network drafting for it (`--draft self[:FORMAT]`, `--draft-layers N|auto`).

No second model to find, and a draft that agrees with the target far more often than a small model: it is the
same network. Layer skipping as in self-speculative decoding (Zhang et al. 2023, "Draft & Verify": the draft
runs a subset of the target's layers) and a resident low-bit copy of the layers the target streams (SubSpec,
Wang et al. 2025): on a machine where the target streams, those are the layers that never stay.

`SelfDraft` is a Transformer like any draft (forward, logits, args), so builders and verifiers never know:
- it runs `layer_ids` of the target's decoder layers (evenly spaced, the first and the last among them:
  run_shape.spaced_layers), and its ModelArgs say len(layer_ids) layers, so its KV cache is sized for it;
- its token embedding (a HostEmbedding too), final norm and LM head ARE the target's modules;
- a layer the plan keeps resident is the target's own Block (the one every target pass runs, same tensors);
- every other layer it runs is a resident copy in FORMAT (of an MoE target's sparse layer: its dense part and
  H hot experts only, the router masking the rest, re-ranked from the target's routing counts:
  specexec/runtime/hot_experts.py), read from that format's layer cache
  (offload/cache/store.py: one entry per checkpoint, format, dtype and packing - the very entry a target streamed
  in that format uses, so with the device's default format nothing is quantized twice), built on first use
  with per-layer progress through the caller's callback.

Depth: `--draft-layers N` runs exactly N layers. Under auto (the default) the plan's layers (the most whose
copies fit) are only the deepest candidate: `SelfDraft.subset` gives the draft over fewer of them, the very same
Blocks and copies (nothing copied or read again), and specexec/runtime/depth_probe.py keeps the depth whose
measured agreement and cost predict the most tokens/s (specexec/tuning/depth.py, docs/algorithms.md §26).

Also here: `--draft self[:FORMAT]` parsing (`is_self_draft`, `self_draft_shape`).

Does not know: which layers stay resident or how many the draft runs (the plan: specexec/planning/ledger.py; the
measured depth: depth_probe.py), how layers stream (offload.streaming.pager), trees, builders or verification.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from offload.cache.identity import LayerNames
from offload.cache.store import LayerCache
from offload.quant.linear import QuantLinear, bind_module, swap_linears
from offload.quant.weights import FORMATS, auto_format, device_problem
from offload.streaming.storage import LayerLayout, unpack_layer
from offload.streaming.tiers import ResidentTier, fill, host_buffer

from specexec.checkpoints.naming import sparse_layer
from specexec.config import ModelArgs
from specexec.options import SELF_DRAFT, ConfigError
from specexec.planning.run_shape import SelfDraftShape
from specexec.network.model import Block, Transformer, on_meta
from specexec.runtime.hot_experts import HotExperts

SELF = SELF_DRAFT
Say = Callable[[str], None]


def self_draft_format(spec: str, device: torch.device | str) -> str:
    """The copies' format of `--draft self[:FORMAT]`: FORMAT, default quant.auto_format(device) (int4 on a CPU,
    nf4 on CUDA). ConfigError (one line) for an unknown format or one the device cannot run."""
    _, colon, fmt = spec.strip().partition(":")
    fmt = fmt.strip().lower()
    if colon and fmt not in FORMATS:
        raise ConfigError(f"--draft {spec}: {fmt!r} is not a layer format; use self or self:FORMAT with FORMAT "
                          f"one of: {', '.join(FORMATS)}")
    fmt = fmt or auto_format(device)
    problem = device_problem(fmt, device)
    if problem:
        raise ConfigError(f"--draft {spec}: {problem}")
    return fmt


def self_draft_shape(spec: str, layers: int | str | None, device: torch.device | str) -> SelfDraftShape:
    """The ledger's SelfDraftShape of `--draft self[:FORMAT] --draft-layers N|auto` (None/auto: planned)."""
    return SelfDraftShape(self_draft_format(spec, device), None if layers in (None, "auto") else int(layers))


class SelfDraft(Transformer):
    """The target over `layer_ids` of its decoder layers; see the module docstring. `blocks[j]` runs layer
    layer_ids[j] (the target's own Block for the ids in `shared`, a resident copy in `fmt` for the others)."""

    def __init__(self, target: Transformer, layer_ids: Sequence[int], blocks: Sequence[nn.Module], fmt: str,
                 shared: Sequence[int], hot: HotExperts | None = None) -> None:
        if len(blocks) != len(layer_ids):
            raise ValueError(f"{len(blocks)} blocks for {len(layer_ids)} layers")
        args = target.args.subset(layer_ids)
        with on_meta():                              # allocates nothing: every tensor is replaced
            super().__init__(args)
        self.embed_tokens = target.embed_tokens
        self.layers = nn.ModuleList(blocks)
        self.norm = target.norm
        if target._modules.get("lm_head") is not None:         # untied, or a quantized head (quantize_head)
            self.lm_head = target.lm_head
        self.init_rope(target.norm.weight.device, like=target)
        self.layer_ids, self.fmt, self.shared = tuple(layer_ids), fmt, tuple(shared)
        self.hot = hot                                  # the MoE layers' copies (hot experts), if any
        self._target = (target,)                        # in a tuple: out of the module tree (subset's)
        self.train(False)

    def subset(self, layer_ids: Sequence[int]) -> "SelfDraft":
        """This draft over fewer of its layers `layer_ids` (ascending, each one of self.layer_ids): the very
        same Blocks, copies and hot experts, nothing copied or read again (a shallower depth of
        --draft-layers auto: specexec/runtime/depth_probe.py). Its KV cache is its own, sized for its layers."""
        at = {i: j for j, i in enumerate(self.layer_ids)}
        missing = [i for i in layer_ids if i not in at]
        if missing or list(layer_ids) != sorted(set(layer_ids)):
            raise ValueError(f"layers {list(layer_ids)} are not an ascending subset of {list(self.layer_ids)}")
        return SelfDraft(self._target[0], layer_ids, [self.layers[at[i]] for i in layer_ids], self.fmt,
                         [i for i in self.shared if i in at and i in set(layer_ids)], self.hot)

    @property
    def copies(self) -> tuple[int, ...]:
        """The layers held as copies (the target streams them)."""
        return tuple(i for i in self.layer_ids if i not in set(self.shared))

    def describe(self) -> str:
        n = len(self.layer_ids)
        hot = f", {self.hot.per_layer} hot experts per MoE copy" if self.hot is not None else ""
        return f"self: {n} layers, {len(self.shared)} shared, {n - len(self.shared)} {_name(self.fmt)} copies{hot}"

    def observe_routing(self, counts: torch.Tensor, layers: Sequence[int]) -> dict[str, float]:
        """After a target pass: its routing counts [L, E] over its sparse layers `layers` (the hot experts of the
        MoE copies are re-ranked from them every few passes; nothing without such copies). Returns the
        profiler counter of the expert bytes read."""
        return {"moe_draft_expert_bytes": self.hot.observe(counts, layers) if self.hot is not None else 0.0}


def build_self_draft(target: Transformer, layer_ids: Sequence[int], fmt: str, path: Path | None = None,
                     names: Sequence[LayerNames] | None = None, cache_root: str | Path | None = None,
                     say: Say | None = None) -> SelfDraft:
    """The SelfDraft of `target` over `layer_ids`: the target's resident Blocks where it has them
    (OffloadedTransformer.resident_block; every layer of a resident Transformer), copies in `fmt` of the
    others, read from the layer cache of the checkpoint at `path` (`names`: its per-layer tensor naming, as
    the target's cache was built with) under `cache_root`. say(msg): progress lines (the cache build and the
    reads, with a text bar)."""
    say = say or (lambda _msg: None)
    blocks = {i: b for i in layer_ids if (b := _resident(target, i)) is not None}
    shared = sorted(blocks)
    copies = [i for i in layer_ids if i not in blocks]
    hot = None
    if copies:
        if path is None or names is None:
            raise ValueError(f"layers {copies} are streamed by the target: their copies need the checkpoint")
        like = target.norm.weight
        cache = _open_cache(path, names, fmt, like, cache_root, say)
        sparse = [i for i in copies if sparse_layer(target.args, i)]
        whole = [i for i in copies if i not in sparse]
        if whole:
            blocks.update(_copies(target.args, whole, fmt, like, cache, say))
        if sparse:                              # the dense part and H hot experts of each (runtime/hot_experts.py)
            hot = HotExperts(target.args, cache, sparse, fmt, like)      # keeps the cache open: it re-reads
            blocks.update(hot.blocks)
            say(f"self-draft: {_name(fmt)} copies of {len(sparse)} MoE layers, {hot.per_layer} hot experts each")
        else:
            cache.close()
    return SelfDraft(target, layer_ids, [blocks[i] for i in layer_ids], fmt, shared, hot)


def _resident(target: Transformer, i: int) -> nn.Module | None:
    """The target's own Block for layer i when it is resident (None: the target streams it)."""
    get = getattr(target, "resident_block", None)
    return get(i) if get is not None else target.layers[i]


def _open_cache(path: Path, names: Sequence[LayerNames], fmt: str, like: torch.Tensor,
                cache_root: str | Path | None, say: Say) -> LayerCache:
    """The layer cache of `fmt` for like's dtype, opened (built on first use: the whole checkpoint, so any
    --draft-layers later reuses it)."""
    device = like.device
    on_layer = lambda done, total: say(f"self-draft: packing the target's layers {_name(fmt)} (cached) "  # noqa: E731
                                       f"{bar(done, total)} {done}/{total}")
    return LayerCache.open_or_build(path, names, fmt, like.dtype, cache_root=cache_root, progress=False, log=say,
                                    quantize_device=str(device) if device.type == "cuda" else None,
                                    on_layer=on_layer)


def _copies(args: ModelArgs, ids: Sequence[int], fmt: str, like: torch.Tensor, cache: LayerCache,
            say: Say) -> dict[int, Block]:
    """Resident Blocks for layers `ids` in `fmt`, on like's device and in its dtype: the layers read from
    `cache` into one region and bound."""
    device, dtype = like.device, like.dtype
    tier = ResidentTier({i: cache.nbytes(i) for i in ids}, device)
    bounce = host_buffer(max(cache.nbytes(i) for i in ids)) if device.type == "cuda" else None
    out = {}
    for j, i in enumerate(ids, 1):
        fill({i: tier.buffer(i)}, cache, bounce)
        out[i] = copy_block(args, cache.layout(i), tier.buffer(i), fmt, dtype, i)
        say(f"self-draft: {_name(fmt)} copies of the streamed layers {bar(j, len(ids))} {j}/{len(ids)}")
    return out


def copy_block(args: ModelArgs, layout: LayerLayout, buf: torch.Tensor, fmt: str, dtype: torch.dtype,
               layer: int = 0) -> Block:
    """A Block for decoder layer `layer` bound to its packed layer in `buf` (views, no copy). A draft's linears
    may use batch-dependent fused kernels (quant.kernel_for with row_exact=False)."""
    with on_meta():
        block = Block(args, layer)
    swap_linears(block, fmt, dtype)
    for m in block.modules():
        if isinstance(m, QuantLinear):
            m.row_exact = False
    bind_module(block, unpack_layer(buf, layout), layout.meta)
    return block.eval().requires_grad_(False)


def _name(fmt: str) -> str:
    return "unquantized" if fmt == "none" else fmt


def bar(done: int, total: int, width: int = 20) -> str:
    """A text progress bar for a progress line (the terminal renders it; nothing here draws)."""
    filled = width * done // max(total, 1)
    return "█" * filled + "░" * (width - filled)
