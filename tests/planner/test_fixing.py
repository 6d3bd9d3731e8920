"""Reduced-cost fixing (``solvers.fixing``) and the exact solver's path through it."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from torchtitan_autoparallel.planner.problem.problem import Problem
from torchtitan_autoparallel.planner.solve import (
    BruteForceSolver,
    CertifyingSolver,
    HighsILPSolver,
    Solution,
    get_solver,
)
from torchtitan_autoparallel.planner.solve.exact.fixing import Relaxation, fixed_columns
from torchtitan_autoparallel.planner.solve.exact.model import build_ilp


def frustrated_problem(seed: int, n: int = 5, k: int = 3, budget: bool = False) -> Problem:
    """A complete graph whose edges penalise equal strategies: its LP is mostly fractional."""
    rng = np.random.default_rng(seed)
    edges = np.array([(u, v) for u in range(n) for v in range(u + 1, n)])
    memory = [rng.uniform(1.0, 4.0, size=k) for _ in range(n)]
    lo, hi = sum(m.min() for m in memory), sum(m.max() for m in memory)
    return Problem(
        node_names=[f"op{i}" for i in range(n)],
        strategy_labels=[[str(j) for j in range(k)]] * n,
        unary=[rng.uniform(0, 10, size=k) for _ in range(n)],
        edges=edges,
        pairwise=[rng.uniform(0, 5, size=(k, k)) + 20 * rng.random() * np.eye(k) for _ in edges],
        memory=memory if budget else [],
        memory_budget=0.5 * (lo + hi) if budget else None,
    )


def _plans(problem: Problem):
    for plan in itertools.product(*(range(len(u)) for u in problem.unary)):
        x = np.array(plan, dtype=np.int64)
        if problem.is_feasible(x):
            yield x


@pytest.mark.parametrize("budget", [False, True], ids=["free", "budget"])
def test_fixed_columns_never_belong_to_a_cheaper_plan(budget: bool) -> None:
    fractional = fixed_total = 0
    for seed in range(20):
        problem = frustrated_problem(seed, budget=budget)
        model = build_ilp(problem)
        lp = HighsILPSolver()._run_lp(model, None)
        if not isinstance(lp, Relaxation):
            continue
        fractional += 1
        costs = {tuple(x): problem.energy(x) - model.offset for x in _plans(problem)}
        best, spread = min(costs.values()), max(costs.values()) - min(costs.values())
        # known plans from just above the optimum upwards: whatever beats one must survive
        for share in (1e-6, 0.01, 0.05, 0.3):
            upper = best + share * spread
            fixed = fixed_columns(model, lp, upper)
            fixed_total += int(fixed.sum())
            for plan, cost in costs.items():
                if cost < upper:
                    used = model.col_values(np.array(plan)) > 0.5
                    assert not (fixed & used).any(), (seed, share, plan)
    assert fractional >= 10  # the property was exercised on fractional LPs
    assert fixed_total > 0  # and fixing removed something


@pytest.mark.parametrize("seed", range(6))
def test_exact_solver_proves_the_optimum_through_fixing(seed: int, caplog) -> None:
    problem = frustrated_problem(seed, n=6, budget=seed % 2 == 1)
    oracle = BruteForceSolver().solve(problem)
    with caplog.at_level("INFO", logger="torchtitan_autoparallel.planner"):
        got = HighsILPSolver().solve(problem, time_limit=30)
    assert got.status == "optimal"
    assert got.objective == pytest.approx(oracle.objective, rel=1e-9)
    assert got.lower_bound == got.objective == problem.energy(got.assignment)
    if "LP relaxation is integral" not in caplog.text:
        assert "reduced costs fix" in caplog.text


def test_unfinished_lp_hands_the_rest_to_the_approximate_solver(monkeypatch, caplog) -> None:
    problem = frustrated_problem(3, n=6, budget=True)
    monkeypatch.setattr(HighsILPSolver, "_run_lp", lambda self, model, limit: None)
    with caplog.at_level("WARNING", logger="torchtitan_autoparallel.planner"):
        got = HighsILPSolver().solve(problem, time_limit=10)
    assert "the approximate solver gets the time left" in caplog.text
    assert got.objective == problem.energy(got.assignment)
    assert problem.is_feasible(got.assignment)
    assert got.lower_bound <= got.objective + 1e-9
    # a plan that meets its bound is called optimal, whichever path found it
    met = got.objective - got.lower_bound <= 1e-9 * abs(got.objective)
    assert got.status == ("optimal" if met else "time_limit")
    assert got.objective <= BruteForceSolver().solve(problem).objective * 1.05


@pytest.mark.parametrize("seed", range(4))
def test_optimality_check_certifies_the_true_gap(seed: int) -> None:
    problem = frustrated_problem(seed, n=6, budget=seed % 2 == 0)
    optimum = BruteForceSolver().solve(problem).objective
    # a poor plan (the cheapest unary choices) and a good one (approx), both checked
    greedy = CertifyingSolver(_FixedPlan(problem)).solve(problem, time_limit=30)
    approx = get_solver("approx", optimality_check=True).solve(problem, time_limit=30)
    for got in (greedy, approx):
        assert got.lower_bound == pytest.approx(optimum, rel=1e-9)  # the optimum itself
        assert (got.status == "optimal") == (got.objective == pytest.approx(optimum, rel=1e-9))


class _FixedPlan:
    """A 'solver' that returns the first feasible plan in enumeration order."""

    name = "fixed-plan"

    def __init__(self, problem: Problem) -> None:
        self.plan = next(_plans(problem))

    def solve(self, problem: Problem, time_limit: float | None = None) -> Solution:
        energy = problem.energy(self.plan)
        return Solution(self.plan, energy, -math.inf, self.name, "feasible", 0.0)
