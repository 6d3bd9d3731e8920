"""The approximate solver: TRW-S, then local search, with a certified lower bound.

1. Reduce exactly (``presolve``): tie groups collapse (repeated layers cost
   one), chains and leaves are eliminated, dominated strategies dropped. On
   3-D meshes (hundreds of labels per node) it takes 0.1-0.3 s, often more
   than TRW-S needs where the LP is tight, but where it is not (the 2x4x8
   meshes) TRW-S on the reduced problem is 2-5 times faster and finds better
   plans (``experiments/solver_bench``), so it always runs unless presolve is
   switched off.
2. TRW-S (``trws``) gives a labeling and a lower bound; local search
   (``local_search``) polishes the labeling.
3. A memory budget that binds is relaxed with a Lagrange multiplier: the
   unary becomes ``theta_v + lam * memory_v``. Bisection on ``lam`` finds the
   smallest price at which TRW-S's plan fits; every distinct plan met on the
   way is repaired and polished under the budget when first met (once:
   neighbouring prices mostly give TRW-S the same plan, and the local search
   is the costly part), and the best that fits is kept. For any ``lam >= 0``
   the TRW-S bound of the priced energy minus ``lam * budget`` bounds the
   constrained optimum from below, so the best such figure is the
   certificate, and the search stops once the best plan is within ``gap`` of
   it, as the unpriced search does.

The result never breaks the budget: if no plan fits, the ``exact`` solver it
was given (the registry gives it the ILP) either finds one or raises
``InfeasibleProblem`` naming the smallest feasible budget; without one it
raises ``SolverTimeout``. The exact solvers ask this one for quick plans, so it
is handed its exact fallback rather than importing it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from torchtitan_autoparallel.planner.problem.problem import FlatProblem, InfeasibleProblem, Problem
from torchtitan_autoparallel.planner.solve.approx.local_search import polish
from torchtitan_autoparallel.planner.solve.approx.mrf import Mrf, NoLabels, build_mrf
from torchtitan_autoparallel.planner.solve.approx.trws import GAP_RTOL, OPTIMAL_RTOL, Trws, within_gap
from torchtitan_autoparallel.planner.solve.base import Solution, Solver, SolverTimeout
from torchtitan_autoparallel.planner.solve.presolve.collapse import collapse
from torchtitan_autoparallel.planner.solve.presolve.pipeline import presolve

LOG = logging.getLogger("torchtitan_autoparallel.planner")
LAMBDA_STEPS = 12  # bisection steps on the memory price
LAMBDA_RATIO = 1.01  # stop bisecting once the bracket is this tight
LAMBDA_GROWTH = 10.0  # price multiplier while searching for one at which plans fit
LAMBDA_TRIES = 10


@dataclass
class _Outcome:
    labels: np.ndarray | None  # best compact labeling that fits (None: none found)
    bound: float  # lower bound on the optimum of the Mrf
    timed_out: bool


@dataclass
class _Reduced:
    problem: FlatProblem  # tie-free
    expand: Callable[[np.ndarray], np.ndarray]  # its plan -> the original plan
    offset: float  # energy the reduction took out


class ApproxSolver:
    def __init__(
        self,
        name: str = "approx-trws",
        full_presolve: bool = True,
        exact: Solver | None = None,
        gap: float = GAP_RTOL,
    ) -> None:
        self.name = name
        self.gap = gap  # stop once the plan is proven this close (relative) to the optimum
        self.full_presolve = full_presolve  # False: ties collapse, nothing more
        self.exact = exact  # asked when no plan fits (None: raise SolverTimeout)

    def solve(self, problem: Problem, time_limit: float | None = None) -> Solution:
        start = time.perf_counter()
        deadline = None if time_limit is None else start + time_limit
        if problem.num_nodes == 0:
            return Solution(np.zeros(0, np.int64), 0.0, 0.0, self.name, "optimal", 0.0)
        try:
            reduced = self._reduce(problem)
            mrf = build_mrf(reduced.problem)
        except (NoLabels, InfeasibleProblem):
            return self._exact(problem, start, time_limit, "no usable label left for some node")
        LOG.info(
            "%s: %d nodes, %d edges, up to %d labels, memory %s",
            self.name, mrf.num_nodes, len(mrf.edges), int(mrf.k.max(initial=0)),
            "binding" if mrf.flat_memory is not None else "free",
        )
        outcome = search(mrf, deadline, self.gap)
        if outcome.labels is None:
            return self._exact(problem, start, time_limit, "no plan found that fits")
        assignment = reduced.expand(mrf.expand(outcome.labels))
        objective = problem.energy(assignment)
        if not problem.is_feasible(assignment, energy=objective):
            raise RuntimeError(f"{self.name}: the plan violates the problem's constraints")
        lower = min(objective, outcome.bound + reduced.offset)
        status = _status(objective, lower, outcome.timed_out)
        seconds = time.perf_counter() - start
        LOG.info(
            "%s: %s, objective %.6g us, bound %.6g us, %.2f s",
            self.name, status, objective, lower, seconds,
        )
        return Solution(assignment, objective, lower, self.name, status, seconds)

    def _reduce(self, problem: Problem) -> _Reduced:
        if not self.full_presolve:
            collapsed = collapse(problem)
            return _Reduced(collapsed.flat, lambda x: x[collapsed.group_of], 0.0)
        pre = presolve(problem)
        return _Reduced(pre.reduced_flat, pre.expand, pre.offset)

    def _exact(
        self, problem: Problem, start: float, time_limit: float | None, why: str
    ) -> Solution:
        """The ILP settles what local methods could not: infeasible (naming the
        smallest budget) or a plan after all."""
        if self.exact is None:
            raise SolverTimeout(f"no feasible plan found in time (approximate solver: {why})")
        LOG.warning("%s: %s; asking the exact ILP", self.name, why)
        left = None if time_limit is None else max(time_limit - (time.perf_counter() - start), 1.0)
        sol = self.exact.solve(problem, left)
        seconds = time.perf_counter() - start
        return Solution(
            sol.assignment, sol.objective, sol.lower_bound, self.name, sol.status, seconds
        )


def _status(objective: float, lower: float, timed_out: bool) -> str:
    if objective - lower <= OPTIMAL_RTOL * max(abs(objective), 1.0):
        return "optimal"
    return "time_limit" if timed_out else "feasible"


def search(mrf: Mrf, deadline: float | None, gap: float) -> _Outcome:
    """TRW-S and local search on a built ``Mrf``, under the Lagrangian price search
    when its memory budget binds: the solver's work once the presolve is done."""
    trws = Trws(mrf)
    if mrf.flat_memory is None:
        # cheap single-node moves on the way, block moves too at the end
        improve = lambda x, final: polish(mrf, x, deadline, blocks=final)  # noqa: E731
        run = trws.run(mrf.flat_unary, deadline, improve=improve, gap=gap)
        x = run.labels
        return _Outcome(x if mrf.feasible(x) else None, run.bound, run.timed_out)
    return _Lagrangian(mrf, trws, deadline, gap).search()


