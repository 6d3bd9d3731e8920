"""Solvers of the sharding ``Problem``; pick one by name with ``get_solver``."""

from __future__ import annotations

from collections.abc import Callable

from torchtitan_autoparallel.planner.solvers.base import Solution, Solver
from torchtitan_autoparallel.planner.solvers.brute_force import BruteForceSolver
from torchtitan_autoparallel.planner.solvers.ilp import CbcILPSolver, HighsILPSolver, SolverTimeout

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


def get_solver(name: str, backend: str = "highs") -> Solver:
    """The solver registered under ``name``; ``backend`` picks the MIP engine."""
    try:
        factory = SOLVERS[name]
    except KeyError:
        raise ValueError(
            f"unknown solver {name!r}; accepted: {', '.join(sorted(SOLVERS))}"
        ) from None
    return factory(backend)


__all__ = [
    "BruteForceSolver",
    "CbcILPSolver",
    "HighsILPSolver",
    "SOLVERS",
    "Solution",
    "Solver",
    "SolverTimeout",
    "get_solver",
]
