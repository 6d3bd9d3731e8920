"""The exact presolve: tie collapsing and graph reductions keep the optimum."""

from __future__ import annotations

import re

import numpy as np
import pytest
from _solver_checks import check_outcome

from torchtitan_autoparallel.planner.problem.problem import InfeasibleProblem, Problem
from torchtitan_autoparallel.planner.solve import (
    BruteForceSolver,
    HighsILPSolver,
    PresolvingSolver,
    get_solver,
)
from torchtitan_autoparallel.planner.solve.presolve import reduce
from torchtitan_autoparallel.planner.solve.presolve.collapse import collapse_ties
from torchtitan_autoparallel.planner.solve.presolve.kernels import (
    dominated,
    first_argmin_plus,
    min_plus,
    scan,
    separable,
)
from torchtitan_autoparallel.planner.solve.presolve.pipeline import presolve
from torchtitan_autoparallel.planner.solve.presolve.reduce import beaten, swap_difference


def make_problem(
    rng: np.random.Generator,
    edges: list[tuple[int, int]],
    k: np.ndarray,
    *,
    inf_fraction: float = 0.0,
    memory: np.ndarray | None = None,
    pins: dict[int, int] | None = None,
    ties: list[list[int]] | None = None,
    budget: float | None = None,
) -> Problem:
    tables = []
    for u, v in edges:
        table = rng.uniform(0.0, 50.0, size=(k[u], k[v]))
        table[rng.random(table.shape) < inf_fraction] = np.inf
        tables.append(table)
    has_memory = np.zeros(len(k), bool) if memory is None else memory
    return Problem(
        node_names=[f"op{i}" for i in range(len(k))],
        strategy_labels=[[f"S{j}" for j in range(kv)] for kv in k],
        unary=[rng.uniform(0.0, 100.0, size=kv) for kv in k],
        edges=np.array(edges, dtype=np.int64).reshape(-1, 2),
        pairwise=tables,
        memory=[rng.uniform(1e8, 4e9, size=kv) if h else None for h, kv in zip(has_memory, k)],
        memory_budget=budget,
        pins=pins or {},
        ties=ties or [],
    )


def random_problem(seed: int, *, memory: bool = False, pins: int = 0) -> Problem:
    """A few tied copies of a random block plus loose nodes, with random extra edges."""
    rng = np.random.default_rng(seed)
    copies, block, loose = int(rng.integers(1, 4)), int(rng.integers(2, 5)), int(rng.integers(2, 5))
    n = copies * block + loose
    k = rng.integers(2, 5, size=n)
    k[: copies * block] = np.tile(k[:block], copies)
    # sparse problems vanish in presolve; dense ones leave a core for the ILP
    density = rng.choice([0.3, 0.9])
    edges = [(u, v) for u in range(n) for v in range(n) if u != v and rng.random() < density / 2]
    ties = [list(range(j, copies * block, block)) for j in range(block)] if copies > 1 else []
    pin_nodes = rng.choice(n, size=pins, replace=False)
    return make_problem(
        rng,
        edges or [(0, 1)],
        k,
        inf_fraction=rng.choice([0.0, 0.1]),
        memory=rng.random(n) < 0.4 if memory else None,
        pins={int(v): int(rng.integers(k[v])) for v in pin_nodes},
        ties=ties,
    )


def outcome(solver, problem: Problem):
    try:
        return solver.solve(problem, time_limit=60)
    except InfeasibleProblem as exc:
        return exc


def assert_presolve_agrees(problem: Problem) -> None:
    oracle = outcome(BruteForceSolver(), problem)
    plain = outcome(get_solver("ilp", presolve=False), problem)
    # without dead-end elimination more of the problem is left for the ILP
    no_dee = outcome(PresolvingSolver(HighsILPSolver(), dominance=False), problem)
    for got in (outcome(get_solver("ilp"), problem), no_dee, plain):
        check_outcome(oracle, got, problem)


def binding_budget(problem: Problem) -> float:
    """Half way between the least memory of any plan and that of the free optimum."""
    free = get_solver("ilp", presolve=False).solve(problem)
    problem.memory_budget = 0.0
    with pytest.raises(InfeasibleProblem) as info:
        HighsILPSolver().solve(problem)
    minimum = float(re.search(r"\((\d+) bytes\)", str(info.value)).group(1))
    return 0.5 * (minimum + problem.memory_used(free.assignment))


