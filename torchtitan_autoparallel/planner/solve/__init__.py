"""Solvers of the sharding ``Problem``: pick one by name with ``get_solver``.

The parts, each importing only those before it:

* ``base``: the one interface, ``Solution`` and the ``Solver`` protocol;
* ``presolve/``: exact reductions every solver runs first (tie collapse,
  dominated strategies, chains and leaves) and their compiled loops;
* ``approx/``: the approximate solver (an MRF, TRW-S, local search);
* ``exact/``: the ILP model on HiGHS or CBC, the LP bound and the optimality
  certificate, reduced-cost fixing, LP rounding;
* ``overlap/``: the same problem with compute/communication overlap priced;
* ``registry``: the one place they are composed (name -> solver, ``auto``);
* ``brute_force``: enumeration, the tests' oracle.
"""

from __future__ import annotations

from torchtitan_autoparallel.planner.solve.approx.solver import ApproxSolver
from torchtitan_autoparallel.planner.solve.base import Solution, Solver, SolverTimeout
from torchtitan_autoparallel.planner.solve.brute_force import BruteForceSolver
from torchtitan_autoparallel.planner.solve.exact.cbc import CbcILPSolver
from torchtitan_autoparallel.planner.solve.exact.ilp import HighsILPSolver
from torchtitan_autoparallel.planner.solve.exact.lp_bound import CertifyingSolver
from torchtitan_autoparallel.planner.solve.presolve.pipeline import Presolved, PresolvingSolver
from torchtitan_autoparallel.planner.solve.registry import (
    SOLVERS,
    AutoSolver,
    get_solver,
    overlap_solver,
)

__all__ = [
    "ApproxSolver",
    "AutoSolver",
    "BruteForceSolver",
    "CbcILPSolver",
    "CertifyingSolver",
    "HighsILPSolver",
    "Presolved",
    "PresolvingSolver",
    "SOLVERS",
    "Solution",
    "Solver",
    "SolverTimeout",
    "get_solver",
    "overlap_solver",
]
