"""The compiled presolve and scoring against the code they replace: the same bits.

``compiled_reduce`` runs ``reduce.Graph``'s fixed point on flat arrays and
``Problem.arrays`` scores plans without walking the per-node lists; both
promise the results of the Python they stand in for, bit for bit, so plans and
bounds do not move. ``Graph`` (through ``make_graph``) and the list walks are
the references here.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_presolve import _wide_problem, make_problem, random_problem

from torchtitan_autoparallel.planner.problem import InfeasibleProblem, Problem
from torchtitan_autoparallel.planner.solvers import compiled_graph, presolve
from torchtitan_autoparallel.planner.solvers.mrf import build_mrf
from torchtitan_autoparallel.planner.solvers.reduce import Graph


def _python_presolve(problem: Problem, **options):
    return presolve(problem, make_graph=lambda tie_free, _, prune: Graph(tie_free, prune), **options)


def _outcome(run, problem: Problem, **options):
    try:
        return run(problem, **options)
    except InfeasibleProblem as exc:
        return str(exc)


def assert_same_reduction(problem: Problem, **options) -> None:
    compiled, python = _outcome(presolve, problem, **options), _outcome(_python_presolve, problem, **options)
    if isinstance(python, str):
        assert compiled == python  # the same error, naming the same node
        return
    assert compiled.offset == python.offset
    a, b = compiled.reduced, python.reduced
    assert a.node_names == b.node_names and a.strategy_labels == b.strategy_labels
    assert np.array_equal(a.edges, b.edges) and a.memory_budget == b.memory_budget
    for x, y in zip(a.unary + a.pairwise, b.unary + b.pairwise):
        assert x.tobytes() == np.ascontiguousarray(y).tobytes()
    for x, y in zip(a.memory, b.memory):
        assert (x is None and y is None) or x.tobytes() == y.tobytes()
    rng = np.random.default_rng(len(a.node_names))
    for _ in range(5):
        x = np.array([rng.integers(k) for k in a.num_strategies], dtype=np.int64)
        assert np.array_equal(compiled.expand(x), python.expand(x))


@pytest.mark.parametrize("seed", range(40))
def test_compiled_reduction_is_graphs_bit_for_bit(seed: int) -> None:
    problem = random_problem(300 + seed, memory=seed % 2 == 0, pins=seed % 3)
    if seed % 4 == 0:  # a budget that binds
        problem.memory_budget = 0.6 * sum(float(m.max()) for m in problem.memory if m is not None)
    assert_same_reduction(problem)
    assert_same_reduction(problem, dominance=False)
    assert_same_reduction(problem, prune_memory=False)


@pytest.mark.parametrize("seed", range(6))
def test_compiled_dominance_on_wide_nodes_is_graphs(seed: int) -> None:
    assert_same_reduction(_wide_problem(seed))


def test_an_infeasible_problem_names_the_same_node() -> None:
    rng = np.random.default_rng(3)
    problem = make_problem(rng, [(0, 1), (1, 2), (2, 0)], np.array([2, 2, 2]))
    problem.unary[1] = np.array([np.inf, np.inf])
    with pytest.raises(InfeasibleProblem, match="nothing is left for op"):
        presolve(problem)
    assert_same_reduction(problem)


def test_new_tables_beyond_the_first_room_are_made_room_for(monkeypatch) -> None:
    """A chain of eliminations can make more tables than the arena first holds: the
    engine stops and starts again with room enough, to the same result."""
    monkeypatch.setattr(compiled_graph, "ROOM", 0)  # no room for tables of their own
    runs = []
    real = compiled_graph._run
    monkeypatch.setattr(compiled_graph, "_run", lambda g, *a: runs.append(1) or real(g, *a))
    rng = np.random.default_rng(7)
    n = 12
    edges = [(i, i + 1) for i in range(n - 1)] + [(0, n - 1), (0, 6)]
    problem = make_problem(rng, edges, rng.integers(2, 5, size=n))
    assert_same_reduction(problem, dominance=False)
    assert len(runs) > 1  # it did run out of room, and started again


def test_the_collapse_buffer_is_one_engines_arena(monkeypatch) -> None:
    """The compiled pass writes its tables past the collapsed ones, in the buffer
    ``collapse`` left for it: a second pass over the same collapse must lay out its
    own arena, or it would overwrite the first one's tables under its feet."""
    from torchtitan_autoparallel.planner.solvers.collapse import collapse

    rng = np.random.default_rng(11)
    n = 10
    edges = [(i, i + 1) for i in range(n - 1)] + [(0, 5), (2, 7), (3, 9)]
    problem = make_problem(rng, edges, rng.integers(3, 6, size=n))
    collapsed = collapse(problem, compiled_graph.ROOM)
    tables = collapsed.flat.arrays.flat_tables.copy()
    buffer = collapsed.buffer
    assert np.shares_memory(buffer, collapsed.flat.arrays.flat_tables)
    buffer[len(tables) :] = np.nan  # to see what the pass writes there
    arenas, real = [], compiled_graph._arena
    monkeypatch.setattr(compiled_graph, "_arena", lambda *a: arenas.append(real(*a)) or arenas[-1])
    first = compiled_graph.reduce_compiled(collapsed)
    assert collapsed.buffer is None  # taken by the first pass
    assert not np.isnan(buffer[len(tables) :]).all()  # its tables of their own went there
    before = first.reduced_flat.arrays.flat_tables.copy()
    written = buffer.copy()
    second = compiled_graph.reduce_compiled(collapsed)
    assert arenas[0] is buffer and not np.shares_memory(arenas[1], buffer)
    assert buffer.tobytes() == written.tobytes()
    assert second.reduced_flat.arrays.flat_tables.tobytes() == before.tobytes()
    assert collapsed.flat.arrays.flat_tables.tobytes() == tables.tobytes()  # never written


