"""The drafter kinds --draft can name, one row each (KINDS), and --draft parsed once into a DraftSpec.

A kind (DrafterKind) says how --draft writes it (`written`: NAME:PATH, NAME alone for one that reads the
target's own checkpoint, or a directory it `recognises`), its layout check (`checked`: the headers read once,
names and shapes checked against the target -> a drafters/load.Layout that loading reuses), what it is from
config.json alone (`planned`: `specexec plan`), its loader (`load`), its network style (`network`: a Drafter
subclass; the layout builds it), what the memory plan counts of it (`own_kv`: whether it keeps a KV cache
of its own), and, for a kind a target's own checkpoint may carry, whether it does (`offered`: chat's default
draft, `offered_kind`) and how that default is said (`said`). A new drafter kind is its module under specexec/drafters/ and one row of KINDS.

Does not know: what a drafter computes (specexec/network/), the memory plan's lines (a choice's size says what
it holds: drafters/choose.py), the engine.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specexec.config import ModelArgs
from specexec.drafters import assistant, eagle3, mtp
from specexec.drafters.load import Layout, load_layout
from specexec.network.assistant import Assistant
from specexec.network.drafter import Drafter, Eagle3Drafter, MtpDrafter
from specexec.network.model import Transformer
from specexec.options import ConfigError, is_self_draft

SELF, MODEL = "self", "model"          # the kinds of --draft besides the drafters': the self-draft, a draft model
WRITTEN = ("NAME:PATH", "NAME", "PATH")


@dataclass(frozen=True)
class DrafterKind:
    """One kind of drafter (module docstring). `checked(where, target path, target args, allow_pickle)` and
    `planned(where, target path, target args)` -> its Layout; `where` is what --draft names its checkpoint by
    ("" for one that reads the target's own)."""

    name: str
    written: str
    network: type[Drafter]
    checked: Callable[[str, Path, ModelArgs, bool], Layout]
    planned: Callable[[str, Path, ModelArgs], Layout]
    load: Callable[[Layout, Transformer, torch.dtype, torch.device], Drafter] = load_layout
    own_kv: bool = True
    recognises: Callable[[Path], bool] | None = None
    offered: Callable[[str | None], bool] | None = None
    said: str = ""

    def __post_init__(self) -> None:
        if self.written not in WRITTEN or (self.written == "PATH") != (self.recognises is not None):
            raise ValueError(f"drafter kind {self.name!r}: written is one of {WRITTEN}; PATH needs `recognises`")


KINDS: tuple[DrafterKind, ...] = (
    DrafterKind(eagle3.KIND, "NAME:PATH", Eagle3Drafter, eagle3.checked, eagle3.planned),
    DrafterKind(mtp.KIND, "NAME", MtpDrafter, mtp.checked, mtp.planned, offered=mtp.has_mtp_layer,
                said="the model's own MTP layer"),
    DrafterKind(assistant.KIND, "PATH", Assistant, assistant.checked, assistant.planned, own_kv=False,
                recognises=assistant.is_assistant),
)


def kind_named(name: str) -> DrafterKind | None:
    """The row of the drafter kind `name` (None: no drafter kind is so named)."""
    return next((k for k in KINDS if k.name == name), None)


def offered_kind(model: str | None) -> DrafterKind | None:
    """The first kind the target `model` names carries in its own checkpoint (its headers say so), else None."""
    return next((k for k in KINDS if k.offered is not None and k.offered(model)), None)


@dataclass(frozen=True)
class DraftSpec:
    """--draft parsed: `kind` is SELF (the target's own layers), MODEL (a draft model) or a drafter kind's name;
    `where` the checkpoint it names (the value as written for SELF and MODEL; "" for a drafter that reads the
    target's own checkpoint)."""

    text: str
    kind: str
    where: str

    @property
    def drafter(self) -> DrafterKind | None:
        """The drafter kind's row (None for SELF and MODEL)."""
        return kind_named(self.kind)


def parse_draft(text: str | None) -> DraftSpec | None:
    """A --draft value -> its DraftSpec (None: no draft): self[:FMT], NAME:PATH or NAME of a drafter kind, a
    directory a kind recognises (its config.json says), else a draft model. ConfigError (one line) for a kind
    written without its checkpoint, or with one where it reads the target's."""
    if text is None:
        return None
    if is_self_draft(text):
        return DraftSpec(text, SELF, text)
    name, colon, rest = text.strip().partition(":")
    kind, rest = kind_named(name.lower()), rest.strip()
    if kind is not None and kind.written == "NAME":
        if colon or rest:
            raise ConfigError(f"--draft {text}: {kind.name} reads the target's own checkpoint; write --draft "
                              f"{kind.name} alone")
        return DraftSpec(text, kind.name, "")
    if kind is not None and kind.written == "NAME:PATH":
        if not rest:
            raise ConfigError(f"--draft {text}: name the head's checkpoint, e.g. --draft {kind.name}:PATH or "
                              f"{kind.name}:ORG/NAME")
        return DraftSpec(text, kind.name, rest)
    path = Path(text)
    found = next((k for k in KINDS if k.recognises is not None and path.is_dir() and k.recognises(path)), None)
    return DraftSpec(text, found.name if found is not None else MODEL, text)
