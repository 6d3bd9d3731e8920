"""The exact (ILP) solve of a ``Problem`` with overlap (``overlap.model``).

The objective is ``energy(x) - savings(x)``, where ``savings(x)`` is the most
communication the plan can hide behind compute (itself a small LP once ``x``
is fixed; ``overlap_savings``). Solutions report that objective, recomputed
from the tables for the plan the solver returns.

By default the model is built on the problem after ``overlap.presolve``: the
exact presolve, restricted to the reductions that keep every node's compute
and every overlappable edge's cost priced at its own step position (ties
collapse, nodes whose choice moves only the energy are eliminated). The plan
is expanded back and its savings recomputed on the full problem, so what the
solution reports is exact. ``presolve=False`` builds the model on the full
problem (the reference the tests compare against).

The approximate solver (TRW-S) works on pairwise energies only and cannot
express the budget chains; with overlap on it runs inside the theta sweep of
``overlap.lagrange`` (plain solves on reweighted tables, each plan scored on
the exact objective, with a bound). The exact path runs the same sweep first:
its best plan warm-starts the MIP, and its bound stands where the MIP proves
less (a model too large for its root LP in time).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from torchtitan_autoparallel.planner.problem.problem import InfeasibleProblem, Problem
from torchtitan_autoparallel.planner.solve.base import Solution, Solver
from torchtitan_autoparallel.planner.solve.exact.cbc import CbcILPSolver
from torchtitan_autoparallel.planner.solve.exact.ilp import (
    OBJECTIVE_RTOL,
    HighsILPSolver,
    _remaining,
    _Run,
)
from torchtitan_autoparallel.planner.solve.exact.model import build_ilp
from torchtitan_autoparallel.planner.solve.overlap.lagrange import Sweep, sweep
from torchtitan_autoparallel.planner.solve.overlap.model import (
    OverlapIlpModel,
    OverlapSpec,
    add_overlap,
    build_overlap_ilp,
)
from torchtitan_autoparallel.planner.solve.overlap.presolve import overlap_presolve
from torchtitan_autoparallel.planner.solve.overlap.terms import empty_model, fixed_terms
from torchtitan_autoparallel.planner.solve.presolve.pipeline import ENERGY_RTOL

LOG = logging.getLogger("torchtitan_autoparallel.planner")
# relative, the default mip_gap of the overlap MIP: the budget chains make its tree deep,
# and the last fraction of a percent costs minutes; the proven bound is reported all the same
OVERLAP_MIP_GAP = 1e-3
SWEEP_SHARE = 0.3  # of the time limit, for the sweep whose best plan warm-starts the overlap MIP
CERTIFY_RTOL = 1e-6


@dataclass
class OverlapBreakdown:
    """What a fixed plan hides: per edge, and in total (microseconds)."""

    edges: np.ndarray  # problem edge indices that can save anything
    savings: np.ndarray  # us saved on each
    total: float


def overlap_breakdown(problem: Problem, spec: OverlapSpec, assignment: np.ndarray) -> OverlapBreakdown:
    """The largest savings of a fixed plan: the overlap LP on the full problem with every
    compute and communication a constant (no ILP columns at all, so it stays cheap at any size)."""
    if problem.num_nodes == 0:
        return OverlapBreakdown(np.zeros(0, np.int64), np.zeros(0), 0.0)
    model = add_overlap(empty_model(), fixed_terms(problem, spec, assignment))
    if not len(model.saving_col):
        return OverlapBreakdown(model.saving_edge, np.zeros(0), 0.0)
    h = HighsILPSolver(highs_presolve=True)._highs(model, None, integer=False)
    h.run()
    values = np.asarray(h.getSolution().col_value, dtype=np.float64)
    savings = np.maximum(model.savings(values), 0.0)
    return OverlapBreakdown(model.saving_edge, savings, float(savings.sum()))


def overlap_savings(problem: Problem, spec: OverlapSpec, assignment: np.ndarray) -> float:
    return overlap_breakdown(problem, spec, assignment).total


def overlap_objective(problem: Problem, spec: OverlapSpec, assignment: np.ndarray) -> float:
    """What the overlap solvers minimise, for a fixed plan: energy minus the best savings."""
    return problem.energy(assignment) - overlap_savings(problem, spec, assignment)


@dataclass
class _Instance:
    """What the overlap ILP is built on: the problem itself, or its overlap-exact reduction."""

    problem: Problem  # the problem the model's columns belong to
    model: OverlapIlpModel
    expand: Callable[[np.ndarray], np.ndarray]  # its plans -> plans of the original problem
    offset: float = 0.0  # energy eliminated by the presolve
    slack: float = 0.0  # savings the model may under-credit (``OverlapTerms.slack``)
    # plans of the original problem -> its plans (None: uses a strategy the presolve dropped)
    restrict: Callable[[np.ndarray], np.ndarray | None] = lambda x: np.asarray(x, np.int64)


def _instance(problem: Problem, spec: OverlapSpec, presolve: bool) -> _Instance:
    if not presolve:
        return _Instance(problem, build_overlap_ilp(problem, spec), lambda x: np.asarray(x, np.int64))
    pre = overlap_presolve(problem, spec)
    LOG.info("overlap %s", pre.summary())
    base = build_ilp(pre.reduced)
    terms = pre.terms(base)
    return _Instance(pre.reduced, add_overlap(base, terms), pre.expand, pre.offset, terms.slack,
                     pre.pre.restrict)


class OverlapSolver:
    """Energy minus overlap savings, on HiGHS or CBC. ``plain`` gives the plain solver
    of a name (``registry.get_solver`` on the same backend): ``auto`` for the sweep's
    solves, ``ilp`` for the warm start and the infeasibility diagnosis.
    ``presolve`` (default) solves the overlap-exact reduced problem (``overlap.presolve``).
    ``mip_gap``: the MIP stops once its plan is proven within it, and a sweep plan
    already proven within it skips the MIP. None (the default): the MIP stops at
    ``OVERLAP_MIP_GAP``, and only a sweep plan that meets its bound skips it."""

    def __init__(self, spec: OverlapSpec, plain: Callable[[str], Solver], backend: str = "highs",
                 presolve: bool = True, mip_gap: float | None = None) -> None:
        self.spec = spec
        self.plain = plain
        self.backend = backend
        self.presolve = presolve
        self.mip_gap = OVERLAP_MIP_GAP if mip_gap is None else mip_gap
        self.sweep_gap = CERTIFY_RTOL if mip_gap is None else mip_gap
        self.name = f"ilp-{backend}+overlap"

    def solve(self, problem: Problem, time_limit: float | None = None) -> Solution:
        start = time.perf_counter()
        if problem.num_nodes == 0:
            return Solution(np.zeros(0, np.int64), 0.0, 0.0, self.name, "optimal", 0.0)
        found = self._sweep(problem, time_limit)
        if found is not None and _certified(found.objective, found.bound, self.sweep_gap):
            LOG.info("%s: the sweep's plan is within %.3g%% of its bound; no MIP needed",
                     self.name, 100 * _gap(found.objective, found.bound))
            return _sweep_solution(found, self.name, "feasible", start)
        try:
            inst = _instance(problem, self.spec, self.presolve)
        except InfeasibleProblem:
            self._diagnose(problem, start, time_limit)
            raise
        model = inst.model
        model.completion = lambda base: _complete(model, base)
        model.start = None if found is None else inst.restrict(found.assignment)
        if model.start is None:
            model.start = self._plain_start(inst.problem, model, time_limit)
        LOG.info(
            "%s: %d nodes, %d edges, %d overlappable -> %s (built in %.2f s)",
            self.name, inst.problem.num_nodes, len(inst.problem.edges), len(model.saving_col),
            model.describe(), time.perf_counter() - start,
        )
        run = self._run(problem, inst, start, time_limit)
        if run.status == "infeasible":
            self._diagnose(problem, start, time_limit)
            raise InfeasibleProblem("no plan satisfies the constraints")
        if run.status == "no_solution":
            return self._fallback(problem, inst, found, start, time_limit)
        x = model.assignment(run.col_value)
        return _with_sweep(self._finish(problem, inst, x, run, start), found, start)

    def _sweep(self, problem: Problem, time_limit: float | None) -> Sweep | None:
        """The theta sweep (``overlap.lagrange``): a plan and a bound. Its plain solves go to
        ``auto``: reweighting makes the ILP's LP fractional, and on 3-D meshes one exact
        solve of a reweighted problem can take minutes where TRW-S takes seconds."""
        share = None if time_limit is None else SWEEP_SHARE * time_limit
        try:
            return sweep(problem, self.spec, self.plain("auto"),
                         lambda x: overlap_objective(problem, self.spec, x), share)
        except InfeasibleProblem:
            return None  # the overlap solve reports it

    def _diagnose(self, problem: Problem, start: float, time_limit: float | None) -> None:
        """Overlap never changes feasibility: the plain solver names the culprit (and raises)."""
        self.plain("ilp").solve(problem, _remaining(start, time_limit))

    def _plain_start(
        self, problem: Problem, model: OverlapIlpModel, time_limit: float | None
    ) -> np.ndarray | None:
        """The plain optimum of the reduced problem as the incumbent, where the sweep's
        plan uses a strategy the overlap presolve dropped."""
        share = None if time_limit is None else SWEEP_SHARE * time_limit
        try:
            sol = self.plain("ilp").solve(problem, share)
        except InfeasibleProblem:
            return None  # the overlap solve reports it
        LOG.info("%s: warm start from the plain plan (%.6g us, %s)", self.name, sol.objective, sol.status)
        return sol.assignment if problem.is_feasible(sol.assignment) else model.start

    def _run(self, problem: Problem, inst: _Instance, start: float, time_limit: float | None) -> _Run:
        model = inst.model
        # What the warm start and the presolve used counts against the limit too.
        left = _remaining(start, time_limit)
        if self.backend == "cbc":
            return CbcILPSolver(self.name, self.mip_gap)._run(model, left)
        highs = HighsILPSolver(self.name, highs_presolve=True, mip_gap=self.mip_gap)
        return highs._run(model, left)

    def _finish(
        self, problem: Problem, inst: _Instance, x: np.ndarray, run: _Run, start: float
    ) -> Solution:
        full = inst.expand(x)
        if not problem.is_feasible(full):
            raise RuntimeError(f"{self.name}: the solver's plan violates the problem's constraints")
        energy = problem.energy(full)
        expected = inst.problem.energy(x) + inst.offset
        if not math.isclose(energy, expected, rel_tol=ENERGY_RTOL, abs_tol=ENERGY_RTOL):
            raise RuntimeError(f"{self.name}: expanded plan costs {energy!r}, the reduced one {expected!r}")
        # savings recomputed on the full problem: what is reported is exact
        savings = overlap_savings(problem, self.spec, full)
        objective = energy - savings
        solver_value = run.objective + inst.model.offset + inst.offset
        tol = OBJECTIVE_RTOL * max(abs(objective), 1.0)
        # for a fixed plan the solver's savings can only be at most the best ones
        if objective > solver_value + tol:
            raise RuntimeError(f"{self.name}: recomputed objective {objective!r} > solver's {solver_value!r}")
        bound = run.bound + inst.model.offset + inst.offset - inst.slack
        lower = min(objective, bound)
        # a MIP stopped at its mip_gap reports "optimal"; only a closed gap is
        status = "optimal" if objective - lower <= tol else ("time_limit" if run.status == "time_limit" else "feasible")
        seconds = time.perf_counter() - start
        LOG.info(
            "%s: %s, objective %.6g us (energy %.6g, overlap saves %.6g), bound %.6g us, %.2f s",
            self.name, status, objective, energy, savings, lower, seconds,
        )
        return Solution(full, objective, lower, self.name, status, seconds)

    def _fallback(
        self, problem: Problem, inst: _Instance, found: Sweep | None, start: float, time_limit: float | None
    ) -> Solution:
        """No MIP plan in time: the sweep's plan and bound (else the plain plan, no bound)."""
        LOG.warning("%s: no plan from the overlap MIP in %s s; taking the sweep's", self.name, time_limit)
        if found is not None:
            return _sweep_solution(found, self.name, "time_limit", start)
        if inst.model.start is not None:
            full = inst.expand(inst.model.start)
        else:
                full = self.plain("ilp").solve(problem, _remaining(start, time_limit)).assignment
        objective = problem.energy(full) - overlap_savings(problem, self.spec, full)
        return Solution(full, objective, -math.inf, self.name, "time_limit", time.perf_counter() - start)


