"""What `--budget auto` starts at, said before anything loads (`specexec plan`): the tuner's budget grid, its
first budget, and the planned seconds of a target pass over that tree. Torch-free, so option and planning
code may import it; the tuner itself (specexec/tuning/budget.py) takes its grid and start from here.

Does not know: measured costs or acceptance (the tuner learns those from the run, docs/algorithms.md §16),
nor how a pass time is planned (the caller passes the plan's seconds: offload/memory_plan.py expected_s, flat
in the tree size while streaming dominates, compute assumed hidden behind the copies).
"""
from __future__ import annotations

from dataclasses import dataclass

START_BUDGET = 16                 # the tuner's first budget: its grid value nearest this


def budget_grid(max_budget: int, min_budget: int = 1) -> list[int]:
    """Powers of two from min_budget up to max_budget (max_budget itself included)."""
    grid, b = [], max(1, min_budget)
    while b < max_budget:
        grid.append(b)
        b *= 2
    return grid + [max_budget]


def start_index(grid: list[int], start: int = START_BUDGET) -> int:
    """Index of the grid budget nearest `start` (the smaller on a tie)."""
    return min(range(len(grid)), key=lambda i: abs(grid[i] - start))


@dataclass(frozen=True)
class AutoStart:
    """--budget auto's first step as planned: its tree budget, the largest it may try, and the planned
    seconds of one target pass over budget + 1 rows."""

    budget: int
    max_budget: int
    seconds_per_pass: float

    def describe(self) -> str:
        return (f"--budget auto starts at budget {self.budget} (of 1..{self.max_budget}): predicted "
                f"{self.seconds_per_pass:.3f} s per target pass over its {self.budget + 1} rows; then each step "
                f"follows the measured costs and acceptance")

    def to_json(self) -> dict:
        return {"start": self.budget, "max": self.max_budget,
                "predicted_seconds_per_pass": round(self.seconds_per_pass, 4)}


def auto_start(max_budget: int, pass_seconds: float) -> AutoStart:
    """The tuner's first budget under max_budget, with the planned pass seconds (flat in the tree: the plan
    prices streaming, which every tree of a pass shares)."""
    grid = budget_grid(max_budget)
    return AutoStart(grid[start_index(grid)], max_budget, pass_seconds)
