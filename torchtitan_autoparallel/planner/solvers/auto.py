"""``solver = "auto"``: the exact ILP where it is quick, the approximate solver elsewhere.

The rule reads one figure, the problem's *pairwise entries*: ``k_u * k_v``
summed over the edges between distinct tie groups (each pair of groups
counted once), i.e. the edge variables of the ILP after repeated layers
collapse. It is computed in milliseconds, before any solver runs.

* up to ``EXACT_MAX_ENTRIES`` (one million): the exact ILP. 1-D and 2-D
  meshes land here for every model size (LLaMA3-8B on 8x8: 0.3 million),
  and HiGHS proves the optimum in about a second;
* above it: the approximate solver (TRW-S). 3-D meshes land here (hundreds
  of strategies per node, about 6 million entries), where the ILP takes a
  minute or more and TRW-S seconds.

On the exact branch the ILP gets ``EXACT_SHARE`` of the time limit; if it
stops short of a proof (a slow LP, a hard branch-and-bound) and outside
``accept_gap`` (the ``mip_gap`` it was given), the approximate solver runs in
the rest and the better plan is kept, with the better bound.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np

from torchtitan_autoparallel.planner.problem.problem import Problem
from torchtitan_autoparallel.planner.solve.base import Solution, Solver
from torchtitan_autoparallel.planner.solve.presolve.collapse import tie_components

LOG = logging.getLogger("torchtitan_autoparallel.planner")
EXACT_MAX_ENTRIES = 1_000_000
EXACT_SHARE = 0.5
MIN_SLICE_S = 1.0


def pairwise_entries(problem: Problem) -> int:
    """Table entries between distinct tie groups, each group pair once (see the module doc)."""
    if not len(problem.edges):
        return 0
    comp = tie_components(problem.num_nodes, problem.ties)
    k = problem.num_strategies
    a, b = comp[problem.edges[:, 0]], comp[problem.edges[:, 1]]
    keep = a != b
    lo, hi = np.minimum(a, b)[keep], np.maximum(a, b)[keep]
    pairs = np.unique(lo * problem.num_nodes + hi)
    return int((k[pairs // problem.num_nodes] * k[pairs % problem.num_nodes]).sum())


def choose(problem: Problem) -> tuple[str, str]:
    """("ilp" | "approx", why)."""
    entries = pairwise_entries(problem)
    if entries <= EXACT_MAX_ENTRIES:
        return "ilp", f"{entries:,} pairwise entries <= {EXACT_MAX_ENTRIES:,}: exact is quick"
    return "approx", f"{entries:,} pairwise entries > {EXACT_MAX_ENTRIES:,}: the ILP would be slow"


class AutoSolver:
    def __init__(
        self, exact: Solver, approx: Solver, name: str = "auto", accept_gap: float = 0.0
    ) -> None:
        self.exact, self.approx, self.name = exact, approx, name
        self.accept_gap = accept_gap

    def solve(self, problem: Problem, time_limit: float | None = None) -> Solution:
        start = time.perf_counter()
        choice, why = choose(problem)
        LOG.info("auto solver: %s (%s)", choice, why)
        if choice == "approx":
            sol = self.approx.solve(problem, time_limit)
        else:
            sol = self._exact_first(problem, start, time_limit)
        return replace(sol, solver=f"auto:{sol.solver}", seconds=time.perf_counter() - start)

    def _exact_first(self, problem: Problem, start: float, time_limit: float | None) -> Solution:
        share = None if time_limit is None else EXACT_SHARE * time_limit
        sol = self.exact.solve(problem, share)
        if sol.status == "optimal" or (sol.status == "feasible" and sol.gap <= self.accept_gap):
            return sol
        left = None
        if time_limit is not None:
            left = max(time_limit - (time.perf_counter() - start), MIN_SLICE_S)
        LOG.info(
            "auto solver: the ILP stopped with gap %.3g%%; trying the approximate solver for %s s",
            100 * sol.gap, left,
        )
        other = self.approx.solve(problem, left)
        best = min(sol, other, key=lambda s: s.objective)
        lower = min(best.objective, max(sol.lower_bound, other.lower_bound))
        return replace(best, lower_bound=lower)
