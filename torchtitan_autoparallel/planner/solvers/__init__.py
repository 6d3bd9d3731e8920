"""Solvers of the sharding ``Problem``; pick one by name with ``get_solver``."""

from __future__ import annotations

from collections.abc import Callable

from torchtitan_autoparallel.planner.solvers.base import Solution, Solver
from torchtitan_autoparallel.planner.solvers.brute_force import BruteForceSolver
from torchtitan_autoparallel.planner.solvers.ilp import CbcILPSolver, HighsILPSolver, SolverTimeout
from torchtitan_autoparallel.planner.solvers.presolve import Presolved, PresolvingSolver, presolve

BACKENDS = ("highs", "cbc")


def _ilp(backend: str) -> Solver:
    if backend == "highs":
        return HighsILPSolver()
    if backend == "cbc":
        return CbcILPSolver()
    raise ValueError(f"unknown ILP backend {backend!r}; accepted: {', '.join(BACKENDS)}")


# name -> factory(backend). Later solvers ("lp", "approx", "auto") register here.
SOLVERS: dict[str, Callable[[str], Solver]] = {
    "ilp": _ilp,
    "brute-force": lambda backend: BruteForceSolver(),
}


def get_solver(name: str, backend: str = "highs", presolve: bool = True) -> Solver:
    """The solver registered under ``name``; ``backend`` picks the MIP engine.

    With ``presolve`` (the default) it solves the exactly reduced problem of
    ``solvers.presolve`` (ties collapsed, chains and leaves eliminated) and
    reports the expanded plan scored on the original problem.
    """
    try:
        factory = SOLVERS[name]
    except KeyError:
        raise ValueError(
            f"unknown solver {name!r}; accepted: {', '.join(sorted(SOLVERS))}"
        ) from None
    solver = factory(backend)
    if not presolve:
        return solver
    if isinstance(solver, HighsILPSolver):
        solver.highs_presolve = False  # ours already did its work, far more cheaply
    return PresolvingSolver(solver)


__all__ = [
    "BruteForceSolver",
    "CbcILPSolver",
    "HighsILPSolver",
    "Presolved",
    "PresolvingSolver",
    "SOLVERS",
    "Solution",
    "Solver",
    "SolverTimeout",
    "get_solver",
    "presolve",
]
