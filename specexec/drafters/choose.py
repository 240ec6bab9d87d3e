"""Which drafter a --draft value names, checked against the target before any weight loads, and loading it
after the target (it may share the target's embedding and LM head, so the target comes first).

Does not know: what the drafters compute (specexec/network/drafter.py), each layout's names (eagle3.py, ...),
how the memory plan counts it (its DrafterSize says what it holds).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from specexec.checkpoints.loading import resolve_model_path
from specexec.config import ModelArgs
from specexec.drafters import assistant, eagle3, mtp
from specexec.drafters.load import drafter_params
from specexec.network.drafter import Drafter, DrafterShape, build_drafter
from specexec.planning.run_shape import DrafterSize
from specexec.network.model import Transformer
from specexec.options import ConfigError, drafter_spec


@dataclass(frozen=True)
class DrafterChoice:
    """A drafter named and checked: its kind, its checkpoint, its decoder layer's args, its shape and the
    parameters it holds itself (not those it shares with the target)."""

    kind: str
    path: Path
    args: ModelArgs
    shape: DrafterShape
    params: int

    def describe(self) -> str:
        return f"{self.kind} {self.path}" + (f" (reads target layers {list(self.shape.taps)})" if self.shape.taps
                                             else "")

    def size(self) -> DrafterSize:
        """What the memory ledger counts of it (planning/run_shape.DrafterSize)."""
        moe = self.args.moe
        return DrafterSize(self.kind, self.params, len(self.shape.taps),
                           moe.n_experts if moe is not None and moe.sparse(0) else 0, self.kind != assistant.KIND)

    def plan_args(self, target: ModelArgs) -> ModelArgs:
        """Its decoder layer's args for the plan, with the target's context (its RoPE is relative)."""
        return replace(self.args, max_position_embeddings=target.max_position_embeddings)


def choose(spec: str | None, t_path: Path, t_args: ModelArgs, allow_pickle: bool = False,
           headers: bool = True) -> DrafterChoice | None:
    """The drafter `spec` names (None: not a drafter), its config and (with `headers`) its stored tensors' names
    and shapes checked against the target: ConfigError, one line, for any mismatch. No weight is read. Without
    headers (`specexec plan`, from config.json alone) an MTP layer is taken from what config.json says and an
    EAGLE-3 head is assumed to share the target's embedding."""
    parsed = drafter_spec(spec)
    if parsed is None:
        return _assistant(spec, t_args, allow_pickle, headers)
    kind, where = parsed
    if kind == eagle3.KIND:
        path = resolve_model_path(where)
        args, shape = eagle3.shape_of(eagle3.read_config(path), t_args, path)
        if headers:
            drafter, names, _ = eagle3.layout(path, args, shape, allow_pickle)
            shared = () if "embed_tokens.weight" in names else ("embed_tokens",)
        else:
            drafter, shared = build_drafter(args, shape), ("embed_tokens",)
        return DrafterChoice(kind, path, args, shape, drafter_params(drafter, shared))
    if headers:
        drafter, _, _, args, shape = mtp.layout_checked(t_path, t_args, allow_pickle)
    else:
        if not t_args.mtp_layers:
            raise ConfigError(f"--draft mtp: {t_path} has no MTP layer to draft with (config.json names none: "
                              f"num_nextn_predict_layers); name a draft model, or --draft self")
        args, shape = mtp.layer_args(t_args), DrafterShape(mtp.KIND, t_args.dim)
        drafter = build_drafter(args, shape)
    return DrafterChoice(kind, t_path, args, shape, drafter_params(drafter, ("embed_tokens", "lm_head")))


def _assistant(spec: str | None, t_args: ModelArgs, allow_pickle: bool, headers: bool) -> DrafterChoice | None:
    """A Gemma 4 assistant named as a draft model's directory (its config.json says so), checked; else None."""
    path = Path(spec) if spec else None
    if path is None or not path.is_dir() or not assistant.is_assistant(path):
        return None
    if headers:
        drafter, _, _ = assistant.layout(path, t_args, allow_pickle)
    else:
        drafter = assistant.build_assistant(*assistant.shape_of(path, t_args))
    return DrafterChoice(assistant.KIND, path, drafter.args, drafter.shape, drafter_params(drafter))


def load_drafter(choice: DrafterChoice, target: Transformer, dtype: torch.dtype, device: torch.device,
                 allow_pickle: bool = False) -> tuple[Drafter, int]:
    """The chosen drafter loaded for `target` and the parameters it holds itself (not the shared ones)."""
    if choice.kind == mtp.KIND:
        drafter = mtp.load_mtp(choice.path, target, dtype, device, allow_pickle)
    elif choice.kind == assistant.KIND:
        drafter = assistant.load_assistant(choice.path, target, dtype, device, allow_pickle)
    else:
        drafter = eagle3.load_eagle3(choice.path, choice.args, choice.shape, target, dtype, device, allow_pickle)
    shared = tuple(n for n in ("embed_tokens", "lm_head") if drafter._modules.get(n) is target._modules.get(n))
    return drafter, drafter_params(drafter, shared)
