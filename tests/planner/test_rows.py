"""The exact solve under memory rows: the cheapest plan within every row, on random
problems against enumeration, ties and pins included, and a clear error when no plan fits."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from test_solvers import random_problem

from torchtitan_autoparallel.planner.problem.problem import InfeasibleProblem, Problem
from torchtitan_autoparallel.planner.problem.rows import MemoryRow
from torchtitan_autoparallel.planner.solve.exact.cbc import CbcILPSolver
from torchtitan_autoparallel.planner.solve.rows import solve_with_rows


def random_rows(problem: Problem, seed: int, count: int, tightness: float) -> list[MemoryRow]:
    """Rows over random nodes, each limited ``tightness`` of the way from its least to its most."""
    rng = np.random.default_rng(seed)
    rows = []
    for r in range(count):
        nodes = rng.choice(problem.num_nodes, size=max(2, problem.num_nodes // 2), replace=False)
        terms = {int(v): rng.uniform(0.0, 1e9, size=int(problem.num_strategies[v])) for v in nodes}
        least = sum(t.min() for t in terms.values())
        most = sum(t.max() for t in terms.values())
        rows.append(MemoryRow(terms=terms, const=1e8, limit=1e8 + least + tightness * (most - least), where=f"op{r}"))
    return rows


def enumerate_best(problem: Problem, rows: list[MemoryRow]) -> tuple[float, np.ndarray] | None:
    best = None
    for x in itertools.product(*(range(int(k)) for k in problem.num_strategies)):
        x = np.array(x)
        if any(row.value(x) > row.limit for row in rows):
            continue
        energy = problem.energy(x)
        if np.isfinite(energy) and problem.is_feasible(x, energy=energy) and (best is None or energy < best[0]):
            best = (energy, x)
    return best


@pytest.mark.parametrize("seed", range(10))
def test_rows_solve_finds_the_enumerated_optimum(seed: int) -> None:
    problem = random_problem(seed, num_nodes=(4, 7), inf_fraction=0.1, pins=int(seed % 3 == 0), ties=seed % 2 == 1)
    rows = random_rows(problem, seed, count=1 + seed % 3, tightness=0.3)
    best = enumerate_best(problem, rows)
    if best is None:
        with pytest.raises(InfeasibleProblem):
            solve_with_rows(problem, rows, time_limit=30)
        return
    solution = solve_with_rows(problem, rows, time_limit=30)
    assert solution.objective == pytest.approx(best[0], rel=1e-9)
    assert all(row.value(solution.assignment) <= row.limit * (1 + 1e-6) for row in rows)
    assert solution.lower_bound <= solution.objective + 1e-9


def test_the_rows_move_the_plan() -> None:
    """A row the unconstrained optimum breaks: the plan changes and costs more."""
    for seed in range(40):
        problem = random_problem(100 + seed, num_nodes=(5, 7), inf_fraction=0.0)
        rows = random_rows(problem, seed, count=1, tightness=0.2)
        free = enumerate_best(problem, [])
        if rows[0].value(free[1]) > rows[0].limit and enumerate_best(problem, rows) is not None:
            break
    else:
        pytest.fail("no random problem whose optimum breaks its row")
    solution = solve_with_rows(problem, rows, time_limit=30, solver=CbcILPSolver())
    assert rows[0].value(solution.assignment) <= rows[0].limit * (1 + 1e-6)
    assert solution.objective > free[0]


def test_a_row_no_plan_meets_names_the_least_it_can_hold() -> None:
    problem = random_problem(3, num_nodes=(4, 4), inf_fraction=0.0)
    terms = {v: np.full(int(problem.num_strategies[v]), 2**30) for v in range(problem.num_nodes)}
    row = MemoryRow(terms=terms, const=0.0, limit=2 * 2**30, where="mm_7")
    with pytest.raises(InfeasibleProblem, match=r"no plan fits 2\.00 GiB per device at mm_7: it holds at least 4\.00 GiB"):
        solve_with_rows(problem, [row], time_limit=30)
