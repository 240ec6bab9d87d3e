"""A forest pass: one forward of a model over the new rows of several requests at once, each request with its
own KV cache, positions and mask (a tree to verify, a prefill chunk, a draft frontier).

Per decoder layer the row-wise parts (norms, q/k/v and o projections, the feed-forward) run once over every
request's rows concatenated; attention runs per request, over that request's own cache and with its own plan
(the committed prefix plus its own tree's ancestors: specexec/network/attention.py), so no row ever sees
another request's keys. The layers come from `model.layer_modules()` once per pass: a streamed target reads
each offloaded layer ONCE for all the requests, which is the point (a streamed pass costs about the same for one
row as for a thousand).

What a request gets is what its own forward would give: the same attention plan, the same RoPE tables and the
same per-row arithmetic, up to the float rounding a matrix product may have at another row count (as a tree pass
has against one-token decode). A row-exact model (the CPU integer kernels, whose solo passes run each layer as
one compiled call) runs each arriving layer once per request instead, as that request's own forward would: the
very bits of its solo pass, the layer still read once for all of them.

Does not know: trees, acceptance, who the requests are or when to run (seats.py gathers the calls), sampling.
Families it cannot batch (`why_not`) run their requests' passes one after another instead (seats.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specexec.kv.cache import KVCache
from specexec.network.attention import TreeMask
from specexec.network.mixers import has_tree_plans, mixer_kind
from specexec.network.model import Transformer


@dataclass(frozen=True)
class Call:
    """One request's forward, as Transformer.forward takes it: tokens, positions [1, T]; mask (a TreeMask, a
    dense bool [1, 1, T, S], or None: causal); its own cache; slots [T] where its rows go (None: after the
    cache's committed rows)."""

    tokens: Tensor
    positions: Tensor
    mask: TreeMask | Tensor | None
    cache: KVCache | None
    slots: Tensor | None = None

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> Call | None:
        """The call a model was called with (forward's signature), or None when a forest pass cannot take it
        (another batch size, no cache, a cache whose rows stream with the layers, extra inputs such as a
        drafter's states)."""
        names = ("tokens", "positions", "mask", "cache", "slots")
        if len(args) > len(names) or set(kwargs) - set(names[len(args):]):
            return None
        bound = dict(zip(names, args)) | kwargs
        if "tokens" not in bound or "positions" not in bound:
            return None
        call = cls(bound["tokens"], bound["positions"], bound.get("mask"), bound.get("cache"), bound.get("slots"))
        if call.tokens.shape[0] != 1 or call.cache is None or call.cache.streams:
            return None
        return call


def why_not(model: object) -> str | None:
    """None when forest_forward batches this model's passes; else why not, in a few words that follow "it has"."""
    if not isinstance(model, Transformer) or (type(model).forward is not Transformer.forward
                                              and not hasattr(model, "begin_pass")):
        return f"no plain decoder stack (a {type(model).__name__})"
    a = model.args
    if a.moe is not None:
        return "a mixture of experts (its routing is learned per request)"
    if has_tree_plans(a) or any(mixer_kind(a, i).name != "attention" for i in range(a.n_layers)):
        return "layers that are not plain attention (a recurrent state, latent attention)"
    if a.ple_dim or a.kv_shared_layers:
        return "per-layer inputs or shared K/V layers"
    run = model.execution
    if run.taps or run.routing is not None:
        return "a drafter reads its layers"
    if getattr(model, "kv_streamed", ()):
        return "its KV rows stream with its layers"
    return None


def forest_forward(model: Transformer, calls: list[Call]) -> list[Tensor]:
    """Every call's forward in one pass of the model's layers -> each call's hidden [1, T_i, D] after the final
    norm, as model(tokens, positions, mask, cache, slots) returns it (the caches not advanced: the caller
    commits). The model must be batchable (why_not(model) is None) and every call a Call.of."""
    tokens = torch.cat([c.tokens for c in calls], dim=1)
    x = model.embed(tokens)                                               # [1, N, D]
    ends = torch.tensor([c.tokens.shape[1] for c in calls]).cumsum(0).tolist()
    spans = list(zip([0] + ends[:-1], ends))
    kinds = model.args.layer_kinds
    per_call = []
    for c in calls:
        c.cache.begin_forward()
        slots = c.slots if c.slots is not None else torch.arange(
            c.cache.length, c.cache.length + c.tokens.shape[1], device=x.device)
        long = model.long_rope(c.positions, c.cache)
        ropes = {rope: model.rope(c.positions, x.dtype, "long" if long and rope == "global" else rope)
                 for rope in {k.rope for k in kinds}}
        per_call.append((ropes, model.attention_plans(c.mask, c.positions, x.dtype), slots))
    begin = getattr(model, "begin_pass", None)
    if begin is not None:
        begin(None)                             # an offloaded target: no cache's rows travel with the layers
    if model.execution.row_exact:
        return _per_request(model, [x[:, s:e] for s, e in spans], calls, per_call)
    for i, layer in model.layer_modules():
        kind = kinds[i]
        mixer = layer.mixer
        q, k, v, gate = mixer.project(layer.input_layernorm(x))
        outs = []
        for c, (s, e), (ropes, plans, slots) in zip(calls, spans, per_call):
            outs.append(mixer.attention_rows(q[:, s:e], k[:, s:e] if k is not None else None,
                                             v[:, s:e] if v is not None else None, *ropes[kind.rope],
                                             plans[kind.window], c.cache, i, slots))
        x = layer.after_mixer(x, mixer.output(torch.cat(outs, dim=1), gate), i)
    hidden = model.norm(x)
    return [hidden[:, s:e] for s, e in spans]


def _per_request(model: Transformer, xs: list[Tensor], calls: list[Call], per_call: list) -> list[Tensor]:
    """A row-exact model's forest pass: each layer arrives once (streamed once) and runs each request's rows as
    that request's own forward runs them (its compiled layer where it takes the pass, else the modules), so
    every request gets the very bits of its solo pass; what the pass shares is the layer's arrival."""
    kinds = model.args.layer_kinds
    for i, layer in model.layer_modules():
        kind = kinds[i]
        for r, (c, (ropes, plans, slots)) in enumerate(zip(calls, per_call)):
            xs[r] = layer(xs[r], *ropes[kind.rope], plans[kind.window], c.cache, i, slots)
    return [model.norm(x) for x in xs]