class _Lagrangian:
    """Bisection on the memory price ``lam``, keeping the best plan that fits.

    Each distinct plan TRW-S returns is repaired and polished under the budget
    when first met (at that price), so the search stops as soon as the best
    plan that fits is within ``gap`` of the certificate: on the benchmark's
    loose budgets the unpriced plan, repaired, is often that plan already."""

    def __init__(self, mrf: Mrf, trws: Trws, deadline: float | None, gap: float) -> None:
        self.mrf, self.trws, self.deadline, self.gap = mrf, trws, deadline, gap
        self.best: np.ndarray | None = None
        self.best_energy = math.inf
        self.bound = -math.inf
        self.timed_out = False
        self.seen: set[bytes] = set()  # TRW-S's plans polished so far

    def search(self) -> _Outcome:
        fits, energy, used = self._attempt(0.0)
        if not fits and not self._done():
            bracket = self._bracket(energy, used)
            if bracket is not None:
                self._bisect(*bracket)
        return _Outcome(self.best, self.bound, self.timed_out)

    def _bracket(self, energy: float, used: float) -> tuple[float, float] | None:
        """Prices (too low, high enough) for TRW-S's plan to fit, a factor apart."""
        # the unpriced plan's energy spread over its excess bytes: the order of
        # magnitude at which memory starts to matter
        lam = max(abs(energy), 1.0) / max(used - self.mrf.budget, 1.0)
        for _ in range(LAMBDA_TRIES):
            if self._done():
                return None
            if self._attempt(lam)[0]:
                return lam / LAMBDA_GROWTH, lam
            lam *= LAMBDA_GROWTH
        return None

    def _bisect(self, lo: float, hi: float) -> None:
        for _ in range(LAMBDA_STEPS):
            if hi <= lo * LAMBDA_RATIO or self._done():
                return
            mid = math.sqrt(lo * hi)
            if self._attempt(mid)[0]:
                hi = mid
            else:
                lo = mid

    def _attempt(self, lam: float) -> tuple[bool, float, float]:
        """TRW-S at price ``lam``; returns whether its plan fits, its energy and memory."""
        mrf = self.mrf
        priced = mrf.flat_unary + lam * mrf.flat_memory
        run = self.trws.run(priced, self.deadline, gap=self.gap)
        self.timed_out |= run.timed_out
        self.bound = max(self.bound, run.bound - lam * mrf.budget)
        x = run.labels
        energy, used = mrf.energy(x), mrf.memory_used(x)
        key = x.tobytes()
        if key not in self.seen:
            self.seen.add(key)
            self._offer(polish(mrf, x, self.deadline, lam))
        LOG.debug("lagrangian: lam %.3g, plan %.6g us, %.4g bytes", lam, energy, used)
        return used <= mrf.budget and energy < mrf.big, energy, used

    def _offer(self, x: np.ndarray) -> None:
        if self.mrf.feasible(x):
            energy = self.mrf.energy(x)
            if energy < self.best_energy:
                self.best, self.best_energy = x, energy

    def _done(self) -> bool:
        """Out of time, or the best plan that fits is proven within ``gap``."""
        if self._late():
            return True
        return self.best is not None and within_gap(self.best_energy, self.bound, self.gap)

    def _late(self) -> bool:
        if self.deadline is not None and time.perf_counter() > self.deadline:
            self.timed_out = True
        return self.timed_out
