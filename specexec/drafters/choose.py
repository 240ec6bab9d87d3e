"""Which drafter a --draft value names (its DraftSpec, drafters/registry.py), checked against the target before
any weight loads (the headers read once: the choice carries its Layout), what the ledger counts of it, and
loading it after the target (it may share the target's embedding and LM head, so the target comes first).

Does not know: what the drafters compute (specexec/network/drafter.py), each layout's names (eagle3.py, ...),
which kinds there are (the registry's rows), how the memory plan counts it (its DrafterSize says what it holds).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from specexec.config import ModelArgs
from specexec.drafters.load import Layout, drafter_params
from specexec.drafters.registry import DraftSpec, DrafterKind, kind_named
from specexec.network.drafter import Drafter, DrafterShape
from specexec.network.model import Transformer
from specexec.planning.run_shape import DrafterSize


@dataclass(frozen=True, eq=False)
class DrafterChoice:
    """A drafter named and checked: its kind and its Layout (its checkpoint, its decoder layer's args, its shape,
    the meta-built network and, when the headers were read, where each tensor is stored)."""

    kind: str
    layout: Layout

    @property
    def row(self) -> DrafterKind:
        found = kind_named(self.kind)
        assert found is not None, self.kind
        return found

    @property
    def path(self) -> Path:
        return self.layout.path

    @property
    def args(self) -> ModelArgs:
        return self.layout.args

    @property
    def shape(self) -> DrafterShape:
        return self.layout.shape

    @property
    def params(self) -> int:
        """The parameters it holds itself (not those it shares with the target)."""
        return self.layout.params()

    def describe(self) -> str:
        return f"{self.kind} {self.path}" + (f" (reads target layers {list(self.shape.taps)})" if self.shape.taps
                                             else "")

    def size(self) -> DrafterSize:
        """What the memory ledger counts of it (planning/run_shape.DrafterSize)."""
        moe = self.args.moe
        return DrafterSize(self.kind, self.params, len(self.shape.taps),
                           moe.n_experts if moe is not None and moe.sparse(0) else 0, self.row.own_kv)

    def plan_args(self, target: ModelArgs) -> ModelArgs:
        """Its decoder layer's args for the plan, with the target's context (its RoPE is relative)."""
        return replace(self.args, max_position_embeddings=target.max_position_embeddings)


def choose(spec: DraftSpec | None, t_path: Path, t_args: ModelArgs, allow_pickle: bool = False,
           headers: bool = True) -> DrafterChoice | None:
    """The drafter `spec` names (None: not a drafter), its config and (with `headers`) its stored tensors' names
    and shapes checked against the target: ConfigError, one line, for any mismatch. No weight is read. Without
    headers (`specexec plan`, from config.json alone) each kind says what it is from its config (its `planned`)."""
    kind = spec.drafter if spec is not None else None
    if kind is None:
        return None
    layout = (kind.checked(spec.where, t_path, t_args, allow_pickle) if headers else
              kind.planned(spec.where, t_path, t_args))
    return DrafterChoice(kind.name, layout)


def load_drafter(choice: DrafterChoice, target: Transformer, dtype: torch.dtype, device: torch.device
                 ) -> tuple[Drafter, int]:
    """The chosen drafter loaded for `target` from the layout its choice checked, and the parameters it holds
    itself (not the shared ones)."""
    drafter = choice.row.load(choice.layout, target, dtype, device)
    shared = tuple(n for n in ("embed_tokens", "lm_head") if drafter._modules.get(n) is target._modules.get(n))
    return drafter, drafter_params(drafter, shared)
