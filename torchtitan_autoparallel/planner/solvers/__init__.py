"""Solvers of the sharding ``Problem``; pick one by name with ``get_solver``.

* ``ilp``: exact (HiGHS or CBC), after the exact presolve;
* ``lp``: the LP relaxation; integral -> optimal, else rounded and polished,
  with the LP value as its bound;
* ``approx``: TRW-S plus local search, with TRW-S's bound;
* ``auto``: ``ilp`` or ``approx`` by problem size (``solvers.auto``);
* ``brute-force``: enumeration, the test oracle.

``optimality_check`` adds the LP bound to whatever plan the solver returns;
``mip_gap`` lets the exact solvers (``ilp``, and ``auto`` on its exact branch)
stop once their plan is proven within that relative gap.
"""

from __future__ import annotations

from collections.abc import Callable

from torchtitan_autoparallel.planner.solvers.approx import ApproxSolver
from torchtitan_autoparallel.planner.solvers.auto import AutoSolver
from torchtitan_autoparallel.planner.solvers.base import Solution, Solver
from torchtitan_autoparallel.planner.solvers.brute_force import BruteForceSolver
from torchtitan_autoparallel.planner.solvers.cbc import CbcILPSolver
from torchtitan_autoparallel.planner.solvers.ilp import MIP_REL_GAP, HighsILPSolver, SolverTimeout
from torchtitan_autoparallel.planner.solvers.lp import CertifyingSolver, LPSolver
from torchtitan_autoparallel.planner.solvers.presolve import Presolved, PresolvingSolver, presolve

BACKENDS = ("highs", "cbc")


def _ilp(backend: str, mip_gap: float | None) -> Solver:
    gap = MIP_REL_GAP if mip_gap is None else mip_gap
    if backend == "highs":
        return HighsILPSolver(mip_gap=gap)
    if backend == "cbc":
        return CbcILPSolver(mip_gap=gap)
    raise ValueError(f"unknown ILP backend {backend!r}; accepted: {', '.join(BACKENDS)}")


def _presolved(solver: Solver, presolve: bool, check: bool) -> Solver:
    """``solver`` behind the exact presolve; the LP check (if any) runs on the reduced problem."""
    if presolve and isinstance(solver, HighsILPSolver):
        solver.highs_presolve = False  # ours already did its work, far more cheaply
    if check:
        solver = CertifyingSolver(solver)
    return PresolvingSolver(solver) if presolve else solver


def _approx(presolve: bool) -> ApproxSolver:
    return ApproxSolver(full_presolve=presolve)


def _checked(solver: Solver, presolve: bool, check: bool) -> Solver:
    """For solvers that reduce the problem themselves: the LP check presolves on its own."""
    return CertifyingSolver(solver, reduce=presolve) if check else solver


def _auto(backend: str, pre: bool, check: bool, gap: float | None) -> Solver:
    exact = _presolved(_ilp(backend, gap), pre, False)
    return _checked(AutoSolver(exact, _approx(pre), accept_gap=gap or 0.0), pre, check)


# name -> factory(backend, presolve, optimality_check, mip_gap)
SOLVERS: dict[str, Callable[[str, bool, bool, float | None], Solver]] = {
    "ilp": lambda backend, pre, check, gap: _presolved(_ilp(backend, gap), pre, check),
    # the LP's bound is its own; it and the approximate solvers run no MIP to stop
    "lp": lambda backend, pre, check, gap: _presolved(LPSolver(), pre, False),
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
    ``solvers.presolve`` (ties collapsed, chains and leaves eliminated) and
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


__all__ = [
    "ApproxSolver",
    "AutoSolver",
    "BruteForceSolver",
    "CbcILPSolver",
    "CertifyingSolver",
    "HighsILPSolver",
    "LPSolver",
    "Presolved",
    "PresolvingSolver",
    "SOLVERS",
    "Solution",
    "Solver",
    "SolverTimeout",
    "get_solver",
    "presolve",
]
