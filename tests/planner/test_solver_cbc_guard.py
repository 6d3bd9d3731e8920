"""CBC keeps its time limit: on a model whose root LP alone outlasts the limit, the
subprocess is stopped and the best known plan comes back, unproven, in time."""

from __future__ import annotations

import time

import numpy as np
import pytest
from test_solvers import uniform_problem

from torchtitan_autoparallel.planner.problem.problem import Problem
from torchtitan_autoparallel.planner.solve import CbcILPSolver
from torchtitan_autoparallel.planner.solve.exact.cbc import CBC_OVERRUN_S, CBC_STOP_WAIT_S
from torchtitan_autoparallel.planner.solve.exact.model import build_ilp

LIMIT_S = 1.0
# writing the MPS file and reading back the plan, on a busy machine
SLACK_S = 4.0


def dense_problem(seed: int = 0, n: int = 200, k: int = 8, degree: int = 3) -> Problem:
    """~40k columns: unguarded, CBC (2.10) spends tens of seconds in its root LP
    whatever ``-sec`` says, so only the guard can bring it back in time."""
    rng = np.random.default_rng(seed)
    edges = np.array([(int(rng.integers(0, v)), v) for v in range(1, n) for _ in range(degree)])
    memory = [rng.uniform(1e8, 4e9, size=k) for _ in range(n)]
    problem = uniform_problem(rng, n, k, edges, memory)
    # binding, yet loose enough for the greedy warm start to fit
    problem.memory_budget = float(sum(np.median(m) for m in memory))
    return problem


def test_cbc_overrun_is_stopped_and_returns_the_best_known_plan(caplog) -> None:
    problem = dense_problem()
    assert build_ilp(problem).start is not None  # the plan the guard falls back on
    start = time.perf_counter()
    with caplog.at_level("WARNING", logger="torchtitan_autoparallel.planner"):
        result = CbcILPSolver().solve(problem, time_limit=LIMIT_S)
    elapsed = time.perf_counter() - start
    assert elapsed < LIMIT_S + CBC_OVERRUN_S + CBC_STOP_WAIT_S + SLACK_S, elapsed
    assert "past its" in caplog.text  # the guard, not CBC itself, ended the run
    assert result.status == "time_limit"
    assert problem.is_feasible(result.assignment)
    assert problem.memory_used(result.assignment) <= problem.memory_budget
    assert result.objective == pytest.approx(problem.energy(result.assignment), rel=1e-12)
    assert result.lower_bound <= result.objective
