"""Loading a drafter's weights: each layout module names, for every parameter of the Drafter it describes, the
stored tensor it comes from; here the names and shapes are checked against the stored headers (before anything
is read: a Layout, made once when --draft is chosen), then the tensors are read, cast and bound, and what the
drafter shares is taken from the target.

Does not know: any one layout (eagle3.py and mtp.py say which tensor is which), trees, the engine.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from offload.formats.refs import TensorRef, aligned, read_ref, ref_shape
from specexec.config import ModelArgs
from specexec.network.drafter import Drafter, DrafterShape
from specexec.network.model import Transformer
from specexec.options import ConfigError

INDEX_BUFFERS = ("d2t", "token_ordering")       # integer buffers read as stored (long), never cast to the run dtype


@dataclass(frozen=True, eq=False)
class Layout:
    """A drafter as its checkpoint holds it: its checkpoint, its decoder's args and shape, the meta-built network,
    the modules it takes from the target (`shared`: "embed_tokens", "lm_head"), and, once checked against the
    stored headers (read once), our name -> stored tensor (`refs`) and the open source; both None for a layout
    made from config.json alone (a plan), which cannot load."""

    path: Path
    args: ModelArgs
    shape: DrafterShape
    drafter: Drafter
    shared: tuple[str, ...] = ()
    refs: Mapping[str, TensorRef] | None = None
    source: Any = None

    def params(self) -> int:
        """Parameters the drafter holds itself (not those it shares with the target)."""
        return drafter_params(self.drafter, self.shared)


def expected(drafter: Drafter, shared: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    """Our parameter/buffer name -> shape of a meta-built drafter, without the modules it takes from the target
    (`shared`: attribute prefixes such as "embed_tokens") and without the RoPE tables."""
    names = {**dict(drafter.named_parameters()), **{n: b for n, b in drafter.named_buffers() if n in INDEX_BUFFERS}}
    return {n: tuple(t.shape) for n, t in names.items() if not n.startswith(shared)}


def check_layout(path: Path, specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
                 refs: Mapping[str, TensorRef], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """ConfigError (one line, naming the stored tensor) unless every expected parameter has its stored tensor
    (refs: ours -> the stored tensor or a piece of it) with the expected shape."""
    for ours, shape in shapes.items():
        ref = refs.get(ours)
        if ref is None or ref.name not in specs:
            raise ConfigError(f"{path}: missing tensor {ref.name if ref else ours!r} of the drafter's {ours}")
        try:
            got = ref_shape(ref, tuple(specs[ref.name][1]))
        except ValueError as e:
            raise ConfigError(f"{path}: {e}") from None
        if tuple(got) != tuple(shape):
            raise ConfigError(f"{path}: {ref.describe()} has shape {list(got)}, the drafter's config implies "
                              f"{list(shape)}")


def check_d2t(path: Path, d2t: torch.Tensor | None, vocab: int) -> None:
    """ConfigError unless every draft id i maps to a target id i + d2t[i] in [0, vocab) (an EAGLE-3 head's
    draft-to-target offsets; a head for another vocabulary would index past the target's logits)."""
    if d2t is None or not d2t.numel():
        return
    ids = torch.arange(d2t.numel(), device=d2t.device) + d2t
    bad = ((ids < 0) | (ids >= vocab)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ConfigError(f"{path}: d2t maps draft token {i} to target token {int(ids[i])} (d2t[{i}] = "
                          f"{int(d2t[i])}), outside the target's vocabulary of {vocab} ({bad.numel()} of "
                          f"{d2t.numel()} entries out of range); use a head trained for this target")


def load_layout(layout: Layout, target: Transformer, dtype: torch.dtype, device: torch.device) -> Drafter:
    """Read a checked layout's stored tensors into a copy of its meta-built drafter (cast to dtype on device;
    index buffers as long), share the target's embedding / LM head as the layout says, set RoPE. Returns it in
    eval mode. The names and shapes were checked when the layout was made: nothing is checked twice."""
    if layout.refs is None:
        raise RuntimeError(f"{layout.path}: a drafter's layout made from config.json alone cannot load")
    drafter = copy.deepcopy(layout.drafter)
    state = {}
    for ours in expected(drafter, layout.shared):
        t = read_ref(layout.source, layout.refs[ours])
        state[ours] = aligned(t.to(device=device, dtype=torch.long if ours in INDEX_BUFFERS else dtype))
    check_d2t(layout.path, state.get("d2t"), target.args.vocab_size)
    drafter.load_state_dict(state, strict=False, assign=True)
    drafter.share(target, embed="embed_tokens" in layout.shared, head="lm_head" in layout.shared)
    drafter.init_rope(device)
    left = [n for n, p in drafter.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"drafter parameters left unloaded: {left[:3]}")
    return drafter.eval().requires_grad_(False)


def checked_layout(path: Path, args: ModelArgs, shape: DrafterShape, drafter: Drafter, shared: tuple[str, ...],
                   refs: Mapping[str, TensorRef], source: Any,
                   specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> Layout:
    """The Layout once its every expected tensor is found in `source`'s headers (`specs`, read once by the
    kind's check) with its shape (check_layout)."""
    check_layout(path, specs, refs, expected(drafter, shared))
    return Layout(path, args, shape, drafter, shared, refs, source)


def drafter_params(drafter: Drafter, shared: tuple[str, ...] = ()) -> int:
    """Parameters the drafter holds itself (not those it shares with the target)."""
    return sum(math.prod(s) for n, s in expected(drafter, shared).items() if n not in INDEX_BUFFERS)