# --- exactness on random problems ------------------------------------------


@pytest.mark.parametrize("seed", range(16))
def test_collapsed_energy_equals_original(seed: int) -> None:
    problem = random_problem(seed, memory=True)
    collapsed, group_of = collapse_ties(problem)
    rng = np.random.default_rng(seed)
    for _ in range(20):
        x = np.array([rng.integers(k) for k in collapsed.num_strategies])
        assert collapsed.energy(x) == pytest.approx(problem.energy(x[group_of]), rel=1e-12)
        assert collapsed.memory_used(x) == pytest.approx(problem.memory_used(x[group_of]))


@pytest.mark.parametrize("seed", range(16))
def test_reduced_energy_plus_offset_equals_expanded(seed: int) -> None:
    problem = random_problem(seed, memory=True, pins=1)
    problem.memory_budget = 1e30  # slack: memory holders may be eliminated too
    try:
        pre = presolve(problem)
    except InfeasibleProblem:
        return
    rng = np.random.default_rng(seed)
    for _ in range(20):
        x = np.array([rng.integers(k) for k in pre.reduced.num_strategies], dtype=np.int64)
        full = pre.expand(x)
        reduced = pre.reduced.energy(x) + pre.offset
        if np.isfinite(reduced):
            assert problem.energy(full) == pytest.approx(reduced, rel=1e-9)
            assert all(full[v] == s for v, s in problem.pins.items())
            assert all(len({full[v] for v in g}) == 1 for g in problem.ties)


@pytest.mark.parametrize("seed", range(24))
def test_presolved_optimum_matches_brute_force(seed: int) -> None:
    assert_presolve_agrees(random_problem(100 + seed, pins=seed % 3))


@pytest.mark.parametrize("seed", range(8))
def test_presolved_optimum_under_a_binding_budget(seed: int) -> None:
    problem = random_problem(200 + seed, memory=True)
    problem.memory_budget = None
    if not any(m is not None for m in problem.memory):
        problem.memory[0] = np.linspace(1e9, 2e9, len(problem.unary[0]))
    try:
        problem.memory_budget = binding_budget(problem)
    except InfeasibleProblem:
        return  # no finite plan at all
    assert_presolve_agrees(problem)
    pre = presolve(problem)
    if pre.reduced.memory_budget is not None:  # the reduced memory is the original's
        rng = np.random.default_rng(seed)
        for _ in range(10):
            x = np.array([rng.integers(k) for k in pre.reduced.num_strategies], dtype=np.int64)
            expected = problem.memory_used(pre.expand(x))
            assert pre.reduced.memory_used(x) == pytest.approx(expected, rel=1e-12)


def test_too_small_budget_still_names_the_smallest_one() -> None:
    problem = random_problem(7, memory=True)
    problem.memory[0] = np.linspace(1e9, 2e9, len(problem.unary[0]))
    problem.memory_budget = 1.0
    with pytest.raises(InfeasibleProblem, match=r"smallest feasible budget") as info:
        get_solver("ilp").solve(problem)
    needed = float(re.search(r"\((\d+) bytes\)", str(info.value)).group(1))
    problem.memory_budget = needed
    assert problem.memory_used(get_solver("ilp").solve(problem).assignment) <= needed * (1 + 1e-6)


def test_conflicting_pins_in_a_tie_group_are_infeasible() -> None:
    rng = np.random.default_rng(0)
    problem = make_problem(rng, [(0, 1), (1, 2)], np.array([3, 3, 3]), pins={0: 0, 2: 1},
                           ties=[[0, 2]])
    with pytest.raises(InfeasibleProblem, match="pinned"):
        presolve(problem)
    assert isinstance(outcome(BruteForceSolver(), problem), InfeasibleProblem)


# --- each reduction on its own ---------------------------------------------


def test_chain_is_eliminated_entirely() -> None:
    rng = np.random.default_rng(1)
    k = rng.integers(2, 6, size=9)
    problem = make_problem(rng, [(i, i + 1) for i in range(8)], k, inf_fraction=0.1)
    assert presolve(problem, dominance=False).reduced.num_nodes == 0
    assert_presolve_agrees(problem)


