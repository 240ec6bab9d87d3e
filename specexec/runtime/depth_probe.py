"""`--draft-layers auto` at load: measure shallower depths of the planned self-draft and keep the fastest
(docs/algorithms.md §26; the choice itself is specexec/tuning/depth.py's).

The candidates are depth_ladder's depths over the planned draft's layer ids (k_max of them): for depth k the
ids at spaced_layers(k_max, k) of that list, so the first and the last planned layer are always among them.
Each is `SelfDraft.subset` of the planned draft: the same modules, nothing copied or read again.

One window of text (the built-in prompts' first WINDOW tokens: the depth is chosen at load, before any
prompt) is run through the target and through each candidate, teacher-forced, in a scratch KV cache of its own:
- the first half is the prefix (one pass);
- then TIMED one-row passes, each timed (the fastest: seconds per drafted token, or the target's one-row
  pass; a stall of the machine only ever lengthens a pass), then the rest of the window in one pass (the
  target's: how a pass grows with its rows);
- each candidate's argmax over the second half is compared with the target's: its top-1 agreement.
A self-draft over every layer of a resident target is the target, so its agreement is exactly 1.

Does not know: why a depth wins (tuning/depth.py), the plan (which layers fit), the engine's caches (the probe's
are its own and dropped), the gate (the caller turns it on when no depth pays).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specexec.abilities import has
from specexec.decoding.engine import new_cache
from specexec.network.model import PlansPrefill, Transformer, TreeMask
from specexec.planning.run_shape import MIN_SELF_LAYERS, spaced_layers
from specexec.runtime.self_draft import SelfDraft
from specexec.runtime.tokenizer import encode_prompt
from specexec.tuning.depth import DepthChoice, DepthSample, choose_depth, depth_ladder

WINDOW = 64            # tokens of text the probe runs
TIMED = 4              # one-row passes timed per model (the fastest counts: a stall only lengthens)
LEAST_WINDOW = 2 * (TIMED + 2)      # shorter: no probe (the planned depth stays)
TEXT_CHARS = 6 * WINDOW    # characters encoded for the window (a BPE token is ~4 of them)

Say = Callable[[str], None]


@dataclass(frozen=True)
class Measured:
    """One model over the window: argmax predictions [P] of the window's second half, the seconds of its
    fastest one-row pass, and the seconds of its pass over the remaining `rest_rows` rows."""

    predictions: torch.Tensor
    one_row_s: float
    rest_s: float
    rest_rows: int

    @property
    def row_s(self) -> float:
        """Seconds each row beyond the first adds to a pass (a line through the one-row and the rest pass)."""
        return max(self.rest_s - self.one_row_s, 0.0) / (self.rest_rows - 1) if self.rest_rows > 1 else 0.0


def probe_window(tokenizer) -> list[int]:
    """The probe's text: the first built-in prompt of each category, joined, its first WINDOW tokens."""
    from specexec.prompts import load_prompts

    first: dict[str, str] = {}
    for p in load_prompts():
        first.setdefault(p.category, p.prompt)
    text = "\n\n".join(first.values())[:TEXT_CHARS]
    return encode_prompt(tokenizer, text, False, None)[:WINDOW]


def candidate_ids(ids: Sequence[int], k: int) -> tuple[int, ...]:
    """k of the planned layer ids `ids`, evenly spaced among them, the first and the last always kept."""
    return tuple(ids[j] for j in spaced_layers(len(ids), k))


def measure(model: Transformer, window: Sequence[int], device: torch.device) -> Measured:
    """`model` teacher-forced over `window` (len >= LEAST_WINDOW) in a scratch cache; see the module docstring."""
    ids = torch.tensor(list(window), device=device)
    w, half = ids.numel(), ids.numel() // 2
    cache = new_cache(model, w + 1, "none", w)
    _pass(model, cache, ids[:half - 1])                       # the prefix (predictions start at its end)
    predictions, times = [], []
    for j in range(half - 1, half - 1 + TIMED):
        t0 = _now(device)
        predictions.append(_pass(model, cache, ids[j:j + 1]))
        times.append(_now(device) - t0)
    rest = ids[half - 1 + TIMED:w - 1]
    t0 = _now(device)
    predictions.append(_pass(model, cache, rest))
    return Measured(torch.cat(predictions), min(times), _now(device) - t0, rest.numel())


def probe_depths(target: Transformer, draft: SelfDraft, window: Sequence[int],
                 depths: Sequence[int]) -> tuple[list[DepthSample], Measured]:
    """Each depth of `depths` (<= len(draft.layer_ids)) measured against the target over `window`: the samples
    and the target's own measurement."""
    device = next(target.parameters()).device
    with torch.inference_mode():
        ref = measure(target, window, device)
        samples = []
        for k in depths:
            m = measure(_at_depth(draft, k), window, device)
            agreement = (m.predictions == ref.predictions).float().mean().item()
            samples.append(DepthSample(k, agreement, m.one_row_s))
    return samples, ref


def choose_self_depth(target: Transformer, draft: SelfDraft, window: Sequence[int],
                      say: Say | None = None) -> tuple[SelfDraft, DepthChoice | None]:
    """The planned `draft` at the depth predicted fastest (its choice line said through `say`), and that
    choice; the draft as it is and None when there is nothing to choose (one candidate, or a window shorter
    than LEAST_WINDOW)."""
    k_max = len(draft.layer_ids)
    depths = depth_ladder(k_max, min(MIN_SELF_LAYERS, k_max))
    if len(depths) < 2 or len(window) < LEAST_WINDOW:
        return draft, None
    samples, ref = probe_depths(target, draft, list(window)[:WINDOW], depths)
    choice = choose_depth(samples, target.args.n_layers, ref.one_row_s, ref.row_s)
    if say is not None:
        tried = ", ".join(f"{s.depth}: {s.agreement:.2f}" for s in samples)
        say(f"self-draft depths (layers: agreement) {tried}")
        say(choice.line())
    return _at_depth(draft, choice.depth), choice


def _at_depth(draft: SelfDraft, k: int) -> SelfDraft:
    return draft if k == len(draft.layer_ids) else draft.subset(candidate_ids(draft.layer_ids, k))


def _pass(model: Transformer, cache, part: torch.Tensor) -> torch.Tensor:
    """`part` [T] through `model` after the cache's rows (causal), committed; its argmax [T] (empty part:
    nothing). A streamed target takes at most its planned prefill rows per pass."""
    chunk = model.prefill_tokens if has(model, PlansPrefill) and model.prefill_tokens else max(part.numel(), 1)
    out = []
    for start in range(0, part.numel(), chunk):
        piece = part[start:start + chunk]
        t, length = piece.numel(), cache.length
        pos = torch.arange(length, length + t, device=part.device)
        hidden = model(piece[None], pos[None], TreeMask(length), cache)
        cache.advance(t)
        out.append(model.logits(hidden).argmax(-1))
    return torch.cat(out) if out else part.new_empty(0)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
