"""What a run needs, line by line, from config.json alone: the planner's Needs (offload.memory_plan) of a
run's shape with the target's layers in one format, i.e. the lines of the memory ledger, each sized by
sizes.py for the shapes, formats, tree budget and context of the run; and how many tokens one streamed
prefill pass can take.

Ledger lines (device side: the GPU on CUDA, RAM on CPU):
- target embed / target norm/head: the target's resident embedding table, final norm and LM head. The
  embedding table of a STREAMED, untied target may instead live in host RAM (line "target embed (host RAM)"):
  its rows for the T tokens of a pass are gathered on the CPU and copied over (exact: a gather), and the
  GPU memory it frees keeps more layers resident. The plan keeps it where the predicted pass is faster.
- draft weights: the resident draft with its linears in --draft-quant's format, counted ONCE from its config.
  A self-draft (--draft self: the target's own layers, `with_self_draft`) counts only its copies of the layers
  it runs that the target streams (of an MoE layer: its dense part and H hot experts, hot_copy_sizes.py); its
  embed/norm/head and the resident layers it runs are the target's. The
  plan keeps the draft's layers resident first (a resident layer needs no copy), and --draft-layers auto
  picks the most layers that fit.
- target recurrent state (hybrids): the linear-attention layers' states per sequence and their scratch per tree
  node at the budget (kv/recurrent.py); they stay on the device, so the KV lines below count the attention
  layers only.
- target KV cache / draft KV cache: each sized for its own user (kv.cache.kv_slots_for): the target for the
  context plus one tree and its root; the draft for the context plus its builder's scratch slots. The
  target's cache is per layer (the planner's "companions", offload/planner.py): on the device, or, for a
  streamed layer when the device runs short, in (pinned) RAM travelling with the layer ("target KV cache
  (streamed)", its bytes in the pass time) through "target KV cache stages" (one per slot, plus the tree rows
  each such layer keeps on the device until they are committed). When nothing fits with the draft's cache in
  the run dtype, the draft's cache is planned in int8 (exact: the draft only proposes). --kv-quant int8
  sizes both caches in int8 (LOSSY) and adds one layer's dequantized K/V to the activations.
- activations: the largest transient of any pass that runs (each mixer kind's pass: network/mixers.pass_bytes):
  the target's tree pass, a streamed prefill chunk of ledger.PREFILL_RESERVE tokens (dropped when it does not fit),
  the draft's widest pass and its prefill; one chunk of fp32 logits and one dequantized weight included.
- draft graphs (CUDA, a draft model whose passes are captured: builders/draft_graphs.py): the captures' one side
  stream's cuBLAS workspace (CUBLAS_WORKSPACE, sm90's size) and the graphs' memory pool, which holds the
  transients of the widest captured pass apart from the eager allocator's (one draft pass of its rows).
- relaxed neighbours (--accept relaxed only): each token's k nearest tokens by input-embedding cosine, int32
  [V, k], plus a filled flag per token (specexec/acceptance/relaxed.py Neighbours.table_bytes).
- resident target layers, streaming slots; host side: RAM tier layers, SSD bounce buffers; disk: SSD tier.

Does not know: budgets, tiers or which plan is best (ledger.py and offload/planner.py decide), checkpoints.
"""
from __future__ import annotations

import torch

from offload.memory_plan import GB, Needs
from specexec.acceptance.relaxed import Neighbours

from specexec.config import PREFILL_CHUNK
from specexec.kv.recurrent import STATE_COPIES, ring_rows
from specexec.network.mixers import cache_bytes, fixed_layers, mixer_kind, pinned_rows
from specexec.network.model import LOGIT_CHUNK, one_graph
from specexec.planning.experts import expert_parts
from specexec.planning.hot_copy_sizes import copy_bytes, hot_json
from specexec.planning.run_shape import RunShape, self_layer_ids
from specexec.planning.sizes import forward_bytes, kv_bytes, kv_layer_bytes, layer_sizes, weight_bytes