def test_chain_reduces_to_its_memory_holders() -> None:
    # holders 2 and 4 under a budget that binds them jointly; the rest is eliminated
    rng = np.random.default_rng(2)
    problem = make_problem(rng, [(i, i + 1) for i in range(6)], np.full(7, 3),
                           memory=np.isin(np.arange(7), [2, 4]), budget=4e9)
    problem.memory[2] = problem.memory[4] = np.array([1e9, 2e9, 3e9])
    pre = presolve(problem, dominance=False)
    assert pre.reduced.node_names == ["op2", "op4"]  # their edge may fold (separable)
    assert_presolve_agrees(problem)


def test_stars_reduce_to_their_centres() -> None:
    rng = np.random.default_rng(3)
    k = np.array([4, 3, 2, 4, 3, 3, 2, 4])
    edges = [(0, v) for v in range(1, 5)] + [(5, 6), (7, 5)]
    problem = make_problem(rng, edges, k, memory=np.isin(np.arange(8), [0, 5]),
                           inf_fraction=0.1, budget=4e9)
    problem.memory[0] = np.array([1e9, 2e9, 3e9, 4e9])  # 4e9 never fits: pruned
    problem.memory[5] = np.array([1e9, 2e9, 3e9])
    pre = presolve(problem, dominance=False)
    assert pre.reduced.node_names == ["op0", "op5"] and len(pre.reduced.edges) == 0
    assert pre.reduced.strategy_labels[0] == ["S0", "S1", "S2"]
    assert_presolve_agrees(problem)


def test_link_merges_into_an_existing_edge() -> None:
    # a 4-cycle plus a chord: eliminating 1 (between 0 and 2) sums into the chord 0-2
    rng = np.random.default_rng(4)
    problem = make_problem(rng, [(0, 1), (1, 2), (2, 3), (3, 0), (0, 2)], np.full(4, 3))
    assert presolve(problem, dominance=False).reduced.num_nodes == 0
    assert_presolve_agrees(problem)


def test_link_that_would_grow_the_problem_is_kept() -> None:
    # k_u * k_w = 64 > k_v * (k_u + k_w) = 32: the middle node of 0 - 1 - 2 stays
    # (as do 3 and 4, the other two paths that keep 0 and 2 from being leaves)
    rng = np.random.default_rng(5)
    k = np.array([8, 2, 8, 2, 2])
    edges = [(0, 1), (1, 2), (0, 3), (3, 2), (0, 4), (4, 2)]
    problem = make_problem(rng, edges, k)
    pre = presolve(problem, dominance=False)
    assert pre.reduced.num_nodes == 5
    assert_presolve_agrees(problem)


def test_pinned_node_is_fixed_into_its_neighbours() -> None:
    rng = np.random.default_rng(6)
    problem = make_problem(rng, [(0, 1), (1, 2), (2, 0)], np.full(3, 4),
                           memory=np.array([0, 1, 1], bool), pins={0: 2})
    problem.memory_budget = 1e30
    pre = presolve(problem, dominance=False)
    assert "op0" not in pre.reduced.node_names
    assert pre.expand(np.zeros(pre.reduced.num_nodes, np.int64))[0] == 2
    assert_presolve_agrees(problem)


def _clique(rng: np.random.Generator, k: int = 4) -> Problem:
    """Four memory holders, all connected: nothing but dominance/separability applies."""
    edges = [(u, v) for u in range(4) for v in range(u + 1, 4)]
    problem = make_problem(rng, edges, np.full(4, k), memory=np.ones(4, bool))
    problem.memory_budget = float(sum(m.max() for m in problem.memory)) * 0.95
    return problem


def test_dominated_strategy_is_dropped() -> None:
    problem = _clique(np.random.default_rng(7))
    problem.unary[0][1] = problem.unary[0][0] + 5.0
    problem.memory[0][1] = problem.memory[0][0] + 1.0
    for e, (u, v) in enumerate(problem.edges):
        if u == 0:
            problem.pairwise[e][1] = problem.pairwise[e][0] + 1.0
    assert len(presolve(problem, dominance=False).reduced.strategy_labels[0]) == 4
    assert_strategy_dropped(problem, 0, "S1")
    assert_presolve_agrees(problem)


