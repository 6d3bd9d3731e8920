"""Solvers of the sharding ``Problem``; pick one by name with ``get_solver``.

* ``ilp``: exact (HiGHS or CBC), after the exact presolve;
* ``lp``: the LP relaxation; integral -> optimal, else rounded and polished,
  with the LP value as its bound;
* ``approx``: TRW-S plus local search, with TRW-S's bound;
* ``auto``: ``ilp`` or ``approx`` by problem size (``solvers.auto``);
* ``brute-force``: enumeration, the test oracle.

``optimality_check`` adds the LP bound to whatever plan the solver returns.
"""

from __future__ import annotations

from collections.abc import Callable

from torchtitan_autoparallel.planner.solvers.approx import ApproxSolver
from torchtitan_autoparallel.planner.solvers.auto import AutoSolver
from torchtitan_autoparallel.planner.solvers.base import Solution, Solver
from torchtitan_autoparallel.planner.solvers.brute_force import BruteForceSolver
from torchtitan_autoparallel.planner.solvers.cbc import CbcILPSolver
from torchtitan_autoparallel.planner.solvers.ilp import HighsILPSolver, SolverTimeout
from torchtitan_autoparallel.planner.solvers.lp import CertifyingSolver, LPSolver
from torchtitan_autoparallel.planner.solvers.presolve import Presolved, PresolvingSolver, presolve

BACKENDS = ("highs", "cbc")


def _ilp(backend: str) -> Solver:
    if backend == "highs":
        return HighsILPSolver()
    if backend == "cbc":
        return CbcILPSolver()
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


# name -> factory(backend, presolve, optimality_check)
SOLVERS: dict[str, Callable[[str, bool, bool], Solver]] = {
    "ilp": lambda backend, pre, check: _presolved(_ilp(backend), pre, check),
    "lp": lambda backend, pre, check: _presolved(LPSolver(), pre, False),  # its bound is the LP's
    "approx": lambda backend, pre, check: _checked(_approx(pre), pre, check),
    "auto": lambda backend, pre, check: _checked(
        AutoSolver(_presolved(_ilp(backend), pre, False), _approx(pre)), pre, check
    ),
    "brute-force": lambda backend, pre, check: _presolved(BruteForceSolver(), pre, False),
}


def get_solver(
    name: str, backend: str = "highs", presolve: bool = True, optimality_check: bool = False
) -> Solver:
    """The solver registered under ``name``; ``backend`` picks the MIP engine.

    With ``presolve`` (the default) it solves the exactly reduced problem of
    ``solvers.presolve`` (ties collapsed, chains and leaves eliminated) and
    reports the expanded plan scored on the original problem. With
    ``optimality_check`` the LP bound is added to the plan's lower bound.
    """
    try:
        factory = SOLVERS[name]
    except KeyError:
        raise ValueError(
            f"unknown solver {name!r}; accepted: {', '.join(sorted(SOLVERS))}"
        ) from None
    if backend not in BACKENDS:
        raise ValueError(f"unknown ILP backend {backend!r}; accepted: {', '.join(BACKENDS)}")
    return factory(backend, presolve, optimality_check)


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
