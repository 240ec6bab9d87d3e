"""Loading a drafter's weights: each layout module names, for every parameter of the Drafter it describes, the
stored tensor it comes from; here the names and shapes are checked against the stored headers (before anything
is read), then the tensors are read, cast and bound, and what the drafter shares is taken from the target.

Does not know: any one layout (eagle3.py and mtp.py say which tensor is which), trees, the engine.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import torch

from offload.formats.refs import TensorRef, read_ref, ref_shape
from offload.formats.sources import tensor_specs
from specexec.checkpoints.loading import open_weights
from specexec.network.drafter import Drafter
from specexec.network.model import Transformer
from specexec.options import ConfigError

INDEX_BUFFERS = ("d2t", "token_ordering")       # integer buffers read as stored (long), never cast to the run dtype


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


def load_weights(drafter: Drafter, path: Path, refs: Mapping[str, TensorRef], target: Transformer,
                 dtype: torch.dtype, device: torch.device, share_embed: bool, share_head: bool,
                 allow_pickle: bool = False, source=None) -> Drafter:
    """Read the stored tensors `refs` (ours -> stored) into the meta-built `drafter` (cast to dtype on device;
    index buffers as long), share the target's embedding / LM head as told, set RoPE. Returns it in eval mode."""
    source = source if source is not None else open_weights(path, allow_pickle)
    shared = (("embed_tokens",) if share_embed else ()) + (("lm_head",) if share_head else ())
    shapes = expected(drafter, shared)
    check_layout(path, tensor_specs(source), refs, shapes)
    state = {}
    for ours in shapes:
        t = read_ref(source, refs[ours])
        state[ours] = t.to(device=device, dtype=torch.long if ours in INDEX_BUFFERS else dtype)
    drafter.load_state_dict(state, strict=False, assign=True)
    drafter.share(target, embed=share_embed, head=share_head)
    drafter.init_rope(device)
    left = [n for n, p in drafter.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"drafter parameters left unloaded: {left[:3]}")
    return drafter.eval().requires_grad_(False)


def drafter_params(drafter: Drafter, shared: tuple[str, ...] = ()) -> int:
    """Parameters the drafter holds itself (not those it shares with the target)."""
    return sum(math.prod(s) for n, s in expected(drafter, shared).items() if n not in INDEX_BUFFERS)
