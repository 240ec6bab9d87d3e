"""One rule of a family's WEIGHT_RULES: our parameter name inside a decoder layer -> the stored tensor (and the
piece of it) that holds it. The family modules list them; specexec/families/weights.py applies them.

Does not know: which family uses which rules, how tensors are read (offload/formats/refs).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from offload.formats.refs import TensorRef

from specexec.config import ModelArgs


@dataclass(frozen=True)
class Rule:
    """Our name inside a decoder layer (`ours`, a full-match regex) -> the stored tensor inside the same layer
    (`theirs`, a template: \\1 etc. are ours's groups). With `expert`, group 1 of ours is an expert index into
    the first dimension of a fused [n_experts, ...] stored tensor; start/step/transpose as in TensorRef."""

    ours: str
    theirs: str
    expert: bool = False
    start: int = 0
    step: int = 1
    transpose: bool = False

    def ref(self, match: re.Match[str], prefix: str, args: ModelArgs) -> TensorRef:
        name = prefix + match.expand(self.theirs)
        if not self.expert:
            return TensorRef(name, start=self.start, step=self.step, transpose=self.transpose)
        count = args.moe.n_experts if args.moe is not None else None
        return TensorRef(name, int(match.group(1)), count, self.start, self.step, self.transpose)
