"""The one interface every solver implements, the result they all return, and the two
ways they fail without a plan (no time left; a memory budget below the smallest feasible one)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from torchtitan_autoparallel.planner.problem.problem import Problem

GIB = float(2**30)


@dataclass
class Solution:
    assignment: np.ndarray  # one strategy index per node
    objective: float  # recomputed from the problem's tables, never the solver's own figure
    lower_bound: float  # a proven bound on the optimum (== objective when optimal)
    solver: str  # e.g. "ilp-highs", "ilp-cbc", "brute-force"
    status: str  # "optimal" | "time_limit" | "feasible"
    seconds: float
    # when the plan was solved again to fit the device (``plan.peak_rows.fit_peak``):
    # usable_bytes, peak_bytes, and the unbounded plan's unbounded_peak_bytes and
    # unbounded_objective; rounds, rows; fits (1.0 or 0.0)
    memory_fit: dict[str, float] = field(default_factory=dict)
    # each transformer block's recomputation, where the solve chose it
    # (``plan.recompute_choice``; empty: as traced)
    block_recompute: tuple[str, ...] = ()

    @property
    def gap(self) -> float:
        """Relative gap to the lower bound (0.0 means proven optimal)."""
        if not np.isfinite(self.lower_bound):
            return float("inf")
        return max(0.0, self.objective - self.lower_bound) / max(abs(self.objective), 1e-9)


class Solver(Protocol):
    name: str

    def solve(self, problem: Problem, time_limit: float | None = None) -> Solution: ...


class SolverTimeout(TimeoutError):
    """The time limit ran out before any feasible plan was found."""


def memory_message(budget: float, minimum: float) -> str:
    # rounded up so that the figure quoted is itself a feasible budget
    needed = math.ceil(minimum / GIB * 1000) / 1000
    return (
        f"memory budget {budget / GIB:.3f} GiB per device is below the smallest feasible "
        f"budget {needed:.3f} GiB ({math.ceil(minimum)} bytes)"
    )
