"""Compiled inner loops of the local search and the MRF (numba, cached on disk).

Many tiny steps whose Python overhead outweighs their arithmetic: the block
moves of ``local_search`` (a tree of nodes re-solved exactly by dynamic
programming), the cost table of single-node moves and the energy of a
labeling. They add in the order of the Python they replace, so every result
keeps its bits. They compile on first use and are cached on disk, or run as
Python on small plans (``jit.py``).
"""

from __future__ import annotations

import numpy as np

from torchtitan_autoparallel import jit

_jit = jit.jit


@_jit
def neighbour_costs(
    unary: np.ndarray, x: np.ndarray, k: np.ndarray, flat: np.ndarray, graph: tuple
) -> np.ndarray:
    """``unary`` (nodes by labels) plus, for each node and label, its tables' entries
    at the neighbours' labels ``x`` (``graph``: ``tree_block``'s adjacency): the
    local search's cost table, added neighbour by neighbour in node order."""
    ptr, nbr = graph[0], graph[1]
    cost = unary.copy()
    for v in range(len(x)):
        for p in range(ptr[v], ptr[v + 1]):
            z = nbr[p]
            for j in range(k[z]):
                cost[z, j] += _entry(flat, graph, p, x[v], j)
    return cost


@_jit
def picked_sum(flat: np.ndarray, starts: np.ndarray, x: np.ndarray) -> float:
    """``sum_v flat[starts[v] + x[v]]``, added in node order as Python's ``sum`` does."""
    total = 0.0
    for v in range(len(x)):
        total += flat[starts[v] + x[v]]
    return total


@_jit
def _entry(flat: np.ndarray, graph: tuple, p: int, mine: int, theirs: int) -> float:
    """Adjacency entry ``p``'s table at (its node's label, the neighbour's label)."""
    e, start, cols = graph[2][p], graph[4], graph[5]
    if graph[3][p]:
        return flat[start[e] + mine * cols[e] + theirs]
    return flat[start[e] + theirs * cols[e] + mine]


@_jit
def _grow(x: np.ndarray, flat: np.ndarray, graph: tuple, root: int, depth: int):
    """Breadth-first tree block around ``root`` (``local_search._block``): each node's
    neighbours costliest edge first (ties in adjacency order), a neighbour joining
    only if exactly one of its own neighbours is already in."""
    ptr, nbr = graph[0], graph[1]
    order, via = np.empty(len(x), np.int64), np.empty(len(x), np.int64)
    parent = np.empty(len(x), np.int64)
    inside = np.zeros(len(x), np.bool_)
    order[0], parent[0], via[0], inside[root] = root, -1, -1, True
    m, level_lo = 1, 0
    for _ in range(depth):
        level_hi = m
        for i in range(level_lo, level_hi):
            v = order[i]
            lo, hi = ptr[v], ptr[v + 1]
            cost = np.empty(hi - lo)
            for p in range(lo, hi):
                cost[p - lo] = -_entry(flat, graph, p, x[v], x[nbr[p]])
            for q in np.argsort(cost, kind="mergesort"):
                z = nbr[lo + q]
                if inside[z]:
                    continue
                known = 0
                for r in range(ptr[z], ptr[z + 1]):
                    known += inside[nbr[r]]
                if known == 1:
                    inside[z] = True
                    order[m], parent[m], via[m] = z, i, lo + q
                    m += 1
        level_lo = level_hi
    return order[:m], parent[:m], via[:m]


@_jit
def tree_block(
    cost: np.ndarray, mem: np.ndarray, x: np.ndarray, k: np.ndarray, flat: np.ndarray,
    graph: tuple, root: int, depth: int, lam: float,
):
    """The best joint relabeling of the tree block around ``root`` (everything else
    fixed) under energy + ``lam`` * memory, by one min-sum pass leaves to root.

    ``graph`` is the adjacency in CSR form: (start per node, neighbour, edge,
    1 if the node indexes the edge's rows, where each edge's table starts in
    ``flat``, each table's columns). Returns the block's nodes (root first,
    parents before children), each one's parent position, its best label per
    parent label (``picks``), the best block energy per root label (``totals``),
    the block's energy now, and the best relabeling with its energy gain and
    memory growth. The sums follow the numpy formulation's order term by term."""
    order, parent, via = _grow(x, flat, graph, root, depth)
    m, width = len(order), cost.shape[1]
    rest = np.empty((m, width))
    for i in range(m):
        rest[i] = cost[order[i]]
    for i in range(1, m):
        v, pv = order[i], order[parent[i]]
        for j in range(k[v]):
            rest[i, j] -= _entry(flat, graph, via[i], x[pv], j)
        for j in range(k[pv]):
            rest[parent[i], j] -= _entry(flat, graph, via[i], j, x[v])
    priced = np.empty((m, width))
    for i in range(m):
        for j in range(k[order[i]]):
            priced[i, j] = rest[i, j] + lam * mem[order[i], j]
    picks = np.zeros((m, width), np.int64)
    for i in range(m - 1, 0, -1):
        v, pi = order[i], parent[i]
        for a in range(k[order[pi]]):
            best, at = np.inf, 0
            for j in range(k[v]):
                joint = priced[i, j] + _entry(flat, graph, via[i], a, j)
                if joint < best or j == 0:
                    best, at = joint, j
            picks[i, a] = at
            priced[pi, a] = priced[pi, a] + best
    totals = priced[0, : k[root]].copy()
    new = np.empty(m, np.int64)
    new[0] = np.argmin(totals)
    for i in range(1, m):
        new[i] = picks[i, new[parent[i]]]
    now = _block_energy(rest, order, parent, via, flat, graph, x[order])
    gain = now - _block_energy(rest, order, parent, via, flat, graph, new)
    grow = 0.0
    for i in range(m):
        grow += mem[order[i], new[i]] - mem[order[i], x[order[i]]]
    return order, parent, picks, totals, now, new, gain, grow


@_jit
def _block_energy(rest, order, parent, via, flat, graph, labels) -> float:
    """The block's energy (memory not priced) at ``labels`` (by block position)."""
    own = 0.0
    for i in range(len(order)):
        own += rest[i, labels[i]]
    shared = 0.0
    for i in range(1, len(order)):
        shared += _entry(flat, graph, via[i], labels[parent[i]], labels[i])
    return own + shared
