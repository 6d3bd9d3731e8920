"""Edges asking the same question share one table: saved once, summed once, same bits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from torchtitan_autoparallel.planner.problem.problem import Problem, share_tables
from torchtitan_autoparallel.planner.solve import get_solver
from torchtitan_autoparallel.planner.solve.presolve.collapse import collapse_ties, tie_components


def stacked_layers(layers: int, shared: bool, seed: int = 0) -> Problem:
    """``layers`` tied copies of a 3-node block (a -> b -> c, a -> c) plus a shared head,
    every copy's tables equal; ``shared``: one object per question, else copies."""
    rng = np.random.default_rng(seed)
    k = [3, 4, 2]
    block_tables = {
        (0, 1): rng.uniform(0, 9, (3, 4)),
        (1, 2): rng.uniform(0, 9, (4, 2)),
        (0, 2): rng.uniform(0, 9, (3, 2)),
    }
    block_tables[(1, 2)][0, 1] = np.inf
    to_head = rng.uniform(0, 9, (2, 5))
    head = 3 * layers
    edges, tables = [], []
    for i in range(layers):
        for (a, b), t in block_tables.items():
            # every other layer names its edge the other way round: a transposed term
            if i % 2:
                edges.append((3 * i + b, 3 * i + a))
                tables.append(t.T if shared else t.T.copy())
            else:
                edges.append((3 * i + a, 3 * i + b))
                tables.append(t if shared else t.copy())
        edges.append((3 * i + 2, head))
        tables.append(to_head if shared else to_head.copy())
    sizes = k * layers + [5]
    return Problem(
        node_names=[f"n{v}" for v in range(len(sizes))],
        strategy_labels=[[f"s{j}" for j in range(kv)] for kv in sizes],
        unary=[rng.uniform(0, 20, kv) for kv in sizes],
        edges=np.array(edges),
        pairwise=share_tables(tables) if shared else tables,
        ties=[[3 * i + j for i in range(layers)] for j in range(3)],
    )


@pytest.mark.parametrize("layers", [3, 9, 20, 150])  # running sum, lanes, lanes + rest, halves
def test_collapse_of_shared_tables_is_bitwise_that_of_copies(layers: int) -> None:
    shared, copies = stacked_layers(layers, True), stacked_layers(layers, False)
    assert len({id(t) for t in shared.pairwise}) < len({id(t) for t in copies.pairwise})
    a, group_a = collapse_ties(shared)
    b, group_b = collapse_ties(copies)
    assert np.array_equal(group_a, group_b) and np.array_equal(a.edges, b.edges)
    for ta, tb in zip(a.pairwise, b.pairwise):
        assert ta.tobytes() == tb.tobytes()
    # and the sum is the layers' energy: every term was added once
    x = np.array([1, 2, 0, 3])
    assert a.energy(x) == pytest.approx(shared.energy(x[group_a]), rel=1e-12)


def test_share_tables_merges_equal_tables_only_and_freezes_them() -> None:
    rng = np.random.default_rng(1)
    t = rng.uniform(0, 1, (3, 4))
    tables = share_tables([t, t.copy(), t + 1e-12, rng.uniform(0, 1, (4, 3)), t])
    assert tables[0] is tables[1] is tables[4]
    assert tables[2] is not tables[0] and tables[3] is not tables[0]
    assert all(not x.flags.writeable for x in tables)
    with pytest.raises(ValueError):
        tables[0][0, 0] = 5.0


def test_saved_file_stores_each_distinct_table_once(tmp_path) -> None:
    problem = stacked_layers(10, shared=False)
    problem.save(tmp_path / "p.npz")
    with np.load(tmp_path / "p.npz", allow_pickle=False) as f:
        stored = f["pairwise"].size
        assert int(f["format_version"]) == 3
    distinct = {t.tobytes(): t.size for t in problem.pairwise}
    assert stored == sum(distinct.values()) < sum(t.size for t in problem.pairwise)
    loaded = Problem.load(tmp_path / "p.npz")
    assert len({id(t) for t in loaded.pairwise}) == len(distinct)
    for a, b in zip(loaded.pairwise, problem.pairwise):
        assert np.array_equal(a, b)
    assert get_solver("ilp").solve(loaded).objective == get_solver("ilp").solve(problem).objective


class _Planted:
    def __reduce__(self):
        return (Path.touch, (_Planted.proof,))


@pytest.mark.parametrize("version", [1, 2, 3])
def test_a_file_with_pickled_objects_is_refused_unread(tmp_path, version) -> None:
    """Formats 1 and 2 stored names as pickled objects: such a file (here with an object
    that would run code when unpickled) is refused, and nothing in it runs."""
    problem = stacked_layers(2, shared=True)
    problem.save(tmp_path / "p.npz")
    with np.load(tmp_path / "p.npz", allow_pickle=False) as f:
        arrays = {name: f[name] for name in f.files}
    _Planted.proof = tmp_path / "ran"
    arrays["node_names"] = np.array([_Planted()] + problem.node_names[1:], dtype=object)
    arrays["format_version"] = np.array(version)
    np.savez_compressed(tmp_path / "old.npz", **arrays)
    expected = "export the problem again" if version < 3 else "holds pickled objects, which are not loaded"
    with pytest.raises(ValueError, match=expected):
        Problem.load(tmp_path / "old.npz")
    assert not _Planted.proof.exists()


def test_unknown_format_version_is_refused(tmp_path) -> None:
    stacked_layers(2, shared=True).save(tmp_path / "p.npz")
    with np.load(tmp_path / "p.npz", allow_pickle=False) as f:
        arrays = {name: f[name] for name in f.files}
    arrays["format_version"] = np.array(7)
    np.savez_compressed(tmp_path / "v7.npz", **arrays)
    with pytest.raises(ValueError, match=r"problem format 7, expected one of \(3,\)"):
        Problem.load(tmp_path / "v7.npz")


def test_energy_is_the_running_sums_of_nodes_and_edges_bit_for_bit() -> None:
    """``Problem.energy`` adds the unary terms in node order, the table entries in edge
    order, then the two, as plain floats: the sum every objective is scored with."""
    problem = stacked_layers(7, shared=True, seed=3)
    rng = np.random.default_rng(1)
    for _ in range(20):
        x = rng.integers(0, problem.num_strategies)
        nodes = edges = 0.0
        for v, u in enumerate(problem.unary):
            nodes += float(u[x[v]])
        for (a, b), table in zip(problem.edges.tolist(), problem.pairwise):
            edges += float(table[x[a], x[b]])
        assert problem.energy(x) == nodes + edges  # inf where a forbidden pair is picked


def test_tie_components_of_disjoint_and_overlapping_groups() -> None:
    comp = tie_components(8, [[5, 1, 3], [2, 6]])
    assert comp.tolist() == [0, 5, 2, 5, 4, 5, 2, 7]
    assert tie_components(8, [[], [5, 1, 3], [], [2, 6]]).tolist() == comp.tolist()
    assert tie_components(3, []).tolist() == [0, 1, 2]
    merged = tie_components(6, [[0, 1], [1, 2], [4, 5]])  # 0, 1, 2 join through node 1
    assert merged[0] == merged[1] == merged[2] and merged[4] == merged[5]
    assert len(set(merged.tolist())) == 3
