"""What a run's names resolve to before any weight is read (Sources): the target's path and config, and which
draft --draft names: a draft model (path and config), the target itself (--draft self[:FORMAT], its shape) or a
drafter (eagle3:..., mtp: the choice, checked against the target). The flags that apply to one kind of draft
only (--draft-layers, --draft-quant, --draft-vocab) are refused here for the others.

Does not know: tokenizers, the memory plan, how any model loads (specexec/runtime/assembly.py runs the stages,
specexec/runtime/loaders.py loads).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specexec.builders.registry import check_builder
from specexec.checkpoints.loading import read_args, resolve_model_path
from specexec.config import EngineConfig, ModelArgs, OffloadConfig
from specexec.drafters.choose import DrafterChoice, choose
from specexec.drafters.registry import MODEL, SELF, DraftSpec, parse_draft
from specexec.options import ConfigError, check_device
from specexec.planning.run_shape import SelfDraftShape
from specexec.runtime.self_draft import self_draft_shape
from specexec.acceptance.rules import check_verifier


@dataclass(frozen=True)
class Sources:
    """What a run's names resolve to before any weight is read: the target's path and config, and at most one
    draft: a draft model (its path and config), a self-draft (its shape) or a drafter (the choice)."""

    target: Path
    args: ModelArgs
    draft: Path | None = None
    draft_args: ModelArgs | None = None
    self_spec: SelfDraftShape | None = None
    drafter: DrafterChoice | None = None


def resolve_sources(model: str, draft: str | None, config: EngineConfig, offload: OffloadConfig,
                    allow_pickle: bool) -> Sources:
    """The names an EngineConfig leaves to their registries checked, the target's path resolved and its config
    read (an unsupported architecture fails here), and which draft `draft` names: --draft self (its shape), a
    drafter (checked against the target) or a draft model (its path and config). ConfigError for a flag that
    does not apply to that draft."""
    check_device(config.device)
    check_builder(config.builder)
    check_verifier(config.verifier)
    t_path = resolve_model_path(model)
    t_args = read_args(t_path)
    spec = parse_draft(draft)
    self_spec = _self_spec(spec, config, offload)
    drafter = _choose_drafter(spec, t_path, t_args, config, offload, allow_pickle)
    d_path = resolve_model_path(spec.where) if spec is not None and spec.kind == MODEL else None
    d_args = read_args(d_path) if d_path is not None else None
    return Sources(t_path, t_args, d_path, d_args, self_spec, drafter)


def _self_spec(spec: DraftSpec | None, config: EngineConfig, offload: OffloadConfig) -> SelfDraftShape | None:
    """--draft self[:FORMAT] and --draft-layers, checked (None for a model draft or none)."""
    if spec is None or spec.kind != SELF:
        if offload.draft_layers is not None:
            raise ConfigError("--draft-layers applies to --draft self (a draft made of the target's own layers)")
        return None
    if offload.draft_quant != "none":
        raise ConfigError(f"--draft-quant is for a draft model; a self-draft's copies take --draft self:FORMAT "
                          f"(e.g. self:{offload.draft_quant})")
    return self_draft_shape(spec.where, offload.draft_layers, config.device)


def _choose_drafter(spec: DraftSpec | None, t_path: Path, t_args: ModelArgs, config: EngineConfig,
                    offload: OffloadConfig, allow_pickle: bool) -> DrafterChoice | None:
    """The drafter --draft names (a drafter kind's), checked against the target before any weight loads; None
    for a self-draft, a draft model or none."""
    choice = choose(spec, t_path, t_args, allow_pickle)
    if choice is not None:
        if config.draft_vocab is not None:
            raise ConfigError(f"--draft-vocab trims a draft model's head; the {choice.kind} drafter drafts over "
                              f"its own head (drop --draft-vocab)")
        if offload.draft_quant != "none":
            raise ConfigError(f"--draft-quant is for a draft model; the {choice.kind} drafter runs in the run dtype")
    return choice
