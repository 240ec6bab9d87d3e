"""A model whose numbers go non-finite (NaN/Inf weights, a config's nonsense that slipped through) gives
meaningless output that looks like output: one token, empty text. The engine checks the first verification pass
of every generation: each decoder layer's input and the stack's output add their count of non-finite values to
a list of device scalars as the pass runs (Transformer.finite_probe: no host sync per layer), read once at the
end; the first count above zero names where the values appeared.

Does not know: why the values are non-finite (the weights, the config, an overflow in a low-precision dtype).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from specexec.options import ConfigError


class NonFinite(ConfigError):
    """The target's first pass produced NaN or Inf; the message names the layer."""


def where(counts: list[int], n_layers: int) -> str | None:
    """Where non-finite values first appear, from the probe's counts (layer inputs 0..n-1, then the stack's
    output, then the final hidden after the norm); None when every count is zero."""
    first = next((i for i, c in enumerate(counts) if c), None)
    if first is None:
        return None
    if first == 0:
        return "in the token embeddings"
    if first <= n_layers:
        return f"in the output of decoder layer {first - 1} (of {n_layers})"
    return "in the final norm"


def checked_pass(model: torch.nn.Module, run: Callable[[], torch.Tensor], n_layers: int) -> torch.Tensor:
    """run() (a forward of `model` returning hidden [..., D]) with the probe on; NonFinite when any value went
    non-finite, naming where. One host sync, after the pass."""
    model.finite_probe = probe = []
    try:
        hidden = run()
    finally:
        model.finite_probe = None
    counts = torch.stack(probe + [hidden.isfinite().logical_not().sum()]).tolist()
    found = where(counts, n_layers)
    if found is not None:
        raise NonFinite(f"the target's first pass gives non-finite values (NaN or Inf) {found}: its weights or "
                        "config.json's numbers are broken, and its output would be meaningless")
    return hidden