def assert_strategy_dropped(problem: Problem, node: int, label: str) -> None:
    reduced = presolve(problem).reduced
    name = problem.node_names[node]
    if name in reduced.node_names:  # the node itself may go too, once it has one strategy
        assert label not in reduced.strategy_labels[reduced.node_names.index(name)]


def test_dead_end_elimination_beyond_entrywise_dominance() -> None:
    # S1 beats S0 in some table entries, yet its unary costs more than it can win back
    problem = _clique(np.random.default_rng(10))
    problem.memory[0][1] = problem.memory[0][0]
    for e, (u, v) in enumerate(problem.edges):
        if u == 0:
            problem.pairwise[e][1] = problem.pairwise[e][0] + np.linspace(-10, 10, 4)
    problem.unary[0][1] = problem.unary[0][0] + 31.0
    assert_strategy_dropped(problem, 0, "S1")
    assert_presolve_agrees(problem)


def test_separable_table_moves_into_the_unaries() -> None:
    problem = _clique(np.random.default_rng(8))
    a, b = np.arange(4.0), np.array([3.0, 1.0, 4.0, 1.5])
    problem.pairwise[0] = a[:, None] + b[None, :]
    assert len(presolve(problem, dominance=False).reduced.edges) == 5
    assert_presolve_agrees(problem)


def test_tied_chained_blocks_reduce_to_one_block() -> None:
    """k copies of a 4-node block, each feeding the next: one block plus its back edge."""
    rng = np.random.default_rng(9)
    block = [(0, 1), (0, 2), (1, 3), (2, 3), (0, 3)]
    copies, size = 5, 4
    edges = [(u + c * size, v + c * size) for c in range(copies) for u, v in block]
    edges += [(3 + c * size, (c + 1) * size) for c in range(copies - 1)]
    k = np.tile([3, 2, 3, 2], copies)
    ties = [list(range(j, copies * size, size)) for j in range(size)]
    problem = make_problem(rng, edges, k, ties=ties, memory=np.tile([1, 1, 1, 1], copies) > 0)
    problem.memory_budget = 1e30
    collapsed, _ = collapse_ties(problem)
    assert collapsed.num_nodes == size
    assert len(collapsed.edges) == len(block)  # the back edge 3 -> 0 is summed into 0 - 3
    assert presolve(problem).reduced.num_nodes <= size
    assert_presolve_agrees(problem)


# --- the fast paths of the costly reductions ---------------------------------


