"""What the engine does for a mixture-of-experts target at each step (as a companion: `ExpertSteps`, the hooks of
specexec/companions/protocol.py): learn its routing, trim the tree to the nodes worth the experts they pull in,
and count what the passes read (stats.moe). docs/algorithms.md §22.

- `observe` (after each verification pass): the target's RoutingLog of that pass (every sparse layer's [T, k]
  routing of the tree's rows) feeds RoutingStats; the accepted nodes against the kept nodes' path
  probabilities calibrate the acceptance values `trim` uses; the pass's distinct experts per sparse layer and, for a streamed target that counts them
  (CountsExperts), the expert bytes it read and its expert cache's hits go to the profiler's counters, the one
  ledger stats.moe is read from (`moe_stats`); then each of `listeners` hears the routing counts [L, E] (a
  self-draft re-ranks the hot experts of its MoE copies from them, specexec/runtime/hot_experts.py, and says
  the expert bytes it read: moe_draft_expert_bytes).
- `trim` (after the builder grew a tree, before verification): the kept sub-tree by specexec/tuning/
  expert_trim.py. mode "experts": `select` under this target's TreeCost (seconds per expert of each streamed
  sparse layer, the experts the device holds, the predicted union calibrated by `scale`, the observed over the
  predicted union of past passes); "nodes": the best-scoring nodes, as many as the same predicted pass time
  holds (the node-count baseline of benchmarks); "off": the tree as grown. The engine trims only trees whose
  rule verifies any sub-tree exactly (deterministic drafting, a rule that needs no draft probabilities).

Does not know: how experts are streamed or cached (the target's business; it reports what it held and read),
builders, acceptance rules, the CLI.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from specexec.abilities import has
from specexec.companions.protocol import Step
from specexec.config import ModelArgs
from specexec.network.moe import RoutingLog
from specexec.profiler import Profiler
from specexec.tree import TokenTree
from specexec.tuning.expert_trim import TreeCost, node_budget, score_values, select
from specexec.options import TRIM_MODES
from specexec.tuning.routing import RoutingStats, union_sizes

SCALE_DECAY = 0.9          # the union and acceptance calibrations follow the last ~10 passes
CALIBRATION_PRIOR = 4.0    # the acceptance calibration's prior (1) is worth this many predicted nodes


Listener = Callable[[Tensor, tuple[int, ...]], "dict[str, float] | None"]
"""Hears (routing counts [L, E] of the sparse layers, their layer ids) after each pass; what it returns is added
to the profiler's counters (e.g. moe_draft_expert_bytes)."""


@runtime_checkable
class CountsExperts(Protocol):
    """A target that streams experts: cumulative {"expert_bytes", "expert_hits", "expert_lookups"} (bytes of
    experts brought onto the device, routed experts found in its expert cache, routed experts of streamed
    layers looked up), and which experts of each sparse layer it holds on the device now (held [L, E] bool,
    rows in the order of its sparse layers)."""

    def expert_counters(self) -> dict[str, float]: ...

    def experts_held(self) -> Tensor: ...


