"""The exact solvers agree with brute force and honour every constraint."""

from __future__ import annotations

import re

import numpy as np
import pytest
from _solver_checks import check_outcome

from torchtitan_autoparallel.planner.problem.problem import InfeasibleProblem, Problem
from torchtitan_autoparallel.planner.solve import (
    BruteForceSolver,
    CbcILPSolver,
    HighsILPSolver,
    get_solver,
)
from torchtitan_autoparallel.planner.solve.exact.model import build_ilp

EXACT = [HighsILPSolver(), CbcILPSolver()]


def random_problem(
    seed: int,
    *,
    num_nodes: tuple[int, int] = (3, 8),
    inf_fraction: float = 0.15,
    memory: bool = False,
    pins: int = 0,
    ties: bool = False,
) -> Problem:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(num_nodes[0], num_nodes[1] + 1))
    k = rng.integers(2, 5, size=n)
    if ties:  # tied nodes need equal strategy counts
        k[:] = k[0]
    edges = [(u, v) for u in range(n) for v in range(u + 1, n) if rng.random() < 0.5] or [(0, 1)]
    pairwise = []
    for u, v in edges:
        table = rng.uniform(0.0, 50.0, size=(k[u], k[v]))
        table[rng.random(table.shape) < inf_fraction] = np.inf
        pairwise.append(table)
    mem = [rng.uniform(1e8, 4e9, size=kv) if rng.random() < 0.7 else None for kv in k]
    pin_nodes = rng.choice(n, size=min(pins, n), replace=False)
    groups = [list(range(0, n, 2)), [1, n - 1]] if ties and n > 3 else []
    return Problem(
        node_names=[f"op{i}" for i in range(n)],
        strategy_labels=[[f"S{j}" for j in range(kv)] for kv in k],
        unary=[rng.uniform(0.0, 100.0, size=kv) for kv in k],
        edges=np.array(edges),
        pairwise=pairwise,
        memory=mem if memory else [],
        pins={int(v): int(rng.integers(k[v])) for v in pin_nodes},
        ties=groups,
    )


def solve_all(problem: Problem):
    """Each solver's Solution, or the InfeasibleProblem it raised."""
    results = []
    for solver in [BruteForceSolver(), *EXACT]:
        try:
            results.append(solver.solve(problem, time_limit=30))
        except InfeasibleProblem as exc:
            results.append(exc)
    return results


def assert_agree(problem: Problem) -> list:
    oracle, *others = solve_all(problem)
    for got in others:
        check_outcome(oracle, got, problem)
    return [oracle, *others]


@pytest.mark.parametrize("seed", range(12))
def test_random_problems_agree_with_brute_force(seed: int) -> None:
    assert_agree(random_problem(seed))


@pytest.mark.parametrize("seed", range(8))
def test_pins_and_ties_are_honoured(seed: int) -> None:
    # some seeds are infeasible (a pin clashes with a tie): the solvers must agree on that too
    problem = random_problem(100 + seed, num_nodes=(5, 8), inf_fraction=0.02, pins=2, ties=True)
    for result in assert_agree(problem):
        if isinstance(result, InfeasibleProblem):
            continue
        x = result.assignment
        assert all(x[v] == s for v, s in problem.pins.items())
        assert all(len({x[v] for v in group}) == 1 for group in problem.ties)


def _budget_between(problem: Problem) -> tuple[float, float]:
    """A budget that binds (below the free optimum's memory) yet stays feasible."""
    free = HighsILPSolver().solve(problem)
    problem.memory_budget = 0.0
    with pytest.raises(InfeasibleProblem) as info:
        HighsILPSolver().solve(problem)
    minimum = float(re.search(r"\((\d+) bytes\)", str(info.value)).group(1))
    return minimum, problem.memory_used(free.assignment)


@pytest.mark.parametrize("seed", range(4))
def test_memory_budget_is_honoured(seed: int) -> None:
    problem = random_problem(200 + seed, inf_fraction=0.0, memory=True)
    minimum, free_use = _budget_between(problem)
    problem.memory_budget = 0.5 * (minimum + free_use)
    for result in assert_agree(problem):
        assert problem.memory_used(result.assignment) <= problem.memory_budget


@pytest.mark.parametrize("solver", [*EXACT, BruteForceSolver()], ids=lambda s: s.name)
def test_too_small_budget_names_the_smallest_feasible_one(solver) -> None:
    problem = random_problem(300, inf_fraction=0.1, memory=True)
    oracle = BruteForceSolver()
    problem.memory_budget = 1.0
    with pytest.raises(InfeasibleProblem, match=r"smallest feasible budget [0-9.]+ GiB") as info:
        solver.solve(problem)
    needed = float(re.search(r"\((\d+) bytes\)", str(info.value)).group(1))
    gib = float(re.search(r"budget ([0-9.]+) GiB \(", str(info.value)).group(1))
    assert gib * 2**30 >= needed
    problem.memory_budget = needed  # the quoted figure is feasible ...
    assert problem.memory_used(solver.solve(problem).assignment) <= needed * (1 + 1e-6)
    problem.memory_budget = needed * (1 - 1e-4)  # ... and nothing smaller is
    with pytest.raises(InfeasibleProblem):
        oracle.solve(problem)


