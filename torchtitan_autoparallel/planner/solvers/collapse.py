"""Tie collapsing: every tie group becomes one node of an equivalent tie-free problem.

Tied nodes always pick the same strategy index, so a group behaves exactly like
one node whose unary (and memory) is the sum of its members'. An edge between
two groups keeps its table; parallel edges between the same two groups are
summed into one table; an edge inside a group only ever sees equal indices, so
its diagonal joins the group's unary. The collapsed problem's energy of ``x``
equals the original's energy of ``x[group_of]`` for every ``x``: the reduction
is exact, and it is what makes a stack of repeated layers cost one layer.

Everything is vectorised per table shape, so collapsing stays cheap on graphs of
tens of thousands of edges.
"""

from __future__ import annotations

import numpy as np

from torchtitan_autoparallel.planner.problem import InfeasibleProblem, Problem
from torchtitan_autoparallel.planner.solvers.ilp_model import tie_components


def collapse_ties(problem: Problem) -> tuple[Problem, np.ndarray]:
    """The tie-free problem of one node per tie group, and each node's group."""
    comp = tie_components(problem.num_nodes, problem.ties)
    reps, group_of = np.unique(comp, return_inverse=True)
    group_of = group_of.astype(np.int64)
    k = problem.num_strategies
    kg = k[reps]
    unary = _group_sums(problem.unary, k, group_of, kg)
    memory = _group_memory(problem, k, group_of, kg)
    edges, tables = _group_edges(problem, group_of, kg, unary)
    collapsed = Problem(
        node_names=[problem.node_names[r] for r in reps],
        strategy_labels=[problem.strategy_labels[r] for r in reps],
        unary=unary,
        edges=edges,
        pairwise=tables,
        memory=memory,
        memory_budget=problem.memory_budget,
        pins=_group_pins(problem, group_of),
    )
    return collapsed, group_of


def _padded(parts: list[np.ndarray], k: np.ndarray) -> np.ndarray:
    """Ragged per-node vectors as an (n, kmax) array, zero-filled."""
    out = np.zeros((len(k), int(k.max(initial=1))))
    if len(k):
        rows = np.repeat(np.arange(len(k)), k)
        cols = np.arange(int(k.sum())) - np.repeat(np.cumsum(k) - k, k)
        out[rows, cols] = np.concatenate(parts).astype(np.float64)
    return out


def _group_sums(
    parts: list[np.ndarray], k: np.ndarray, group_of: np.ndarray, kg: np.ndarray
) -> list[np.ndarray]:
    sums = np.zeros((len(kg), int(k.max(initial=1))))
    np.add.at(sums, group_of, _padded(parts, k))
    return [sums[g, : kg[g]].copy() for g in range(len(kg))]


def _group_memory(
    problem: Problem, k: np.ndarray, group_of: np.ndarray, kg: np.ndarray
) -> list[np.ndarray | None]:
    has = np.array([m is not None for m in problem.memory], dtype=bool)
    if not has.any():
        return [None] * len(kg)
    rows = [np.zeros(kv) if m is None else m for m, kv in zip(problem.memory, k)]
    sums = _group_sums(rows, k, group_of, kg)
    group_has = np.zeros(len(kg), dtype=bool)
    group_has[group_of[has]] = True
    return [s if h else None for s, h in zip(sums, group_has)]


def _group_pins(problem: Problem, group_of: np.ndarray) -> dict[int, int]:
    pins: dict[int, int] = {}
    for v, s in sorted(problem.pins.items()):
        g = int(group_of[v])
        if pins.get(g, s) != s:
            raise InfeasibleProblem(
                f"tied nodes are pinned to different strategies ({problem.node_names[v]} "
                f"to {s}, a member of its tie group to {pins[g]})"
            )
        pins[g] = int(s)
    return pins


def _group_edges(
    problem: Problem, group_of: np.ndarray, kg: np.ndarray, unary: list[np.ndarray]
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Edges between distinct groups, parallel ones summed; inner ones onto ``unary``."""
    if not len(problem.edges):
        return np.zeros((0, 2), np.int64), []
    ga, gb = group_of[problem.edges[:, 0]], group_of[problem.edges[:, 1]]
    inner = ga == gb
    for e in np.flatnonzero(inner):
        unary[ga[e]] += np.diag(problem.pairwise[e])
    flip = ga > gb  # orient every edge low group -> high group, transposing its table
    lo, hi = np.where(flip, gb, ga), np.where(flip, ga, gb)
    outer = np.flatnonzero(~inner)
    keys = lo[outer] * len(kg) + hi[outer]
    uniq, slot = np.unique(keys, return_inverse=True)
    tables: list[np.ndarray] = [np.zeros(0)] * len(uniq)  # every slot is filled below
    # one bucket per table shape: stack, then sum the tables that share a slot
    shape_key = kg[lo[outer]] * (int(kg.max()) + 1) + kg[hi[outer]]
    for sk in np.unique(shape_key):
        pick = np.flatnonzero(shape_key == sk)
        order = pick[np.argsort(slot[pick], kind="stable")]  # parallel edges side by side
        oriented = [problem.pairwise[e].T if flip[e] else problem.pairwise[e] for e in outer[order]]
        stacked = np.asarray(np.stack(oriented), dtype=np.float64)
        slots, starts = np.unique(slot[order], return_index=True)
        sums = np.add.reduceat(stacked, starts, axis=0)
        for j, s in enumerate(slots.tolist()):
            tables[s] = sums[j]
    edges = np.stack([uniq // len(kg), uniq % len(kg)], axis=1).astype(np.int64)
    return edges, tables