def test_build_mrf_reads_presolved_tables_where_they_lie_to_the_same_bits() -> None:
    """The compiled presolve's tables are oriented and packed in edge order, so
    ``build_mrf`` reads them in place; the same problem with every edge listed the
    other way round (its tables transposed) takes the copying path, to the same Mrf."""
    from torchtitan_autoparallel.planner.solvers import mrf as mrf_module

    fields = ("k", "domain", "flat_unary", "edges", "flat", "offset", "flat_memory")
    compared = 0
    for seed in range(40):
        pre = _outcome(presolve, random_problem(500 + seed, memory=seed % 2 == 1))
        if isinstance(pre, str):  # infeasible: nothing to build
            continue
        flat, reduced = pre.reduced_flat, pre.reduced
        if not len(reduced.edges):
            continue
        arrays = flat.arrays
        assert mrf_module._in_order(
            arrays.k, flat.edges, arrays.table_at, arrays.table_cols, arrays.table_of_edge,
            len(arrays.flat_tables),
        )
        flipped = Problem(
            reduced.node_names, reduced.strategy_labels, reduced.unary,
            reduced.edges[:, ::-1].copy(), [np.ascontiguousarray(t.T) for t in reduced.pairwise],
            reduced.memory, reduced.memory_budget,
        )
        direct, copied = build_mrf(flat), build_mrf(flipped)
        for name in fields:
            a, b = getattr(direct, name), getattr(copied, name)
            assert (a is None and b is None) or np.asarray(a).tobytes() == np.asarray(b).tobytes(), name
        assert (direct.budget, direct.big) == (copied.budget, copied.big)
        compared += 1
    assert compared >= 8  # some of these problems keep a core with edges


# --- flat arrays and the scores read from them -----------------------------------


def _list_energy(problem: Problem, x: np.ndarray) -> float:
    """``Problem.energy`` as it walked the lists: unaries node after node, then tables."""
    total = sum(float(u[s]) for u, s in zip(problem.unary, x.tolist()))
    ends = zip(x[problem.edges[:, 0]].tolist(), x[problem.edges[:, 1]].tolist())
    return total + sum(float(t[a, b]) for t, (a, b) in zip(problem.pairwise, ends))


@pytest.mark.parametrize("seed", range(10))
def test_scores_are_the_list_walks_bit_for_bit(seed: int, tmp_path) -> None:
    problem = random_problem(seed, memory=True, pins=1)
    problem.save(tmp_path / "p.npz")
    loaded = Problem.load(tmp_path / "p.npz")  # its arrays come from the file as they are
    rng = np.random.default_rng(seed)
    for p in (problem, loaded):
        for _ in range(10):
            x = np.array([rng.integers(k) for k in p.num_strategies], dtype=np.int64)
            assert p.energy(x) == _list_energy(p, x)
            memory = sum(float(m[s]) for m, s in zip(p.memory, x.tolist()) if m is not None)
            assert p.memory_used(x) == memory


def test_the_arrays_follow_edits_of_the_lists() -> None:
    """Replacing a field or an item of its list makes the arrays again; an array the
    arrays were made from can no longer be written in place (the copy would not see it)."""
    rng = np.random.default_rng(0)
    problem = make_problem(rng, [(0, 1), (1, 2)], np.array([2, 3, 2]))
    x = np.array([1, 2, 0])
    before = problem.energy(x)
    problem.unary[1] = problem.unary[1] + 5.0
    assert problem.energy(x) == pytest.approx(before + 5.0)
    problem.pairwise = [t * 0.0 for t in problem.pairwise]
    assert problem.energy(x) == pytest.approx(sum(float(u[s]) for u, s in zip(problem.unary, x)))
    with pytest.raises(ValueError, match="read-only"):
        problem.unary[0][0] = 1.0


@pytest.mark.parametrize("seed", range(8))
def test_mrf_energy_is_numpys_sum(seed: int) -> None:
    """The compiled ``Mrf.energy`` adds as the numpy it replaced: the unaries in node
    order, the tables' entries as ``ndarray.sum`` adds them."""
    mrf = build_mrf(random_problem(400 + seed))
    rng = np.random.default_rng(seed)
    a, b = mrf.edges[:, 0], mrf.edges[:, 1]
    for _ in range(10):
        x = np.array([rng.integers(k) for k in mrf.k], dtype=np.int64)
        unary = sum(float(mrf.flat_unary[mrf.starts[v] + x[v]]) for v in range(mrf.num_nodes))
        tables = float(mrf.flat[mrf.offset + x[a] * mrf.columns + x[b]].sum()) if len(a) else 0.0
        assert mrf.energy(x) == (unary + tables if len(a) else unary)
