"""A tie-free ``Problem`` as compact arrays for message passing and local search.

Labels no feasible plan can use are dropped first (infinite unary, pins,
memory that alone breaks the budget, and rows or columns of a table that are
all ``inf`` given the neighbour's remaining labels), repeated to a fixed
point. What is left of ``inf`` sits inside pairwise tables and becomes
``big``: a finite stand-in far above any feasible energy, so that min-sum
arithmetic never meets ``inf - inf`` and a labeling that pays it is
recognisably infeasible.

Every edge is oriented from the lower to the higher node index, the order the
message passing sweeps in.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from torchtitan_autoparallel import jit
from torchtitan_autoparallel.planner.problem import sums
from torchtitan_autoparallel.planner.problem.problem import FlatProblem, Problem, ProblemArrays
from torchtitan_autoparallel.planner.solve.approx import kernels

_jit = jit.jit
_inline = jit.inline

BUDGET_RTOL = 1e-9  # float slack on the budget: sums of the same bytes in another order
BIG_FACTOR = 1e6  # ``big`` is this many times the largest feasible energy


class NoLabels(ValueError):
    """Some node has no usable label left: the problem (or its budget) is infeasible."""


@dataclass
class Mrf:
    """The compact problem, as flat arrays: node ``v``'s labels are entries
    ``starts[v]:starts[v + 1]`` of ``domain``, ``flat_unary`` and ``flat_memory``;
    edge ``e``'s table (rows: its lower node's labels) starts at ``offset[e]`` of
    ``flat``. The per-node lists (``unary``, ``domains``, ``tables``, ``memory``)
    are views made when first read."""

    k: np.ndarray  # (n,) labels per node
    domain: np.ndarray  # the original strategy index of each label kept
    flat_unary: np.ndarray  # finite costs
    edges: np.ndarray  # (E, 2), edges[:, 0] < edges[:, 1]
    flat: np.ndarray  # every table raveled, forbidden pairs at ``big``
    offset: np.ndarray  # (E,) where each table starts in ``flat``
    flat_memory: np.ndarray | None  # bytes per label (zeros if none); None: budget never binds
    budget: float  # bytes (inf without a budget)
    big: float

    @property
    def num_nodes(self) -> int:
        return len(self.k)

    @cached_property
    def starts(self) -> np.ndarray:  # where each node's labels start in a flat unary
        out = np.zeros(len(self.k) + 1, dtype=np.int64)
        np.cumsum(self.k, out=out[1:])
        return out

    @cached_property
    def columns(self) -> np.ndarray:
        return self.k[self.edges[:, 1]] if len(self.edges) else np.zeros(0, dtype=np.int64)

    def _per_node(self, flat: np.ndarray) -> list[np.ndarray]:
        bounds = self.starts.tolist()
        return [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

    @cached_property
    def unary(self) -> list[np.ndarray]:
        return self._per_node(self.flat_unary)

    @cached_property
    def domains(self) -> list[np.ndarray]:
        return self._per_node(self.domain)

    @cached_property
    def memory(self) -> list[np.ndarray] | None:
        return None if self.flat_memory is None else self._per_node(self.flat_memory)

    @cached_property
    def tables(self) -> list[np.ndarray]:
        shapes = zip(self.k[self.edges[:, 0]].tolist(), self.columns.tolist())
        return [
            self.flat[at : at + r * c].reshape(r, c) for at, (r, c) in zip(self.offset.tolist(), shapes)
        ]

    @cached_property
    def padded(self) -> tuple[np.ndarray, np.ndarray]:
        """(nodes, most labels) tables of the unaries (``inf`` past a node's labels) and
        of the memory (zeros), as the local search reads them."""
        width = int(self.k.max(initial=1))
        unary, memory = np.full((self.num_nodes, width), np.inf), np.zeros((self.num_nodes, width))
        unary[self.cells] = self.flat_unary
        if self.flat_memory is not None:
            memory[self.cells] = self.flat_memory
        return unary, memory

    @cached_property
    def cells(self) -> tuple[np.ndarray, np.ndarray]:
        """(node, label) of each entry of a flat unary: where it goes in a padded table."""
        nodes = np.repeat(np.arange(self.num_nodes), self.k)
        return nodes, np.arange(len(nodes)) - self.starts[nodes]

    @cached_property
    def adjacency(self) -> tuple[np.ndarray, ...]:
        """Each node's edges in edge order, as flat arrays for ``kernels.tree_block``:
        (start per node, neighbour, edge, whether the node indexes the edge's rows,
        where each table starts in ``flat``, each table's columns)."""
        a, b = self.edges[:, 0], self.edges[:, 1]
        count = len(a)
        node = np.concatenate([a, b])
        edge = np.concatenate([np.arange(count), np.arange(count)])
        order = np.lexsort((edge, node))
        start = np.searchsorted(node[order], np.arange(self.num_nodes + 1))
        return (
            start.astype(np.int64),
            np.concatenate([b, a])[order].astype(np.int64),
            edge[order].astype(np.int64),
            (np.arange(2 * count) < count)[order],
            np.asarray(self.offset, dtype=np.int64),
            self.columns,
        )

    @cached_property
    def colour_classes(self) -> tuple[np.ndarray, np.ndarray]:
        """Greedy colouring in node order (each node the least colour its neighbours
        lack), as CSR: where each colour's nodes start, and the nodes, ascending."""
        return _colour_classes(*self.adjacency[:2])

    @cached_property
    def reach(self) -> tuple[np.ndarray, np.ndarray]:
        """Per node, itself and the nodes one or two edges away, as CSR."""
        return _within_two(*self.adjacency[:2])

    def energy(self, x: np.ndarray, unary: np.ndarray | None = None) -> float:
        """Energy of a compact labeling; ``>= big`` means it uses a forbidden pair.
        ``unary``: a flat unary (node ``v``'s from ``starts[v]``) to use instead of its own."""
        flat = self.flat_unary if unary is None else unary
        x = np.ascontiguousarray(x, dtype=np.int64)
        return _energy(flat, self.starts, x, self.edges, self.flat, self.offset, self.columns)

    def memory_used(self, x: np.ndarray) -> float:
        if self.flat_memory is None:
            return 0.0
        x = np.ascontiguousarray(x, dtype=np.int64)
        return kernels.picked_sum(self.flat_memory, self.starts, x)  # node by node, as sum() adds

    def fits(self, x: np.ndarray) -> bool:
        return self.flat_memory is None or self.memory_used(x) <= self.budget

    def feasible(self, x: np.ndarray) -> bool:
        return self.energy(x) < self.big and self.fits(x)

    def expand(self, x: np.ndarray) -> np.ndarray:
        """Compact labels -> the problem's strategy indices."""
        return self.domain[self.starts[:-1] + np.asarray(x, dtype=np.int64)]


def build_mrf(problem: Problem | FlatProblem) -> Mrf:
    """The compact form of a tie-free problem (pins allowed); raises ``NoLabels``."""
    if isinstance(problem, Problem):
        problem = problem.flat_problem
    flat = problem.arrays
    pins = np.array(sorted(problem.pins.items()), dtype=np.int64).reshape(-1, 2)
    use_memory = problem.memory_budget is not None and len(flat.memory_nodes) > 0
    rows = np.zeros(len(flat.unary))
    if use_memory:  # every node's row, zeros where it holds none
        rows[_member_positions(flat)] = flat.memory
    budget = np.inf if problem.memory_budget is None else float(problem.memory_budget)
    cap = budget * (1 + BUDGET_RTOL) if budget > 0 else budget
    out = _compact(
        flat.k, flat.starts, flat.unary, problem.edges, flat.flat_tables, flat.table_at,
        flat.table_cols, flat.table_of_edge, pins[:, 0].copy(), pins[:, 1].copy(), rows,
        use_memory, cap, BIG_FACTOR,
    )
    empty, k, domain, unary, edges, offset, tables, memory, keep_memory, big = out
    if empty >= 0:
        raise NoLabels(empty)
    return Mrf(k, domain, unary, edges, tables, offset, memory if keep_memory else None, cap, big)


def _member_positions(flat: ProblemArrays) -> np.ndarray:
    """Where the memory holders' entries sit in a vector laid out as the unaries."""
    holders = flat.memory_nodes
    sizes = flat.k[holders]
    return np.repeat(flat.starts[holders], sizes) + (
        np.arange(int(sizes.sum())) - np.repeat(flat.memory_starts[:-1], sizes)
    )


@_jit
def _compact(
    k: np.ndarray, starts: np.ndarray, unary: np.ndarray, ends: np.ndarray,
    flat_tables: np.ndarray, table_at: np.ndarray, table_cols: np.ndarray,
    table_of_edge: np.ndarray, pin_nodes: np.ndarray, pin_labels: np.ndarray,
    memory: np.ndarray, use_memory: bool, cap: float, big_factor: float,
):
    """The whole of ``build_mrf`` on flat arrays (module docstring): self-loops into the
    unaries, edges oriented low to high, unusable labels pruned to a fixed point,
    tables cut to the labels kept, ``inf`` replaced by ``big``. Returns the first node
    left without a label (-1: none) and the compact arrays.

    Tables already oriented and packed in edge order are read where they lie
    rather than copied first (one copy fewer of every table, the largest thing
    alive at this point of a solve)."""
    theta = unary.copy()
    if _in_order(k, ends, table_at, table_cols, table_of_edge, flat_tables.shape[0]):
        at = np.empty(ends.shape[0] + 1, dtype=np.int64)
        at[: ends.shape[0]] = table_at[: ends.shape[0]]
        at[ends.shape[0]] = flat_tables.shape[0]
        return _compacted(
            k, starts, theta, ends.copy(), at, flat_tables, pin_nodes, pin_labels, memory,
            use_memory, cap, big_factor,
        )
    edges, at, tables = _oriented(
        k, starts, theta, ends, flat_tables, table_at, table_cols, table_of_edge
    )
    return _compacted(
        k, starts, theta, edges, at, tables, pin_nodes, pin_labels, memory, use_memory, cap,
        big_factor,
    )


@_jit
def _in_order(
    k: np.ndarray, ends: np.ndarray, table_at: np.ndarray, table_cols: np.ndarray,
    table_of_edge: np.ndarray, entries: int,
) -> bool:
    """Whether every edge runs low to high and owns a table, laid out in edge order
    with the low end's labels as rows: ``_oriented``'s output already."""
    size = 0
    for e in range(ends.shape[0]):
        u, v = ends[e, 0], ends[e, 1]
        t = table_of_edge[e]
        if u >= v or t != e or table_at[t] != size or table_cols[t] != k[v]:
            return False
        size += k[u] * k[v]
    return size == entries


@_jit
def _compacted(
    k: np.ndarray, starts: np.ndarray, theta: np.ndarray, edges: np.ndarray, at: np.ndarray,
    tables: np.ndarray, pin_nodes: np.ndarray, pin_labels: np.ndarray, memory: np.ndarray,
    use_memory: bool, cap: float, big_factor: float,
):
    """``_compact`` once the edges are oriented and ``theta`` has the self-loops."""
    n = k.shape[0]
    allowed = np.empty(theta.shape[0], dtype=np.bool_)
    for i in range(theta.shape[0]):
        allowed[i] = np.isfinite(theta[i])
    for i in range(pin_nodes.shape[0]):
        v = pin_nodes[i]
        for s in range(k[v]):
            allowed[starts[v] + s] &= s == pin_labels[i]
    rows = memory.copy()
    if use_memory:
        for i in range(rows.shape[0]):
            if not np.isfinite(rows[i]):
                allowed[i] = False
                rows[i] = 0.0
    empty = _prune(k, starts, allowed, edges, at, tables, rows, use_memory, cap)
    if empty >= 0:
        return empty, k, at, theta, edges, at, np.zeros(0), rows, False, 0.0
    kept, domain, new_starts = _domains(k, starts, allowed)
    where = np.empty(domain.shape[0], dtype=np.int64)  # each kept label in the full layout
    for v in range(n):
        for r in range(new_starts[v], new_starts[v + 1]):
            where[r] = starts[v] + domain[r]
    theta_kept, rows_kept = theta[where], rows[where]
    offset, packed = _cut_tables(k, starts, kept, allowed, edges, at, tables)
    keep_memory = False
    if use_memory:  # else no plan can break the budget
        worst = 0.0
        for v in range(n):
            most = rows_kept[new_starts[v]]
            for s in range(new_starts[v] + 1, new_starts[v + 1]):
                most = max(most, rows_kept[s])
            worst += most
        keep_memory = worst > cap
    big = big_factor * _scale(theta_kept, new_starts, packed, offset)
    for i in range(packed.shape[0]):
        if not np.isfinite(packed[i]):
            packed[i] = big
    return -1, kept, domain, theta_kept, edges, offset, packed, rows_kept, keep_memory, big


@_jit
def _oriented(
    k: np.ndarray, starts: np.ndarray, theta: np.ndarray, ends: np.ndarray,
    flat_tables: np.ndarray, table_at: np.ndarray, table_cols: np.ndarray,
    table_of_edge: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Self-loops onto ``theta`` (their diagonals); the other edges low -> high, with
    their tables so oriented, packed one after another (edges, where each starts, the
    tables)."""
    loops = 0
    size = 0
    for e in range(ends.shape[0]):
        u, v = ends[e, 0], ends[e, 1]
        loops += u == v
        size += 0 if u == v else k[u] * k[v]
    edges = np.empty((ends.shape[0] - loops, 2), dtype=np.int64)
    at = np.zeros(edges.shape[0] + 1, dtype=np.int64)
    packed = np.empty(size)
    m = 0
    for e in range(ends.shape[0]):
        u, v = ends[e, 0], ends[e, 1]
        source, cols = table_at[table_of_edge[e]], table_cols[table_of_edge[e]]
        if u == v:
            for s in range(k[u]):
                theta[starts[u] + s] = theta[starts[u] + s] + flat_tables[source + s * cols + s]
            continue
        lo, hi = min(u, v), max(u, v)
        edges[m, 0], edges[m, 1] = lo, hi
        for i in range(k[lo]):
            for j in range(k[hi]):
                # entry (label i of the low end, label j of the high end)
                entry = source + i * cols + j if u < v else source + j * cols + i
                packed[at[m] + i * k[hi] + j] = flat_tables[entry]
        at[m + 1] = at[m] + k[lo] * k[hi]
        m += 1
    return edges, at, packed


@_jit
def _prune(
    k: np.ndarray, starts: np.ndarray, allowed: np.ndarray, edges: np.ndarray,
    at: np.ndarray, tables: np.ndarray, memory: np.ndarray, use_memory: bool, cap: float,
) -> int:
    """Drop labels no finite, budget-respecting plan uses, to a fixed point; returns a
    node left with none (-1 if every node keeps one). Tables all finite prune nothing."""
    partial = np.zeros(edges.shape[0], dtype=np.bool_)
    for e in range(edges.shape[0]):
        for i in range(at[e], at[e + 1]):
            if not np.isfinite(tables[i]):
                partial[e] = True
                break
    changed = True
    while changed:
        changed = False
        for v in range(k.shape[0]):
            if not allowed[starts[v] : starts[v + 1]].any():
                return v
        if use_memory:
            changed |= _prune_memory(k, starts, allowed, memory, cap)
        for e in range(edges.shape[0]):
            if partial[e]:
                changed |= _prune_table(k, starts, allowed, edges[e, 0], edges[e, 1], tables, at[e])
    return -1


@_jit
def _prune_table(
    k: np.ndarray, starts: np.ndarray, allowed: np.ndarray, a: int, b: int,
    tables: np.ndarray, at: int,
) -> bool:
    """Labels of ``a`` (``b``) whose row (column) has no finite entry at an allowed label
    of the other end; both found first, then dropped."""
    ka, kb, sa, sb = k[a], k[b], starts[a], starts[b]
    rows, cols = np.zeros(ka, dtype=np.bool_), np.zeros(kb, dtype=np.bool_)
    for i in range(ka):
        for j in range(kb):
            if np.isfinite(tables[at + i * kb + j]):
                rows[i] |= allowed[sb + j]
                cols[j] |= allowed[sa + i]
    lost = False
    for i in range(ka):
        lost |= allowed[sa + i] and not rows[i]
    for j in range(kb):
        lost |= allowed[sb + j] and not cols[j]
    if lost:
        for i in range(ka):
            allowed[sa + i] &= rows[i]
        for j in range(kb):
            allowed[sb + j] &= cols[j]
    return lost


@_jit
def _prune_memory(
    k: np.ndarray, starts: np.ndarray, allowed: np.ndarray, memory: np.ndarray, cap: float
) -> bool:
    """Labels whose extra memory over the node's least exceeds the budget's slack."""
    n = k.shape[0]
    least = np.empty(n)
    total = 0.0
    for v in range(n):
        lo = np.inf
        for s in range(starts[v], starts[v + 1]):
            if allowed[s]:
                lo = min(lo, memory[s])
        least[v] = lo
        total += lo
    slack = cap - total
    changed = False
    for v in range(n):
        for s in range(starts[v], starts[v + 1]):
            if allowed[s] and memory[s] - least[v] > slack:
                allowed[s] = False
                changed = True
    return changed


@_jit
def _domains(
    k: np.ndarray, starts: np.ndarray, allowed: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per node the labels kept: their count, the labels (node after node), where each
    node's start."""
    n = k.shape[0]
    kept = np.zeros(n, dtype=np.int64)
    for v in range(n):
        for s in range(k[v]):
            kept[v] += allowed[starts[v] + s]
    new_starts = np.zeros(n + 1, dtype=np.int64)
    for v in range(n):
        new_starts[v + 1] = new_starts[v] + kept[v]
    domain = np.empty(new_starts[n], dtype=np.int64)
    for v in range(n):
        r = new_starts[v]
        for s in range(k[v]):
            if allowed[starts[v] + s]:
                domain[r] = s
                r += 1
    return kept, domain, new_starts


@_jit
def _cut_tables(
    k: np.ndarray, starts: np.ndarray, kept: np.ndarray, allowed: np.ndarray,
    edges: np.ndarray, at: np.ndarray, tables: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Each table cut to the labels kept at its two ends, packed (where each starts, the
    tables)."""
    offset = np.zeros(edges.shape[0], dtype=np.int64)
    size = 0
    for e in range(edges.shape[0]):
        offset[e] = size
        size += kept[edges[e, 0]] * kept[edges[e, 1]]
    packed = np.empty(size)
    for e in range(edges.shape[0]):
        a, b = edges[e, 0], edges[e, 1]
        r = offset[e]
        for i in range(k[a]):
            if allowed[starts[a] + i]:
                for j in range(k[b]):
                    if allowed[starts[b] + j]:
                        packed[r] = tables[at[e] + i * k[b] + j]
                        r += 1
    return offset, packed


@_jit
def _scale(unary: np.ndarray, starts: np.ndarray, tables: np.ndarray, offset: np.ndarray) -> float:
    """An upper bound on the magnitude of any feasible plan's energy: the largest
    magnitude of each unary, then of each table's finite entries (tables with none
    left out), added one after another."""
    total = 1.0
    n = starts.shape[0] - 1
    if n:
        nodes = 0.0
        for v in range(n):
            most = 0.0
            for s in range(starts[v], starts[v + 1]):
                most = max(most, abs(unary[s])) if s > starts[v] else abs(unary[s])
            nodes = most if v == 0 else nodes + most
        total += nodes
    for e in range(offset.shape[0]):
        end = offset[e + 1] if e + 1 < offset.shape[0] else tables.shape[0]
        most, finite = 0.0, False
        for i in range(offset[e], end):
            x = tables[i]
            if np.isfinite(x):
                most = max(most, abs(x)) if finite else abs(x)
                finite = True
        if finite:
            total += most
    return total


@_jit
def _colour_classes(start: np.ndarray, nbr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = start.shape[0] - 1
    colour = np.full(n, -1, dtype=np.int64)
    for v in range(n):
        used = np.zeros(start[v + 1] - start[v] + 1, dtype=np.bool_)
        for p in range(start[v], start[v + 1]):
            c = colour[nbr[p]]
            if 0 <= c < used.shape[0]:
                used[c] = True
        c = 0
        while used[c]:
            c += 1
        colour[v] = c
    count = colour.max() + 1 if n else 0
    at = np.zeros(count + 1, dtype=np.int64)
    for v in range(n):
        at[colour[v] + 1] += 1
    for c in range(count):
        at[c + 1] += at[c]
    nodes, fill = np.empty(n, dtype=np.int64), at[:-1].copy()
    for v in range(n):
        nodes[fill[colour[v]]] = v
        fill[colour[v]] += 1
    return at, nodes


@_inline
def _mark(seen: np.ndarray, stamp: int, found: np.ndarray, m: int, z: int) -> int:
    """Count ``z`` once per ``stamp`` (and write it where ``found`` has room)."""
    if seen[z] == stamp:
        return m
    seen[z] = stamp
    if m < found.shape[0]:
        found[m] = z
    return m + 1


@_jit
def _within_two(start: np.ndarray, nbr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = start.shape[0] - 1
    seen = np.full(n, -1, dtype=np.int64)
    at = np.zeros(n + 1, dtype=np.int64)
    found = np.empty(0, dtype=np.int64)
    for count in (True, False):  # count each node's reach, then write it
        if not count:
            found = np.empty(at[n], dtype=np.int64)
        for v in range(n):
            stamp = v if count else n + v
            m = 0 if count else at[v]
            m = _mark(seen, stamp, found, m, v)
            for p in range(start[v], start[v + 1]):
                m = _mark(seen, stamp, found, m, nbr[p])
                for q in range(start[nbr[p]], start[nbr[p] + 1]):
                    m = _mark(seen, stamp, found, m, nbr[q])
            if count:
                at[v + 1] = at[v] + m
    return at, found


@_jit
def _energy(
    unary: np.ndarray, starts: np.ndarray, x: np.ndarray, edges: np.ndarray,
    flat: np.ndarray, offset: np.ndarray, columns: np.ndarray,
) -> float:
    """``Mrf.energy``: the unaries added node after node, plus the tables' entries at
    ``x`` summed as numpy sums an array (pairwise, in edge order)."""
    total = 0.0
    for v in range(x.shape[0]):
        total += unary[starts[v] + x[v]]
    picked = np.empty(edges.shape[0])
    for e in range(edges.shape[0]):
        picked[e] = flat[offset[e] + x[edges[e, 0]] * columns[e] + x[edges[e, 1]]]
    return total + sums.pairwise_sum(picked, 0, picked.shape[0]) if edges.shape[0] else total
