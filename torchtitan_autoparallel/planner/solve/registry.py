"""The one place the solvers are composed: a name -> a solver, and ``auto``.

* ``ilp``: exact (HiGHS or CBC), after the exact presolve;
* ``approx``: TRW-S plus local search, with TRW-S's bound (the ILP as its
  fallback when no plan fits);
* ``auto``: ``ilp`` or ``approx`` by problem size (below);
* ``brute-force``: enumeration, the test oracle (tiny problems only).

``optimality_check`` adds the LP bound to whatever plan the solver returns;
``mip_gap`` lets the exact solvers (``ilp``, and ``auto`` on its exact branch)
stop once their plan is proven within that relative gap. With overlap on,
``overlap_solver`` gives the solver of the same name for the overlap objective.

The parts import downwards only: ``presolve`` <- ``approx`` <- ``exact`` (whose
LP rounding and reduced-cost fixing use the approximate solver's plans) <-
``overlap``; the few loops the other way (the approximate solver's exact
fallback, the overlap solver's plain solves) are closed here, by handing each
the solver it asks.

``auto``: the exact ILP where it is quick, the approximate solver elsewhere.

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
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from torchtitan_autoparallel.planner.problem.problem import Problem
from torchtitan_autoparallel.planner.solve.approx.solver import ApproxSolver
from torchtitan_autoparallel.planner.solve.base import Solution, Solver
from torchtitan_autoparallel.planner.solve.brute_force import BruteForceSolver
from torchtitan_autoparallel.planner.solve.exact.cbc import CbcILPSolver
from torchtitan_autoparallel.planner.solve.exact.ilp import MIP_REL_GAP, HighsILPSolver
from torchtitan_autoparallel.planner.solve.exact.lp_bound import CertifyingSolver
from torchtitan_autoparallel.planner.solve.overlap.lagrange import SweepOverlapSolver
from torchtitan_autoparallel.planner.solve.overlap.model import OverlapSpec
from torchtitan_autoparallel.planner.solve.overlap.solver import OverlapSolver, overlap_objective
from torchtitan_autoparallel.planner.solve.presolve.collapse import tie_components
from torchtitan_autoparallel.planner.solve.presolve.pipeline import PresolvingSolver

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


BACKENDS = ("highs", "cbc")


def _ilp(backend: str, mip_gap: float | None) -> Solver:
    gap = MIP_REL_GAP if mip_gap is None else mip_gap
    if backend == "highs":
        return HighsILPSolver(mip_gap=gap)
    if backend == "cbc":
        return CbcILPSolver(mip_gap=gap)
    raise ValueError(f"unknown ILP backend {backend!r}; accepted: {', '.join(BACKENDS)}")


def exact_solver(backend: str, mip_gap: float | None = None) -> Solver:
    """The bare exact solver of ``backend``, no presolve around it: what ``rows`` drives."""
    return _ilp(backend, mip_gap)


def _presolved(solver: Solver, presolve: bool, check: bool) -> Solver:
    """``solver`` behind the exact presolve; the LP check (if any) runs on the reduced problem."""
    if presolve and isinstance(solver, HighsILPSolver):
        solver.highs_presolve = False  # ours already did its work, far more cheaply
    if check:
        solver = CertifyingSolver(solver)
    return PresolvingSolver(solver) if presolve else solver


def _approx(presolve: bool) -> ApproxSolver:
    """TRW-S, asking the presolved HiGHS ILP when no plan it finds fits."""
    fallback = PresolvingSolver(HighsILPSolver(highs_presolve=False))
    return ApproxSolver(full_presolve=presolve, exact=fallback)


def _checked(solver: Solver, presolve: bool, check: bool) -> Solver:
    """For solvers that reduce the problem themselves: the LP check presolves on its own."""
    return CertifyingSolver(solver, reduce=presolve) if check else solver


def _auto(backend: str, pre: bool, check: bool, gap: float | None) -> Solver:
    exact = _presolved(_ilp(backend, gap), pre, False)
    return _checked(AutoSolver(exact, _approx(pre), accept_gap=gap or 0.0), pre, check)


# name -> factory(backend, presolve, optimality_check, mip_gap)
SOLVERS: dict[str, Callable[[str, bool, bool, float | None], Solver]] = {
    "ilp": lambda backend, pre, check, gap: _presolved(_ilp(backend, gap), pre, check),
    # the approximate solver runs no MIP to stop
    "approx": lambda backend, pre, check, gap: _checked(_approx(pre), pre, check),
    "auto": _auto,
    "brute-force": lambda backend, pre, check, gap: _presolved(BruteForceSolver(), pre, False),
}


def get_solver(
    name: str,
    backend: str = "highs",
    presolve: bool = True,
    optimality_check: bool = False,
    mip_gap: float | None = None,
) -> Solver:
    """The solver registered under ``name``; ``backend`` picks the MIP engine.

    With ``presolve`` (the default) it solves the exactly reduced problem of
    ``presolve.pipeline`` (ties collapsed, chains and leaves eliminated) and
    reports the expanded plan scored on the original problem. With
    ``optimality_check`` the LP bound is added to the plan's lower bound.
    ``mip_gap`` (None: prove the optimum) stops the exact search at that relative gap.
    """
    try:
        factory = SOLVERS[name]
    except KeyError:
        raise ValueError(
            f"unknown solver {name!r}; accepted: {', '.join(sorted(SOLVERS))}"
        ) from None
    if backend not in BACKENDS:
        raise ValueError(f"unknown ILP backend {backend!r}; accepted: {', '.join(BACKENDS)}")
    return factory(backend, presolve, optimality_check, mip_gap)


def overlap_solver(
    name: str, backend: str, spec: OverlapSpec, presolve: bool = True, mip_gap: float | None = None
) -> Solver:
    """The solver for ``[autoparallel] solver = name`` when overlap is on."""
    if name not in SOLVERS:
        raise ValueError(f"unknown solver {name!r}; accepted: {', '.join(sorted(SOLVERS))}")

    def plain(kind: str) -> Solver:  # the overlap solver's plain solves, on its backend
        return get_solver(kind, backend)

    if name in ("ilp", "brute-force"):
        if name == "brute-force":
            LOG.warning("overlap: the brute-force solver does not model overlap; using the exact ILP")
        return OverlapSolver(spec, plain, backend, presolve=presolve, mip_gap=mip_gap)
    approx = SweepOverlapSolver(spec, get_solver("approx", backend, presolve),
                                lambda problem, x: overlap_objective(problem, spec, x))
    if name == "approx":
        return approx
    exact = OverlapSolver(spec, plain, backend, presolve=presolve, mip_gap=mip_gap)
    return AutoSolver(exact, approx, accept_gap=mip_gap or 0.0)
