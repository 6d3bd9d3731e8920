"""Shared assertion for solver tests: one solver's outcome against the oracle's."""

import pytest

from torchtitan_autoparallel.planner.problem.problem import InfeasibleProblem, Problem


def check_outcome(oracle, got, problem: Problem) -> None:
    """``got`` (a Solution or an InfeasibleProblem) agrees with the brute-force ``oracle``."""
    if isinstance(oracle, InfeasibleProblem):
        assert isinstance(got, InfeasibleProblem), got
        return
    assert not isinstance(got, InfeasibleProblem), got
    assert got.status == "optimal"
    assert got.objective == pytest.approx(oracle.objective, rel=1e-9, abs=1e-9)
    assert got.objective == problem.energy(got.assignment)
    assert got.lower_bound == got.objective
    assert problem.is_feasible(got.assignment)
