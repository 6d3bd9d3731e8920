"""Overlap plans and bounds from plain solves on reweighted tables (any plain solver).

Split a plan's energy as ``C + O + N``: ``C`` its compute (the unary costs),
``O`` its overlappable communication (the prefetch and backward edges of the
``OverlapSpec``) and ``N`` the rest. The overlap model saves at most
``min(C, O)``: each edge saves at most what it costs, and every saving draws on
compute that is spent once (the split ``f_j + b_j <= c_j``). So for every
``theta`` in [0, 1] and every plan

    energy - savings >= C + O + N - min(C, O) >= (1 - theta) C + theta O + N = E_theta,

and the least ``E_theta`` over all plans, a *plain* problem (unary tables
scaled by ``1 - theta``, overlappable ones by ``theta``), bounds the overlap
optimum from below. ``g(theta) = min E_theta`` is concave, and ``O - C`` of
its minimiser is a supergradient, so bisection on that sign climbs to the best
such bound. Every minimiser is a plan too: each is scored on the exact overlap
objective and the best is kept, the plain plan among them, so the result is
never worse than planning without overlap.

That makes overlap available to the approximate solver (TRW-S as the plain
solver: seconds per solve, and its own bound per theta), and gives the exact
path a better warm start and a bound where its MIP is too large to solve.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import numpy as np

from torchtitan_autoparallel.planner.problem.problem import Problem
from torchtitan_autoparallel.planner.solve.base import Solution, Solver
from torchtitan_autoparallel.planner.solve.overlap.model import OverlapSpec
from torchtitan_autoparallel.planner.solve.overlap.terms import overlappable

LOG = logging.getLogger("torchtitan_autoparallel.planner")
STEPS = 7  # bisection steps: theta to within 1/128
CERTIFY_RTOL = 1e-6


@dataclass
class Sweep:
    """The best plan the sweep found, its exact overlap objective, and the best bound."""

    assignment: np.ndarray
    objective: float
    bound: float
    trace: list[tuple[float, float, float]] = field(default_factory=list)  # (theta, objective, bound)


def _scaled(table: np.ndarray, weight: float) -> np.ndarray:
    out = np.array(table, dtype=np.float64)
    finite = np.isfinite(out)
    out[finite] *= weight  # forbidden (inf) entries stay forbidden: inf * 0 would be nan
    return out


def reweighted(problem: Problem, edges: np.ndarray, theta: float) -> Problem:
    """The plain problem whose energy is ``E_theta``: compute times ``1 - theta``,
    the tables of ``edges`` (the overlappable ones) times ``theta``."""
    pairwise = list(problem.pairwise)
    for e in edges.tolist():
        pairwise[e] = _scaled(pairwise[e], theta)
    unary = [_scaled(u, 1.0 - theta) for u in problem.unary]
    return replace(problem, unary=unary, pairwise=pairwise)


def slope(problem: Problem, edges: np.ndarray, assignment: np.ndarray) -> float:
    """``O - C`` of a plan: the supergradient of ``g`` where the plan minimises ``E_theta``."""
    x = np.asarray(assignment, dtype=np.int64)
    compute = sum(float(problem.unary[v][x[v]]) for v in range(problem.num_nodes))
    ends = problem.edges
    comm = sum(float(problem.pairwise[e][x[ends[e, 0]], x[ends[e, 1]]]) for e in edges.tolist())
    return comm - compute


def sweep(
    problem: Problem,
    spec: OverlapSpec,
    plain: Solver,
    score: Callable[[np.ndarray], float],
    time_limit: float | None = None,
    steps: int = STEPS,
) -> Sweep:
    """The plain plan, then ``steps`` bisection steps on theta; stops early when time is up.
    ``score`` is the exact overlap objective of a plan of ``problem``."""
    start = time.perf_counter()
    edges = overlappable(problem, spec)[0]

    def left() -> float | None:
        return None if time_limit is None else time_limit - (time.perf_counter() - start)

    with _quiet_inner_solves():
        first = plain.solve(problem, left())
    best = Sweep(first.assignment, score(first.assignment), -math.inf)
    LOG.info("overlap sweep: plain plan %.6g us with overlap (%s, %.2f s)",
             best.objective, first.solver, time.perf_counter() - start)
    lo, hi = 0.0, 1.0
    for _ in range(steps):
        remaining = left()
        if remaining is not None and remaining <= 0:
            LOG.info("overlap sweep: time is up after %d steps", len(best.trace))
            break
        theta = 0.5 * (lo + hi)
        with _quiet_inner_solves():
            sol = plain.solve(reweighted(problem, edges, theta), remaining)
        value = score(sol.assignment)
        best.trace.append((theta, value, sol.lower_bound))
        LOG.info("overlap sweep %d/%d: theta %.4f, plan %.6g us, bound %.6g us (%.2f s)",
                 len(best.trace), steps, theta, value, sol.lower_bound, time.perf_counter() - start)
        best.bound = max(best.bound, sol.lower_bound)
        if value < best.objective:
            best.assignment, best.objective = sol.assignment, value
        if slope(problem, edges, sol.assignment) > 0:
            lo = theta
        else:
            hi = theta
    best.bound = min(best.bound, best.objective)
    LOG.info(
        "overlap sweep: best plan %.6g us, bound %.6g us after %d reweighted solves (%.2f s)",
        best.objective, best.bound, len(best.trace), time.perf_counter() - start,
    )
    return best


@contextlib.contextmanager
def _quiet_inner_solves() -> Iterator[None]:
    """The sweep's plain solves would log five lines each at INFO; the sweep logs one a
    step instead. A logger already set to DEBUG keeps everything."""
    level = LOG.level
    if LOG.getEffectiveLevel() >= logging.INFO:
        LOG.setLevel(logging.WARNING)
    try:
        yield
    finally:
        LOG.setLevel(level)


class SweepOverlapSolver:
    """Overlap on any plain solver, by the sweep (``approx`` with overlap on)."""

    def __init__(self, spec: OverlapSpec, plain: Solver, score: Callable[[Problem, np.ndarray], float]) -> None:
        self.spec = spec
        self.plain = plain
        self._score = score
        self.name = f"{plain.name}+overlap"

    def solve(self, problem: Problem, time_limit: float | None = None) -> Solution:
        start = time.perf_counter()
        if problem.num_nodes == 0:
            return Solution(np.zeros(0, np.int64), 0.0, 0.0, self.name, "optimal", 0.0)
        found = sweep(problem, self.spec, self.plain, lambda x: self._score(problem, x), time_limit)
        tol = CERTIFY_RTOL * max(abs(found.objective), 1.0)
        status = "optimal" if found.objective - found.bound <= tol else "feasible"
        return Solution(found.assignment, found.objective, found.bound, self.name, status,
                        time.perf_counter() - start)
