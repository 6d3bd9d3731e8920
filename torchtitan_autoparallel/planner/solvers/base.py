"""The one interface every solver implements, and the result they all return."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from torchtitan_autoparallel.planner.problem.problem import Problem


@dataclass
class Solution:
    assignment: np.ndarray  # one strategy index per node
    objective: float  # recomputed from the problem's tables, never the solver's own figure
    lower_bound: float  # a proven bound on the optimum (== objective when optimal)
    solver: str  # e.g. "ilp-highs", "ilp-cbc", "brute-force"
    status: str  # "optimal" | "time_limit" | "feasible"
    seconds: float

    @property
    def gap(self) -> float:
        """Relative gap to the lower bound (0.0 means proven optimal)."""
        if not np.isfinite(self.lower_bound):
            return float("inf")
        return max(0.0, self.objective - self.lower_bound) / max(abs(self.objective), 1e-9)


class Solver(Protocol):
    name: str

    def solve(self, problem: Problem, time_limit: float | None = None) -> Solution: ...
