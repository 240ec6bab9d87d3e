"""Which drafter a --draft value names, checked against the target before any weight loads, and loading it
after the target (it may share the target's embedding and LM head, so the target comes first).

Does not know: what the drafters compute (specexec/network/drafter.py), each layout's names (eagle3.py, ...),
the memory plan.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specexec.checkpoints.loading import resolve_model_path
from specexec.config import ModelArgs
from specexec.drafters import eagle3
from specexec.drafters.load import drafter_params
from specexec.network.drafter import Drafter, DrafterShape
from specexec.network.model import Transformer
from specexec.options import ConfigError, drafter_spec


@dataclass(frozen=True)
class DrafterChoice:
    """A drafter named and checked: its kind, its checkpoint, its decoder layer's args and its shape."""

    kind: str
    path: Path
    args: ModelArgs
    shape: DrafterShape

    def describe(self) -> str:
        return f"{self.kind} {self.path}" + (f" (reads target layers {list(self.shape.taps)})" if self.shape.taps
                                             else "")


def choose(spec: str, t_path: Path, t_args: ModelArgs, allow_pickle: bool = False) -> DrafterChoice | None:
    """The drafter `spec` names (None: not a drafter), its config and stored headers checked against the target
    (ConfigError, one line, for any mismatch); no weight is read."""
    parsed = drafter_spec(spec)
    if parsed is None:
        return None
    kind, where = parsed
    if kind == eagle3.KIND:
        path = resolve_model_path(where)
        args, shape = eagle3.shape_of(eagle3.read_config(path), t_args, path)
        eagle3.layout(path, args, shape, allow_pickle)
        return DrafterChoice(kind, path, args, shape)
    raise ConfigError(f"--draft {spec}: {t_path} has no drafter of kind {kind!r} this runtime reads")


def load_drafter(choice: DrafterChoice, target: Transformer, dtype: torch.dtype, device: torch.device,
                 allow_pickle: bool = False) -> tuple[Drafter, int]:
    """The chosen drafter loaded for `target` and the parameters it holds itself (not the shared ones)."""
    drafter = eagle3.load_eagle3(choice.path, choice.args, choice.shape, target, dtype, device, allow_pickle)
    shared = tuple(n for n in ("embed_tokens", "lm_head") if drafter._modules.get(n) is target._modules.get(n))
    return drafter, drafter_params(drafter, shared)