def test_infeasible_without_memory_says_so() -> None:
    problem = random_problem(7, inf_fraction=0.0)
    problem.pairwise[0][:] = np.inf  # no pair of choices is allowed on this edge
    for result in solve_all(problem):
        assert isinstance(result, InfeasibleProblem)
        assert "GiB" not in str(result)


def test_saved_problem_resolves_to_the_same_objective(tmp_path) -> None:
    problem = random_problem(400, inf_fraction=0.0, memory=True, pins=1, ties=True)
    problem.memory_budget = 1e12
    before = HighsILPSolver().solve(problem)
    problem.save(tmp_path / "problem.npz")
    loaded = Problem.load(tmp_path / "problem.npz")
    for solver in EXACT:
        after = solver.solve(loaded)
        assert after.objective == pytest.approx(before.objective, rel=1e-9)
        assert after.objective == loaded.energy(after.assignment)


def test_zero_and_self_loop_edges() -> None:
    problem = random_problem(500, inf_fraction=0.0)
    k = problem.num_strategies
    u, v = problem.edges[0]
    problem.pairwise[0] = np.zeros((k[u], k[v]))
    problem.edges = np.vstack([problem.edges, [[u, u]]])
    problem.pairwise.append(np.random.default_rng(0).uniform(0, 80, size=(k[u], k[u])))
    model = build_ilp(problem)
    assert len(model.y_pair) == sum(t.size for t in problem.pairwise[1:-1])
    assert_agree(problem)


def uniform_problem(rng: np.random.Generator, n: int, k: int, edges: np.ndarray,
                    memory: list[np.ndarray] | None = None) -> Problem:
    """``n`` nodes of ``k`` strategies on ``edges``, unary and pairwise costs uniform at random."""
    return Problem(
        node_names=[f"op{i}" for i in range(n)],
        strategy_labels=[[str(j) for j in range(k)]] * n,
        unary=[rng.uniform(0, 100, size=k) for _ in range(n)],
        edges=edges,
        pairwise=[rng.uniform(0, 50, size=(k, k)) for _ in edges],
        memory=memory or [],
    )


@pytest.mark.parametrize("solver", EXACT, ids=lambda s: s.name)
def test_time_limit_returns_an_incumbent(solver) -> None:
    rng = np.random.default_rng(9)
    n, k = 300, 8
    edges = np.array([(v - 1 - int(rng.integers(0, min(v, 4))), v) for v in range(1, n)])
    problem = uniform_problem(rng, n, k, edges)
    result = solver.solve(problem, time_limit=0.2)
    assert result.status in ("time_limit", "optimal")
    assert result.objective == problem.energy(result.assignment)
    assert result.lower_bound <= result.objective + 1e-6
    assert result.seconds < 30


def test_get_solver_registry() -> None:
    assert get_solver("ilp").name == "ilp-highs"
    assert get_solver("ilp", backend="cbc").name == "ilp-cbc"
    assert get_solver("brute-force").name == "brute-force"
    with pytest.raises(ValueError, match="accepted: approx, auto, brute-force, ilp$"):
        get_solver("simplex")
    with pytest.raises(ValueError, match="backend"):
        get_solver("ilp", backend="gurobi")


def test_brute_force_refuses_huge_problems() -> None:
    problem = random_problem(1, num_nodes=(8, 8))
    with pytest.raises(ValueError, match="use the 'ilp' solver"):
        BruteForceSolver(max_combinations=10).solve(problem)


@pytest.mark.parametrize("solver", EXACT, ids=lambda s: s.name)
def test_start_and_end_are_logged(solver, caplog) -> None:
    with caplog.at_level("INFO", logger="torchtitan_autoparallel.planner"):
        solver.solve(random_problem(0))
    assert re.search(r"\d+ variables \(\d+ binary\), \d+ constraints", caplog.text)
    assert re.search(r"optimal, objective [0-9.e+]+ us", caplog.text)


def test_fractional_lp_relaxation_falls_back_to_the_mip(caplog) -> None:
    # a frustrated triangle: equal neighbours cost 1, so every plan costs >= 1,
    # while the LP relaxation reaches 0 with every x at 1/2
    problem = Problem(
        node_names=["a", "b", "c"],
        strategy_labels=[["S0", "S1"]] * 3,
        unary=[np.zeros(2)] * 3,
        edges=np.array([(0, 1), (1, 2), (0, 2)]),
        pairwise=[np.eye(2)] * 3,
    )
    with caplog.at_level("INFO", logger="torchtitan_autoparallel.planner"):
        result = HighsILPSolver().solve(problem)
    assert "LP relaxation is integral" not in caplog.text
    assert result.status == "optimal" and result.objective == 1.0