class ExpertPasses:
    """The engine's MoE companion for one target (see the module docstring). expert_s [L]: seconds to bring
    one expert of each sparse layer onto the device (0: resident or not streamed); expert_bytes: one expert's
    packed bytes; base: seconds of the rest of a pass of n rows (default flat 0); held [L, E] bool: the experts
    on the device, fixed (a synthetic cost model: benchmarks), None: whatever the target says it holds."""

    def __init__(self, args: ModelArgs, expert_s: Tensor | None = None, expert_bytes: int = 0,
                 base: Callable[[int], float] | None = None, mode: str = "experts",
                 device: torch.device | str = "cpu", held: Tensor | None = None) -> None:
        if args.moe is None:
            raise ValueError("ExpertPasses needs a mixture-of-experts target")
        if mode not in TRIM_MODES:
            raise ValueError(f"unknown trim mode {mode!r}; choose one of: {', '.join(TRIM_MODES)}")
        m = args.moe
        self.layers = tuple(i for i in range(args.n_layers) if m.sparse(i))
        self.n_experts, self.expert_bytes, self.mode = m.n_experts, expert_bytes, mode
        L = len(self.layers)
        self.expert_s = torch.zeros(L, dtype=torch.float64) if expert_s is None else expert_s.double().cpu()
        self.base = base or (lambda rows: 0.0)
        self.fixed_held = held
        self.routing = RoutingStats(self.layers, m.n_experts, m.top_k, device)
        self.hits, self.expected = 0.0, 0.0           # decayed accepted nodes, and their predicted sum
        self.scale, self.draft_s, self.last_expert_s = 1.0, 0.0, 0.0
        self._keep: Tensor | None = None
        self._predicted: float | None = None          # the kept rows' predicted expert seconds (scaled)
        self._held = torch.zeros(0, dtype=torch.bool)  # the experts held when the tree was trimmed
        self.records: list[dict] = []                  # per pass: rows, distinct per layer, predicted seconds
        self.listeners: list[Listener] = []          # told the routing counts after each pass

    @property
    def expert_bytes_all(self) -> int:
        """Bytes of every expert of every sparse layer."""
        return len(self.layers) * self.n_experts * self.expert_bytes

    def attach(self, target) -> None:
        """Make the target record its routing (a target that streams experts records it already)."""
        if getattr(target, "routing", None) is None:
            target.run_as(replace(target.execution, routing=RoutingLog()))

    def held(self, target) -> Tensor:
        """[L, E] experts on the device: the fixed set, else what a streaming target says, else all (a
        resident target)."""
        if self.fixed_held is not None:
            return self.fixed_held.bool().cpu()
        if isinstance(target, CountsExperts):
            return target.experts_held().bool().cpu()
        return torch.ones(len(self.layers), self.n_experts, dtype=torch.bool)

    def cost(self, target) -> TreeCost:
        return TreeCost(self.expert_s, self.held(target), self.base, self.draft_s, self.routing.gamma, self.scale)

    # -- trimming

    def trim(self, tree: TokenTree, target) -> TokenTree:
        """The sub-tree to verify (module docstring)."""
        self._keep, self._predicted = None, None
        if self.mode == "off" or tree.size == 0:
            return tree
        cost = self.cost(target)
        self._held = cost.held
        if not bool((cost.expert_weights() > 0).any()):                       # nothing to move: cost is flat
            return tree
        probs = self.routing.node_probs(tree.tokens)                           # [N+1, L, E]
        value = score_values(tree.scores, self.calibration)
        keep = select(tree, value, probs, cost)
        if self.mode == "nodes":
            n = node_budget(tree, probs, cost, cost.seconds(probs[keep.cpu()]))
            keep = torch.sort(torch.cat([keep.new_zeros(1), 1 + torch.sort(
                tree.scores[1:], descending=True, stable=True).indices[:n]])).values
        self._keep = keep
        self._predicted = cost.seconds(probs[keep.cpu()]) - cost.base(int(keep.numel()))
        return tree if keep.numel() == tree.tokens.numel() else tree.select(keep, check=False)

    # -- learning and counting

    def observe(self, tree: TokenTree, accepted_nodes: list[int], target, profiler: Profiler,
                before: dict[str, float] | None) -> None:
        """After a step's verification of `tree` (the kept one): learn and count (module docstring). before:
        the target's expert_counters() before the pass (None when it has none)."""
        log = getattr(target, "routing", None)
        if log is None or not all(i in log.layers for i in self.layers):
            return
        routing = {i: log.layers[i] for i in self.layers}
        distinct = torch.stack([torch.unique(routing[i]).numel() * torch.ones(()) for i in self.layers])
        self._calibrate(routing)
        self.routing.observe(tree.tokens, routing)
        self._learn_acceptance(tree, accepted_nodes)
        counts = {"moe_passes": 1.0, "moe_distinct": float(distinct.mean())}
        if before is not None:
            now = target.expert_counters()
            counts.update({f"moe_{k}": now[k] - before.get(k, 0.0) for k in now})
        profiler.count(**counts)
        profiler.gauges["moe_expert_bytes_all"] = float(self.expert_bytes_all)
        self.last_expert_s = self._read_seconds(routing)
        self.records.append({"rows": int(tree.tokens.numel()), "distinct": distinct.tolist(),
                             "predicted_expert_s": self._predicted, "expert_s": self.last_expert_s})
        del self.records[:-4096]
        for listen in self.listeners:                 # e.g. a self-draft re-ranking its hot experts
            profiler.count(**(listen(self.routing.counts, self.layers) or {}))

    def _calibrate(self, routing: dict[int, Tensor]) -> None:
        """scale <- decayed mean of (the experts the kept rows read, in expert-seconds) / (what their node
        probabilities predicted): the union the trim optimises, corrected by what passes actually read."""
        if not self._predicted or self._keep is None:
            return
        ratio = self._read_seconds(routing) / (self._predicted / self.scale)
        self.scale = SCALE_DECAY * self.scale + (1 - SCALE_DECAY) * min(max(ratio, 0.25), 4.0)

    def _read_seconds(self, routing: dict[int, Tensor]) -> float:
        """What a pass's routing cost in expert seconds: its distinct experts not held, each at its layer's s."""
        read = 0.0
        for j, i in enumerate(self.layers):
            experts = torch.unique(routing[i]).cpu()
            held = self._held[j, experts] if self._held.numel() else torch.zeros(experts.numel(), dtype=torch.bool)
            read += float(self.expert_s[j]) * int((~held).sum())
        return read

    @property
    def calibration(self) -> float:
        """Accepted nodes per unit of predicted acceptance (the draft's path probabilities) in past passes,
        beside a prior of 1 worth CALIBRATION_PRIOR accepted nodes that never decays (one unlucky pass must not
        trim every later tree to its root, where nothing more is learned)."""
        return (self.hits + CALIBRATION_PRIOR) / (self.expected + CALIBRATION_PRIOR)

    def _learn_acceptance(self, tree: TokenTree, accepted_nodes: list[int]) -> None:
        """The verified tree's accepted nodes against the path probabilities of its nodes (decayed sums)."""
        predicted = float(tree.scores[1:].double().exp().sum()) if tree.size else 0.0
        self.hits = SCALE_DECAY * self.hits + sum(1 for a in accepted_nodes if a > 0)
        self.expected = SCALE_DECAY * self.expected + predicted

    def expected_seconds(self, rows: int) -> float:
        """The cost model's MoE term (tuning/budget.CostModel.experts): expected seconds of the experts a pass
        of `rows` rows brings onto the device (the union model of routing.py over the experts not held at the
        last trim, calibrated by `scale`)."""
        p = self.routing.frequencies()
        if self._held.numel():
            p = p.masked_fill(self._held.to(p.device), 0.0)
        union = union_sizes(p, rows, self.routing.gamma).cpu()
        return self.scale * float((union * self.expert_s).sum())

    def observe_times(self, draft_s: float) -> None:
        """The step's drafting seconds (a decayed mean: the D of the next trim's rate)."""
        self.draft_s = draft_s if not self.draft_s else 0.8 * self.draft_s + 0.2 * draft_s


class ExpertSteps:
    """An MoE target's ExpertPasses in the loop: trims the drafted tree, reads a streaming target's expert
    counters before the pass (CountsExperts), learns and counts after it, hears the drafting seconds."""

    def __init__(self, experts: ExpertPasses, target, profiler: Profiler) -> None:
        self.experts, self.target, self.profiler = experts, target, profiler
        self.counts = has(target, CountsExperts)          # its expert traffic, read each step
        self._before: dict[str, float] | None = None

    def trim(self, tree: TokenTree) -> TokenTree:
        return self.experts.trim(tree, self.target)

    def before_verify(self, step: Step) -> None:
        self._before = self.target.expert_counters() if self.counts else None

    def after_verify(self, step: Step) -> None:
        self.experts.observe(step.tree, step.accepted.nodes, self.target, self.profiler, self._before)
        step.expert_s = self.experts.last_expert_s

    def timed(self, step: Step) -> None:
        self.experts.observe_times(step.draft_s)