def _wide_problem(seed: int) -> Problem:
    """Nodes with more strategies than ``kernels.SCAN_BLOCK`` columns, many of them
    near-copies of another strategy, so that dominance has pairs to decide."""
    rng = np.random.default_rng(seed)
    k = np.array([24, 20, 30, 18])
    edges = [(0, 1), (0, 2), (1, 2), (2, 3), (0, 3)]
    problem = make_problem(rng, edges, k, inf_fraction=0.05, memory=np.array([1, 0, 1, 0], bool))
    for v in range(len(k)):
        twins = rng.choice(k[v], size=k[v] // 2, replace=False)
        for s, t in zip(twins[::2], twins[1::2]):  # s copies t, a little worse or better
            problem.unary[v][s] = problem.unary[v][t] + rng.uniform(-3.0, 3.0)
            if problem.memory[v] is not None:
                problem.memory[v][s] = problem.memory[v][t] + rng.choice([-1.0, 0.0, 1.0])
            for e, (a, b) in enumerate(problem.edges.tolist()):
                if v in (a, b):
                    table = problem.pairwise[e] if a == v else problem.pairwise[e].T
                    table[s] = table[t] + rng.uniform(-1.0, 2.0, size=table.shape[1])
    return problem


def _dominated_by_full_check(graph, v: int) -> np.ndarray:  # noqa: ANN001 (reduce.Graph)
    """Dead-end elimination as its formula reads: every pair, every column."""

    unary = graph.unary[v]
    margin = unary[:, None] - unary[None, :]
    for table in graph.adj[v].values():
        margin = margin + swap_difference(table[:, None, :], table[None, :, :], False).min(axis=2)
    return beaten(margin, graph.memory[v])


@pytest.mark.parametrize("seed", range(6))
def test_compiled_dominance_drops_exactly_what_the_full_check_drops(seed: int) -> None:
    problem = _wide_problem(seed)
    graph = reduce.Graph(problem)
    for v in range(problem.num_nodes):
        np.testing.assert_array_equal(graph._dominated(v), _dominated_by_full_check(graph, v))
    assert sum(int(_dominated_by_full_check(graph, v).sum()) for v in range(problem.num_nodes))


@pytest.mark.parametrize("seed", range(3))
def test_presolve_of_wide_nodes_keeps_the_optimum(seed: int) -> None:
    problem = _wide_problem(seed)
    problem.memory_budget = binding_budget(problem)
    assert_presolve_agrees(problem)


@pytest.mark.parametrize("shape", [(3, 40, 5), (70, 30, 90), (64, 1, 64)])
def test_min_plus_equals_the_block_min_and_argmin(shape: tuple[int, int, int]) -> None:

    rng = np.random.default_rng(sum(shape))
    ku, kv, kw = shape
    left = np.round(rng.uniform(0, 5, size=(ku, kv)), 1)  # rounding makes ties
    right = np.round(rng.uniform(0, 5, size=(kv, kw)), 1)
    left[rng.random(left.shape) < 0.2] = np.inf
    right[:, 0] = np.inf  # a column no middle strategy reaches
    block = left[:, :, None] + right[None, :, :]
    np.testing.assert_array_equal(min_plus(left, right), block.min(axis=1))
    best = np.argmin(block, axis=1)  # the first of tied minima; 0 where all are inf
    for i in range(ku):
        for j in range(kw):
            assert first_argmin_plus(left, right, i, j) == best[i, j]


@pytest.mark.parametrize("copies", [1, 2, 7, 8, 9, 16, 63, 128, 129, 137, 160, 300])
def test_repeated_tables_sum_as_reduceat_sums_them(copies: int) -> None:
    """Parallel edges that repeat one table (stacked layers) are summed from the
    count alone, with the very bits ``np.add.reduceat`` gives the stacked copies,
    either way round."""
    from torchtitan_autoparallel.planner.problem import sums

    x = np.random.default_rng(copies).uniform(0, 1e3, size=(5, 3)) / 7.0  # inexact sums
    stacked = np.add.reduceat(np.stack([x] * copies), [0])[0]
    flat, shapes = x.ravel(), np.array([[5, 3]])
    zero = np.zeros(1, dtype=np.int64)
    for flip in (False, True):
        got, _ = sums.repeated_sums(flat, zero, shapes, zero, np.array([flip]), zero + copies, 2)
        want = stacked.T if flip else stacked
        assert len(got) == want.size + 2  # the room asked for, after the sum
        assert got[: want.size].tobytes() == np.ascontiguousarray(want).tobytes()


@pytest.mark.parametrize("length", [0, 1, 7, 8, 9, 127, 128, 129, 200, 1000, 8193])
def test_pairwise_sum_is_numpys_sum(length: int) -> None:
    """The compiled sum scoring uses adds as ``ndarray.sum`` does, bit for bit."""
    from torchtitan_autoparallel.planner.problem import sums

    a = np.random.default_rng(length).uniform(-1e3, 1e3, length) / 7.0
    assert sums.pairwise_sum(a, 0, length) == a.sum()


def test_separable_tables_are_recognised_in_either_layout() -> None:

    rng = np.random.default_rng(0)
    a, b = rng.uniform(0, 1e3, size=7), rng.uniform(0, 1e3, size=5)
    table = a[:, None] + b[None, :]
    assert separable(table, 1e-12) and separable(table.T, 1e-12)
    bumped = table.copy()
    bumped[4, 3] += 1e-3  # one entry off: no longer a sum
    assert not separable(bumped, 1e-12) and not separable(bumped.T, 1e-12)
    bumped[4, 3] = np.inf  # forbidden pairs are never folded away
    assert not separable(bumped, 1e-12)


def test_scan_finds_the_separable_tables_and_the_usable_strategies() -> None:
    """``kernels.scan`` (a node's first look in the presolve) agrees with its
    definition: ``separable`` per table; usable means a finite unary, a finite
    entry in each table's row, and finite memory within the limit."""

    rng = np.random.default_rng(3)
    for trial in range(40):
        k = int(rng.integers(1, 7))
        widths = rng.integers(1, 6, size=int(rng.integers(0, 4)))
        tables = []
        for w in widths:
            if rng.random() < 0.4:  # a sum a[s] + b[t]
                tables.append(rng.uniform(0, 9, (k, 1)) + rng.uniform(0, 9, (1, w)))
            else:
                t = rng.uniform(0, 9, (k, w))
                t[rng.random(t.shape) < 0.3] = np.inf
                tables.append(t)
        unary = rng.uniform(0, 9, k)
        unary[rng.random(k) < 0.2] = np.inf
        memory = rng.uniform(0, 4, k) if trial % 2 else np.zeros(0)
        if len(memory):
            memory[rng.random(k) < 0.2] = np.inf
        fixed, limit = 1.0, 1.0 + float(rng.uniform(0, 4))
        starts = np.concatenate([[0], np.cumsum(widths)]).astype(np.int64)
        side = np.concatenate(tables, axis=1) if tables else np.zeros((k, 0))
        split, keep, any_split, all_kept = scan(unary, side, starts, 1e-12, memory, fixed, limit)
        expected = np.isfinite(unary)
        for t in tables:
            expected &= np.isfinite(t).any(axis=1)
        if len(memory):
            expected &= np.isfinite(memory) & (fixed + memory <= limit)
        np.testing.assert_array_equal(keep, expected)
        np.testing.assert_array_equal(split, [separable(t, 1e-12) for t in tables])
        assert any_split == split.any() and all_kept == expected.all()


# --- wiring ------------------------------------------------------------------


def test_get_solver_presolves_unless_told_not_to() -> None:
    assert isinstance(get_solver("ilp"), PresolvingSolver)
    assert get_solver("ilp").name == "ilp-highs"
    assert get_solver("ilp", "cbc").name == "ilp-cbc"
    assert isinstance(get_solver("ilp", presolve=False), HighsILPSolver)


def test_cbc_and_brute_force_presolve_too() -> None:
    problem = random_problem(42, pins=1)
    oracle = outcome(BruteForceSolver(), problem)
    for name, backend in (("ilp", "cbc"), ("brute-force", "highs")):
        got = outcome(get_solver(name, backend), problem)
        if isinstance(oracle, InfeasibleProblem):
            assert isinstance(got, InfeasibleProblem)
        else:
            assert got.objective == pytest.approx(oracle.objective, rel=1e-9)


def test_reduction_is_logged(caplog) -> None:
    with caplog.at_level("INFO", logger="torchtitan_autoparallel.planner"):
        get_solver("ilp").solve(random_problem(3))
    assert re.search(r"presolve: \d+ nodes, \d+ edges, \d+ strategies, \d+ variables -> "
                     r"\d+ nodes, .* in [0-9.]+ s", caplog.text)


@pytest.mark.parametrize("seed", range(4))
def test_dominance_kernel_matches_the_formula_on_near_ties(seed: int) -> None:
    """Rows that nearly copy one another (rounded, so many pairs tie or pass the cheap
    bounds and fail only at the exact sum), forbidden entries and memory."""

    rng = np.random.default_rng(seed)
    checked = dropped = 0
    for _ in range(300):
        k, widths = int(rng.integers(2, 12)), rng.integers(1, 40, size=int(rng.integers(1, 4)))
        base = np.round(rng.uniform(0, 4, size=(1, int(widths.sum()))), 1)
        side = base + np.round(rng.uniform(-0.3, 0.6, size=(k, base.shape[1])), 1)
        side[rng.random(side.shape) < 0.05] = np.inf
        unary = np.round(rng.uniform(0, 2, size=k), 1)
        memory = np.round(rng.uniform(0, 2, size=k)) if rng.random() < 0.5 else None
        starts = np.concatenate([[0], np.cumsum(widths)]).astype(np.int64)
        margin = unary[:, None] - unary[None, :]
        for a, b in zip(starts[:-1], starts[1:]):
            t = side[:, a:b]
            with np.errstate(invalid="ignore"):  # -inf + inf: NaN, which beats nothing
                margin = margin + swap_difference(t[:, None, :], t[None, :, :], False).min(axis=2)
        expected = beaten(margin, memory)
        got = dominated(unary, side, starts, np.zeros(0) if memory is None else memory)
        np.testing.assert_array_equal(got, expected)
        checked += k
        dropped += int(expected.sum())
    assert 0 < dropped < checked  # both answers were exercised
