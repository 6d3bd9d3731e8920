"""The LP relaxation of the ILP on HiGHS: a lower bound for any plan.

The relaxation is the ILP of ``exact.model`` with its binaries made continuous
(the local polytope). Its optimum bounds every plan's energy from below; when
it is integral it *is* the optimal plan (the ILP solver starts with this LP and
stops there when it is).

``CertifyingSolver`` adds a proven bound to any solver's result
(``optimality_check``), so a plan from a fast heuristic comes with a proven gap:
the LP value, raised where the LP is fractional by reduced-cost fixing against
the plan and the MIP over the columns left (``fixing``), which on the
planner's problems usually proves the plan optimal or finds the true gap.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace

import numpy as np

from torchtitan_autoparallel.planner.problem.problem import Problem
from torchtitan_autoparallel.planner.solve.base import Solution, Solver
from torchtitan_autoparallel.planner.solve.exact.ilp import INTEGRALITY_TOL, OPTIMAL_RTOL, HighsILPSolver
from torchtitan_autoparallel.planner.solve.exact.model import build_ilp
from torchtitan_autoparallel.planner.solve.exact.rounding import marginals
from torchtitan_autoparallel.planner.solve.presolve.pipeline import presolve

LOG = logging.getLogger("torchtitan_autoparallel.planner")
MIN_SLICE_S = 1.0  # the least time a follow-up step (fallback, certificate) is given


@dataclass
class LpResult:
    status: str  # "optimal" | "infeasible" | "time_limit"
    value: float  # the LP optimum, offset included (-inf unless optimal)
    marginals: np.ndarray | None  # (n, kmax) x[v, s] of the LP optimum
    integral: bool
    seconds: float


def solve_lp(
    problem: Problem, time_limit: float | None, highs_presolve: bool | None = None
) -> LpResult:
    """The local-polytope LP of ``problem``; raises ``InfeasibleProblem`` only when a
    node has no allowed strategy at all (``build_ilp``'s own check).

    ``highs_presolve`` None: on only with a memory row. Measured on the debug
    model: with the row (a loose budget) HiGHS' presolve makes simplex 5x
    faster; without it (the budget fixed every parameter) it makes it 4x slower.
    """
    import highspy

    start = time.perf_counter()
    model = build_ilp(problem)
    if highs_presolve is None:
        highs_presolve = model.has_memory_row
    h = HighsILPSolver(highs_presolve=highs_presolve)._highs(model, time_limit, integer=False)
    h.run()
    status = h.getModelStatus()
    kinds = highspy.HighsModelStatus
    seconds = time.perf_counter() - start
    if status in (kinds.kInfeasible, kinds.kUnboundedOrInfeasible):
        return LpResult("infeasible", math.inf, None, False, seconds)
    if status != kinds.kOptimal:
        return LpResult("time_limit", -math.inf, None, False, seconds)
    values = np.asarray(h.getSolution().col_value, dtype=np.float64)[: model.num_x]
    value = h.getInfo().objective_function_value + model.offset
    integral = np.minimum(np.abs(values), np.abs(1.0 - values)).max(initial=0.0) <= INTEGRALITY_TOL
    return LpResult("optimal", value, marginals(problem, model, values), bool(integral), seconds)


def certified_bound(
    problem: Problem, plan: np.ndarray, time_limit: float | None, reduce: bool = True
) -> float:
    """A lower bound on the optimum, at least the LP's: ``HighsILPSolver.certify``
    against ``plan`` (reduced-cost fixing, then the MIP on what is left); -inf if the
    LP did not finish. With ``reduce`` it works on the exactly presolved problem."""
    upper = problem.energy(plan)
    problem, offset = _bound_problem(problem, reduce)
    if problem.num_nodes == 0:
        return offset
    model = build_ilp(problem)
    return HighsILPSolver().certify(model, upper - offset - model.offset, time_limit) + (
        offset + model.offset
    )


def lp_bound(problem: Problem, time_limit: float | None, reduce: bool = True) -> float:
    """A lower bound on the optimum from the LP (-inf if it did not finish).

    With ``reduce`` it runs on the exactly presolved problem, whose LP is far
    smaller and no weaker (the eliminations are exact min-marginalisations).
    """
    problem, offset = _bound_problem(problem, reduce)
    if problem.num_nodes == 0:
        return offset
    result = solve_lp(problem, time_limit)
    return result.value + offset if result.status == "optimal" else -math.inf


def _bound_problem(problem: Problem, reduce: bool) -> tuple[Problem, float]:
    """The problem a bound is computed on, and the energy its reduction took out."""
    if not reduce:
        return problem, 0.0
    pre = presolve(problem)
    return pre.reduced, pre.offset


class CertifyingSolver:
    """Any solver, plus a proven bound on its plan (``optimality_check``): the LP's, raised
    by reduced-cost fixing and the MIP on what is left (``certified_bound``)."""

    def __init__(self, inner: Solver, reduce: bool = False) -> None:
        self.inner = inner
        self.name = inner.name
        self.reduce = reduce  # presolve before the LP (when ``inner`` sees the raw problem)

    def solve(self, problem: Problem, time_limit: float | None = None) -> Solution:
        start = time.perf_counter()
        sol = self.inner.solve(problem, time_limit)
        if sol.status == "optimal" or sol.gap == 0.0:
            LOG.info("optimality check: %s proved its plan optimal", sol.solver)
            return sol
        # the check is asked for explicitly: it gets at least half the limit again
        limit = None if time_limit is None else max(_left(start, time_limit), 0.5 * time_limit)
        bound = certified_bound(problem, sol.assignment, limit, reduce=self.reduce)
        if not math.isfinite(bound):
            LOG.warning(
                "optimality check: the LP did not finish in %s s; no bound beyond %s's",
                limit, sol.solver,
            )
            return sol
        lower = min(sol.objective, max(sol.lower_bound, bound))
        status = "optimal" if _gap(sol.objective, lower) <= OPTIMAL_RTOL else sol.status
        LOG.info(
            "optimality check: bound %.6g us, plan %.6g us: certified gap %.4g%%",
            bound, sol.objective, 100 * _gap(sol.objective, lower),
        )
        return replace(sol, lower_bound=lower, status=status, seconds=time.perf_counter() - start)


def _gap(objective: float, lower: float) -> float:
    if not math.isfinite(lower):
        return math.inf
    return max(0.0, objective - lower) / max(abs(objective), 1e-9)


def _left(start: float, time_limit: float | None) -> float | None:
    if time_limit is None:
        return None
    return max(time_limit - (time.perf_counter() - start), MIN_SLICE_S)