DRAFT_ROWS = 256              # widest draft pass budgeted (builders/growth.py MAX_PASS_ROWS: its passes are no wider)
CUBLAS_WORKSPACE = 32 * 2**20  # a CUDA stream's cuBLAS workspace on sm90 (CUBLAS_WORKSPACE_CONFIG :4096:8)


def activation_lines(shape: RunShape, fmt: str, prefill: int) -> tuple[int, str]:
    """(bytes, what they are for) of the activations line: the largest of the passes that run."""
    t_slots, d_slots = shape.slots
    dev, elem = shape.device, shape.elem
    tq, dq = shape.kv_quant, shape.draft_quant_kv
    passes = {f"tree {shape.budget + 1}": forward_bytes(shape.target, shape.budget + 1, t_slots, elem, fmt, dev,
                                                        LOGIT_CHUNK, tq)}
    if prefill:
        passes[f"prefill {prefill}"] = forward_bytes(shape.target, prefill, t_slots, elem, fmt, dev, 0, tq, False)
    if shape.draft is not None:
        rows = min(shape.budget + 1, DRAFT_ROWS)
        growth = (shape.draft_scratch or 0) ** 2                        # the builder's ancestor matrix (bool)
        passes[f"draft {rows} rows"] = forward_bytes(shape.draft, rows, d_slots or shape.context, elem,
                                                     shape.draft_fmt, dev, rows, dq) + growth
        chunk = min(PREFILL_CHUNK, shape.context)
        passes[f"draft prefill {chunk}"] = forward_bytes(shape.draft, chunk, d_slots or shape.context, elem,
                                                         shape.draft_fmt, dev, 0, dq, False)
    top = max(passes, key=passes.get)
    return passes[top], f"largest: {top} tokens (" + ", ".join(f"{k} {gb_text(v)}" for k, v in passes.items()) + ")"


