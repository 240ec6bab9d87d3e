"""One rule of a family's WEIGHT_RULES: our parameter name inside a decoder layer -> the stored tensor (and the
piece of it) that holds it. The family modules list them; specexec/checkpoints/weight_map.py applies them.

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
    the first dimension of a fused [n_experts, ...] stored tensor; start/step/transpose as in TensorRef; `half`
    0 or 1: the first or second half of the stored rows (an expert's gate or up of a fused [2I, D] tensor)."""

    ours: str
    theirs: str
    expert: bool = False
    start: int = 0
    step: int = 1
    transpose: bool = False
    half: int | None = None

    def ref(self, match: re.Match[str], prefix: str, args: ModelArgs) -> TensorRef:
        name = prefix + match.expand(self.theirs)
        start, length = self.start, 0
        if self.half is not None:                    # an expert's gate or up rows (MoEArgs.expert_dim each)
            length = args.moe.expert_dim
            start = self.half * length
        if not self.expert:
            return TensorRef(name, start=start, step=self.step, transpose=self.transpose, length=length)
        count = args.moe.n_experts if args.moe is not None else None
        return TensorRef(name, int(match.group(1)), count, start, self.step, self.transpose, length)