def _gap(objective: float, bound: float) -> float:
    return (objective - bound) / max(abs(objective), 1.0)


def _certified(objective: float, bound: float, gap: float = CERTIFY_RTOL) -> bool:
    return _gap(objective, bound) <= gap


def _sweep_solution(found: Sweep, name: str, status: str, start: float) -> Solution:
    status = "optimal" if _certified(found.objective, found.bound) else status
    return Solution(found.assignment, found.objective, found.bound, name, status, time.perf_counter() - start)


def _with_sweep(sol: Solution, found: Sweep | None, start: float) -> Solution:
    """The better plan of the MIP and the sweep, with the better bound of the two."""
    if found is None:
        return sol
    lower = max(sol.lower_bound, found.bound)
    if found.objective < sol.objective:
        LOG.info("%s: the sweep's plan (%.6g us) beats the MIP's (%.6g us)", sol.solver,
                 found.objective, sol.objective)
        sol = replace(sol, assignment=found.assignment, objective=found.objective)
    lower = min(lower, sol.objective)
    if _certified(sol.objective, lower):
        status = "optimal"
    else:  # a plan switched to the sweep's loses the MIP's proof
        status = "feasible" if sol.status == "optimal" else sol.status
    return replace(sol, lower_bound=lower, status=status, seconds=time.perf_counter() - start)


def _complete(model: OverlapIlpModel, base: np.ndarray) -> np.ndarray:
    """Full columns for fixed x and y: the overlap LP with the base columns pinned."""
    h = HighsILPSolver(highs_presolve=True)._highs(model, None, integer=False)
    fixed = np.arange(model.num_base_col, dtype=np.int32)
    h.changeColsBounds(len(fixed), fixed, base, base)
    h.run()
    import highspy

    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:  # zero overlap is always feasible
        return np.concatenate([base, np.zeros(model.num_col - model.num_base_col)])
    values = np.asarray(h.getSolution().col_value, dtype=np.float64)
    values[: model.num_base_col] = base  # exact binaries for the warm start
    return values