def needs_for(shape: RunShape, fmt: str, embed_on_host: bool = False, prefill: int = 0,
              shared: frozenset[int] = frozenset()) -> Needs:
    """The planner's Needs of this run with target layers in `fmt`: every fixed line named (see the module
    docstring), the embedding table on the host side when embed_on_host (CUDA) and activations that also
    cover a streamed prefill of `prefill` tokens. A self-draft's weights are copies of the layers it runs
    except `shared` (layers the plan keeps resident: the draft uses the target's own)."""
    t, elem = shape.target, shape.elem
    tw = weight_bytes(t, fmt, shape.dtype, shape.device)
    t_slots, d_slots = shape.slots
    act, act_note = activation_lines(shape, fmt, prefill)
    device: list[tuple[str, int]] = []
    host: list[tuple[str, int]] = []
    lossy = ", int8: LOSSY" if shape.kv_quant == "int8" else ""
    notes = {"activations": act_note, "target KV cache": f"{t_slots} slots ({shape.context} context + "
             f"{shape.budget + 1} tree{lossy})", "target norm/head": "tied: the embedding is the head"
             if t.tie_word_embeddings else "",
             "target KV cache stages": "one per streaming slot, and the tree rows of streamed layers",
             "target KV cache (streamed)": "pinned: committed rows travel with their layer"
             if shape.device == "cuda" else "committed rows travel with their layer"}
    if embed_on_host:
        (host if shape.device == "cuda" else device).append(("target embed (host RAM)", tw["embed"]))
        notes["target embed (host RAM)"] = "rows gathered on the CPU for each pass"
    else:
        device.append(("target embed", tw["embed"]))
    device.append(("target norm/head", tw["head"] + tw["norm"]))
    if tw["per_layer"]:
        device.append(("target per-layer inputs", tw["per_layer"]))
        notes["target per-layer inputs"] = "the per-layer embedding table and its projection"
    if shape.draft is not None:
        draft_bytes, notes["draft weights"] = draft_weights(shape, shared)
        device.append(("draft weights", draft_bytes))
        own = shape.drafter is None or shape.drafter.own_kv
        device.append(("draft KV cache", kv_bytes(shape.draft, d_slots, elem, shape.draft_quant_kv,
                                                  nodes=shape.draft_scratch or 0) if own else 0))
        notes["draft KV cache"] = ("none: it attends to the target's K/V" if not own else
                                   (f"{d_slots} slots" + _draft_kv_note(shape)) if d_slots else
                                   "none: the builder drafts without it")
    if shape.drafter is not None:
        device.append(("drafter states", drafter_states(shape)))
        notes["drafter states"] = (f"{shape.drafter.taps} tapped target layers x {shape.budget + 1} tree rows a pass, "
                                   f"and its own state per tree node" if shape.drafter.taps else
                                   "its own state per tree node (it reads the target's output)")
    device.append(("activations", act))
    if shape.device == "cuda" and shape.draft is not None and one_graph(shape.draft):
        rows = min(shape.budget + 1, DRAFT_ROWS)
        device.append(("draft graphs", CUBLAS_WORKSPACE + forward_bytes(shape.draft, rows, d_slots or shape.context,
                                                                          elem, shape.draft_fmt, "cuda", 0,
                                                                          shape.draft_quant_kv)))
        notes["draft graphs"] = f"the captures' side stream's cuBLAS workspace and the graph pool ({rows} rows)"
    if shape.neighbours_k:
        device.append(("relaxed neighbours", Neighbours.table_bytes(t.vocab_size, shape.neighbours_k)))
        notes["relaxed neighbours"] = f"--accept relaxed: {shape.neighbours_k} per token, {t.vocab_size} tokens"
    sizes = layer_sizes(t, fmt, shape.dtype, shape.device)
    fixed = fixed_layers(t)                  # their cache stays on the device: a line of its own, no companion
    if fixed:
        device.append(("target recurrent state", recurrent_state_bytes(shape)))
        notes["target recurrent state"] = recurrent_note(shape)
    pinned = pinned_rows(t)                  # rows that never travel with their layer: counted on the device
    stays = set(fixed) | pinned
    kv = tuple(0 if i in stays else kv_layer_bytes(t, t_slots, elem, shape.kv_quant, i) for i in range(t.n_layers))
    tail = tuple(0 if i in stays else kv_layer_bytes(t, shape.budget + 1, elem, shape.kv_quant, i)
                 for i in range(t.n_layers))
    if pinned:
        device.append(("target KV cache (kept)", sum(kv_layer_bytes(t, t_slots, elem, shape.kv_quant, i)
                                                     for i in pinned)))
        notes["target KV cache (kept)"] = "rows of other layers' shape or read by later layers stay on the device"
    return Needs(sizes, tuple(device), host_fixed=tuple(host), notes=tuple(notes.items()),
                 companion_bytes=kv, companion_residue=tail,
                 companion_name="target KV cache", companions=shape.kv_offload, parts=expert_parts(shape, fmt))


def recurrent_state_bytes(shape: RunShape) -> int:
    """The target's linear-attention layers' cache at its peak: each layer's states for the sequence and its
    scratch for a tree of the budget and its root (network/mixers.cache_bytes of the fixed layers)."""
    t = shape.target
    return cache_bytes(t, shape.slots[0], shape.elem, shape.kv_quant, fixed_layers(t), nodes=shape.budget + 1)


def recurrent_node_bytes(shape: RunShape) -> int:
    """What one tree node adds to the target's recurrent state, over all its linear-attention layers."""
    t = shape.target
    return sum(mixer_kind(t, i).node_bytes(t, i, shape.elem) for i in fixed_layers(t))


