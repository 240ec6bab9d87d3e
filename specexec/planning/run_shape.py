"""What a run consists of, for the memory ledger: the models' shapes, dtype, device, tree budget, context, the
draft's format and KV needs (RunShape, and run_shape: one from the run's configs), and a self-draft's layers
(SelfDraftShape, spaced_layers).

Does not know: bytes or budgets (sizes.py and ledger.py), how models load (loading.py, self_draft.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from specexec.config import EngineConfig, ModelArgs, OffloadConfig
from specexec.kv.cache import kv_slots_for
from specexec.options import ConfigError

DEFAULT_CONTEXT = 4096        # tokens (prompt + answer) the KV caches are planned for unless --context says
MIN_SELF_LAYERS = 2         # a self-draft runs at least the first and the last decoder layer


@dataclass(frozen=True)
class SelfDraftShape:
    """A draft made of the target itself (--draft self[:FMT] --draft-layers N|auto): the target's architecture
    over `layers` of its decoder layers, evenly spaced (spaced_layers). It shares the target's embedding, final
    norm, LM head and every decoder layer the plan keeps resident; each other layer it runs is a resident copy
    in `fmt`. layers None: not chosen yet (plan_memory picks the most that fit); auto: it was picked so."""

    fmt: str
    layers: int | None = None
    auto: bool = False


@dataclass(frozen=True)
class DrafterSize:
    """A drafter that reads the target (--draft eagle3:PATH, --draft mtp), for the ledger: its kind, the
    parameters it holds itself (its decoder layer, with every expert of a sparse one; its input projection,
    norms, and its own head or embedding where it has them: what it shares with the target is counted on the
    target's lines), and how many target layers' inputs each verification pass keeps for it (0: it reads the
    target's output, which the pass holds anyway). RunShape.draft is then its decoder layer's args."""

    kind: str
    params: int
    taps: int = 0
    experts: int = 0
    own_kv: bool = True          # False: it attends to the target's K/V (Gemma 4's assistant), no cache of its own


@dataclass(frozen=True)
class RunShape:
    """Everything the ledger depends on besides the budgets.

    draft_kv: the builder's kv_slots(budget) (draft-cache scratch per tree), None when no builder drafts with
    the draft model (then the draft, if given, holds no KV cache). self_draft: set when the draft is the target
    itself (with_self_draft); `draft` is then the target's args over the draft's layer count."""

    target: ModelArgs
    draft: ModelArgs | None
    dtype: torch.dtype
    device: str                                   # "cuda" | "cpu"
    budget: int = 64
    context: int = DEFAULT_CONTEXT
    draft_fmt: str = "none"
    draft_kv: Callable[[int], int] | None = None
    kv_quant: str = "none"                        # --kv-quant: both caches (int8: LOSSY)
    draft_kv_quant: str = "none"                  # the draft cache's own (int8 when the plan needs it: exact)
    kv_offload: str = "auto"                      # target KV rows: auto | device | stream (planner companions)
    self_draft: SelfDraftShape | None = None
    drafter: DrafterSize | None = None
    neighbours_k: int = 0                         # --accept relaxed: neighbours per token of its table (0: exact)

    @property
    def elem(self) -> int:
        return self.dtype.itemsize

    @property
    def draft_quant_kv(self) -> str:
        """The draft cache's format: int8 when either the run (--kv-quant) or the plan chose it."""
        return "int8" if "int8" in (self.kv_quant, self.draft_kv_quant) else "none"

    @property
    def draft_scratch(self) -> int | None:
        """Draft-cache slots one tree writes beyond the committed context (None: no draft cache)."""
        return self.draft_kv(self.budget) if self.draft_kv is not None and self.draft is not None else None

    @property
    def slots(self) -> tuple[int, int]:
        """(target, draft) KV slots: kv.cache.kv_slots_for at this context and budget."""
        return kv_slots_for(self.context, self.budget, self.draft_scratch)


def plan_context(requested: int | None, target: ModelArgs, draft: ModelArgs | None = None) -> int:
    """Tokens (prompt + answer) to plan the KV caches for: --context, else DEFAULT_CONTEXT, at most what every
    model supports (max_position_embeddings)."""
    limit = min(m.max_position_embeddings for m in (target, draft) if m is not None)
    return min(requested or DEFAULT_CONTEXT, limit)


def run_shape(args: ModelArgs, draft: ModelArgs | None, engine: EngineConfig, offload: OffloadConfig,
              device_type: str, dtype: torch.dtype, draft_kv: Callable[[int], int] | None = None,
              self_draft: SelfDraftShape | None = None, drafter: DrafterSize | None = None) -> RunShape:
    """The ledger's view of a run: the models, run dtype, tree budget, planned context (--context, default
    DEFAULT_CONTEXT, at most what the models support), the draft's format and KV scratch, and the KV caches'
    format (--kv-quant) and where the target's KV rows may live (--kv-offload). With self_draft (the target
    itself as the draft; `draft` is then None) its format and layer count."""
    context = plan_context(offload.context, args, draft)
    shape = RunShape(args, draft, dtype, device_type, engine.budget, context,
                     offload.draft_quant if draft is not None and drafter is None else "none",
                     draft_kv if draft is not None else None, kv_quant=engine.kv_quant, kv_offload=offload.kv_offload,
                     drafter=drafter, neighbours_k=engine.accept.k if engine.accept.relaxed else 0)
    if self_draft is None:
        return shape
    return with_self_draft(replace(shape, draft_kv=draft_kv), self_draft.fmt, self_draft.layers)


def spaced_layers(n: int, k: int) -> tuple[int, ...]:
    """k of n decoder layers, evenly spaced, ascending, the first and the last among them (k >= 2): layer
    skipping as in self-speculative decoding (Zhang et al. 2023, "Draft & Verify")."""
    if not 1 <= k <= n:
        raise ValueError(f"cannot pick {k} of {n} layers")
    if k == 1:
        return (0,)
    return tuple((2 * j * (n - 1) + k - 1) // (2 * (k - 1)) for j in range(k))     # round half up, exact


def with_self_draft(shape: RunShape, fmt: str, layers: int | None = None, auto: bool = False) -> RunShape:
    """`shape` (its draft_kv: the builder's) with the target itself as the draft over `layers` decoder layers
    in copies of format `fmt` where not shared (None: the most that fit, picked by plan_memory). ConfigError
    for a layer count the target cannot give."""
    if layers is not None:
        check_self_layers(layers, shape.target.n_layers)
    n = shape.target.n_layers
    return replace(shape, draft=shape.target.subset(spaced_layers(n, layers or n)), draft_fmt=fmt,
                   self_draft=SelfDraftShape(fmt, layers, auto))


def check_self_layers(layers: int, n: int) -> None:
    """ConfigError unless a self-draft of a target with n decoder layers can run `layers` of them."""
    low = min(MIN_SELF_LAYERS, n)
    if not low <= layers <= n:
        raise ConfigError(f"--draft-layers {layers}: a self-draft of this target runs {low} to {n} of its {n} "
                          "decoder layers (or auto)")


def self_layer_ids(shape: RunShape) -> tuple[int, ...]:
    """The target layers a self-draft shape runs."""
    return spaced_layers(shape.target.n_layers, shape.draft.n_layers)