def recurrent_note(shape: RunShape) -> str:
    t, fixed = shape.target, fixed_layers(shape.target)
    per_seq = cache_bytes(t, 0, shape.elem, shape.kv_quant, fixed) - recurrent_node_bytes(shape) * ring_rows(0)
    return (f"{len(fixed)} linear-attention layers: {gb_text(per_seq)} per sequence (states at most "
            f"{STATE_COPIES}x), {gb_text(recurrent_node_bytes(shape))} per tree node x {ring_rows(shape.budget + 1)}; "
            f"K/V rows for the {t.n_layers - len(fixed)} attention layers only")


def _draft_kv_note(shape: RunShape) -> str:
    if shape.draft_quant_kv != "int8":
        return ""
    if shape.kv_quant == "int8":
        return ", int8 (--kv-quant)"
    return ", int8: the draft's own cache, to fit (the target verifies: output unchanged)"


def drafter_states(shape: RunShape) -> int:
    """Bytes a drafter's states take: the tapped target layers' inputs at every row of one verification pass
    (kept until the accepted rows are read), and its own output state per processed tree node."""
    d = shape.drafter
    scratch = (shape.draft_scratch or 0) + 1
    return (d.taps * (shape.budget + 1) * shape.target.dim + scratch * shape.draft.dim) * shape.elem


def draft_weights(shape: RunShape, shared: frozenset[int] = frozenset()) -> tuple[int, str]:
    """(bytes, note) of the draft weights line: a model draft counted once in its format; a self-draft only
    its copies of the layers it runs that are not `shared` (resident in the target): embed/norm/head and
    shared layers are the target's, counted on their own lines; a drafter what it holds itself, in the run
    dtype."""
    if shape.drafter is not None:
        d = shape.drafter
        experts = f", all {d.experts} experts" if d.experts else ""
        return d.params * shape.elem, (f"{d.kind}: {shape.draft.n_layers} decoder layer(s){experts} {dtype_name(shape.dtype)}; what it "
                                       f"shares with the target is on the target's lines")
    sd = shape.self_draft
    if sd is None:
        dw = weight_bytes(shape.draft, shape.draft_fmt, shape.dtype, shape.device)
        return sum(dw.values()), (f"{shape.draft.n_layers} layers {fmt_name(shape.draft_fmt)}, embed/head "
                                  f"{dtype_name(shape.dtype)}")
    ids = self_layer_ids(shape)
    copies = [i for i in ids if i not in shared]
    n = shape.target.n_layers
    hot = hot_json(shape.target, sd.fmt, shape.dtype, shape.device, copies)
    hot_note = (f" ({hot['hot_layers']} MoE, {hot['hot_experts_per_layer']} hot experts each)"
                if hot["hot_layers"] else "")
    note = (f"self: {len(ids)} of {n} target layers{' (auto)' if sd.auto else ''}, {len(ids) - len(copies)} "
            f"shared, {len(copies)} {fmt_name(sd.fmt)} copies{hot_note}; embed/norm/head shared")
    return sum(copy_bytes(shape.target, sd.fmt, shape.dtype, shape.device, i) for i in copies), note


def prefill_tokens(shape: RunShape, fmt: str, room: int) -> int:
    """The most tokens (<= context) one prefill pass of the target can take within `room` bytes of
    activation memory (the activations line plus what the plan left over)."""
    t_slots = shape.slots[0]

    def fits(c: int) -> bool:
        return forward_bytes(shape.target, c, t_slots, shape.elem, fmt, shape.device, 0, shape.kv_quant,
                             False) <= room

    lo, hi = 1, shape.context
    if fits(hi):
        return hi
    while lo < hi:                                 # largest c with fits(c); fits(1) assumed (the tree fits)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def gb_text(n: float) -> str:
    return f"{n / GB:.2f} GB" if abs(n) >= 0.01 * GB else f"{n / 1e6:.1f} MB"


def fmt_name(fmt: str) -> str:
    return "unquantized" if fmt == "none" else fmt


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
