"""The compiled presolve's Python side: a tie-collapsed problem in, the reduced one out.

``reduce_compiled`` lays the problem (``collapse.Collapsed``) out as
``compiled_reduce``'s arrays, runs the fixed point in one call and returns a
``CompiledGraph``: what ``presolve`` reads of a reduced ``reduce.Graph`` (each
node's labels, the survivors, the offset, the reduced problem flat or as a
``Problem``, a plan's expansion), bit for bit. It takes the problems
``collapse`` makes: edges between distinct nodes, at most one per pair, every
node with a label; it returns None for any other, which ``Graph`` reduces
instead.
"""

from __future__ import annotations

from functools import cached_property

import numba
import numpy as np

from torchtitan_autoparallel.planner.problem import (
    FlatProblem,
    InfeasibleProblem,
    Problem,
    ProblemArrays,
)
from torchtitan_autoparallel.planner.solvers import reduce
from torchtitan_autoparallel.planner.solvers.collapse import Collapsed
from torchtitan_autoparallel.planner.solvers.compiled_reduce import (
    ARENA,
    EDGES,
    FIXED,
    FIXED_MEMORY,
    ISOLATED,
    LEAF,
    NOTHING_LEFT,
    OFFSET,
    OUT_OF_ROOM,
    RECORDS,
    STATUS,
    STATUS_NODE,
    _run,
    _State,
    _strides,
    readout,
)
from torchtitan_autoparallel.planner.solvers.ilp_model import memory_message

_jit = numba.njit(cache=True, nogil=True)
ROOM = 2  # arena room past the shared tables, in multiples of every edge's (a retry doubles it)
COUNTERS, SUMS = 8, 2


class CompiledGraph:
    """A reduced problem as ``compiled_reduce`` left it; read as a reduced ``Graph``."""

    def __init__(self, state: _State, collapsed: Collapsed) -> None:
        self._state = state  # for the compiled expansion and tables
        self._g = readout(state)
        self.collapsed = collapsed
        self.alive = self._g.alive
        self.budget = collapsed.flat.memory_budget
        self.offset = float(self._g.sums[OFFSET])
        self.fixed_memory = float(self._g.sums[FIXED_MEMORY])

    @cached_property
    def domain(self) -> list[np.ndarray]:
        g = self._g
        return [g.dom[a : a + k].copy() for a, k in zip(g.start[:-1].tolist(), g.size.tolist())]

    def _holders(self) -> np.ndarray:
        return np.flatnonzero(self.alive & self._g.has_mem)

    def check_fixed_memory(self) -> None:
        """``Graph.check_fixed_memory``: with no memory left to choose, the fixed part must fit."""
        if self.budget is None or len(self._holders()):
            return
        if self.fixed_memory > self.budget * (1 + reduce.BUDGET_RTOL):
            raise InfeasibleProblem(memory_message(self.budget, self.fixed_memory))

    def expand_plan(self, survivors: np.ndarray, x: np.ndarray) -> np.ndarray:
        """The tie-collapsed plan of a reduced plan ``x`` (labels of ``survivors``)."""
        g = self._g
        full = np.full(len(self.alive), -1, dtype=np.int64)
        full[survivors] = g.dom[g.start[survivors] + np.asarray(x, dtype=np.int64)]
        _expand(self._state, full)
        return full

    @cached_property
    def survivors(self) -> np.ndarray:
        return np.flatnonzero(self.alive)

    @cached_property
    def _where(self) -> np.ndarray:
        """Each survivor's labels where the engine keeps them."""
        g, size = self._g, self._g.size[self.survivors]
        return np.repeat(g.start[self.survivors], size) + (
            np.arange(int(size.sum())) - np.repeat(np.cumsum(size) - size, size)
        )

    @cached_property
    def reduced_flat(self) -> FlatProblem:
        """The survivors, their tables and memory (``Graph.reduced_problem``, flat)."""
        g, survivors, where = self._g, self.survivors, self._where
        edges, packed = _survivor_tables(self._state, survivors)
        size = g.size[survivors]
        holds = g.has_mem[survivors]
        holders = np.flatnonzero(holds)
        memory = g.mem[where][np.repeat(holds, size)]
        if len(holders):  # the memory every plan uses rides on one holder: the budget stays
            memory[: size[holders[0]]] += self.fixed_memory
        shapes = np.stack([size[edges[:, 0]], size[edges[:, 1]]], axis=1).reshape(-1, 2)
        arrays = ProblemArrays.packed(
            size, g.unary[where], holders, memory, packed, shapes, np.arange(len(edges))
        )
        return FlatProblem(arrays, edges, self.budget if len(holders) else None)

    def reduced_problem(self) -> tuple[Problem, np.ndarray]:
        """``Graph.reduced_problem``: the reduced problem with names and labels."""
        flat, survivors, collapsed = self.reduced_flat, self.survivors, self.collapsed
        domain = self._g.dom[self._where].tolist()
        bounds = np.cumsum(flat.arrays.k).tolist()
        labels = [
            [collapsed.labels(v)[s] for s in domain[b - n : b]]
            for v, n, b in zip(survivors.tolist(), flat.arrays.k.tolist(), bounds)
        ]
        names = [collapsed.node_name(v) for v in survivors.tolist()]
        return Problem.from_arrays(names, labels, flat.arrays, flat.edges, flat.memory_budget), survivors


def reduce_compiled(
    collapsed: Collapsed, prune_memory: bool = True, dominance: bool = True, scan: bool = True
) -> CompiledGraph | None:
    """``Graph(collapsed.problem(), prune_memory).reduce(dominance)``, compiled; None where
    the problem is not of the form this engine takes (module docstring)."""
    flat = collapsed.flat
    if not _supported(flat):
        return None
    room = ROOM
    pins = np.array(sorted(flat.pins.items()), dtype=np.int64).reshape(-1, 2)
    while True:
        g = _state(flat, prune_memory, dominance, _arena(collapsed, room), scan)
        _run(g, pins[:, 0].copy(), pins[:, 1].copy())
        counters = readout(g).counters
        status = int(counters[STATUS])
        if status != OUT_OF_ROOM:
            break
        room = max(1, 2 * room)  # a chain of eliminations made more new tables than that
    if status == NOTHING_LEFT:
        raise InfeasibleProblem(reduce.nothing_left(collapsed.node_name(int(counters[STATUS_NODE]))))
    return CompiledGraph(g, collapsed)


def _supported(flat: FlatProblem) -> bool:
    k, edges, n = flat.arrays.k, flat.edges, flat.num_nodes
    if n == 0 or (k == 0).any():
        return False
    a, b = edges[:, 0], edges[:, 1]
    if (a == b).any():
        return False
    keys = np.minimum(a, b) * n + np.maximum(a, b)
    return len(np.unique(keys)) == len(keys)


def _arena(collapsed: Collapsed, room: int) -> np.ndarray:
    """The distinct tables, shared until written (``compiled_reduce``), then room for
    ``room`` times every edge's table: ``collapse``'s buffer where it left that much
    (``presolve`` asks it to), else a copy."""
    flat = collapsed.flat
    tables, edges, k = flat.arrays.flat_tables, flat.edges, flat.arrays.k
    need = len(tables) + room * int((k[edges[:, 0]] * k[edges[:, 1]]).sum())
    buffer = collapsed.take_buffer()
    if buffer is not None and len(buffer) >= need:
        return buffer
    arena = np.empty(need)
    arena[: len(tables)] = tables
    return arena


def _state(
    problem: FlatProblem, prune_memory: bool, dominance: bool, arena: np.ndarray,
    scan: bool = True,
) -> _State:
    """The engine's arrays for ``problem`` (``arena``: ``_arena``'s), laid out as
    ``compiled_reduce`` describes."""
    flat = problem.arrays
    holders = flat.memory_nodes
    if problem.memory_budget is None:  # as ``Graph``: memory counts only under a budget
        holders = holders[:0]
    settings = (
        np.inf if problem.memory_budget is None else float(problem.memory_budget),
        bool(prune_memory), bool(dominance), bool(scan),
        float(reduce.BUDGET_RTOL), float(reduce.SEPARABLE_RTOL),
        int(reduce.DOMINANCE_MAX_WORK),
    )
    return _new_state(
        flat.k, flat.unary, holders, flat.memory_starts, flat.memory, problem.edges,
        flat.flat_tables.shape[0], flat.table_at, flat.table_of_edge, arena, settings,
    )


@_jit
def _new_state(
    k: np.ndarray, unary: np.ndarray, holders: np.ndarray, memory_starts: np.ndarray,
    memory: np.ndarray, edges: np.ndarray, shared: int, table_at: np.ndarray,
    table_of_edge: np.ndarray, arena: np.ndarray, settings: tuple,
) -> _State:
    n, count = k.shape[0], edges.shape[0]
    start = np.zeros(n + 1, dtype=np.int64)
    for v in range(n):
        start[v + 1] = start[v] + k[v]
    total = start[n]
    dom = np.empty(total, dtype=np.int64)
    for v in range(n):
        for s in range(k[v]):
            dom[start[v] + s] = s
    mem, has_mem = np.zeros(total), np.zeros(n, dtype=np.bool_)
    for i in range(holders.shape[0]):
        v = holders[i]
        has_mem[v] = True
        for s in range(k[v]):
            mem[start[v] + s] = memory[memory_starts[i] + s]
    degree = np.zeros(n, dtype=np.int64)
    for e in range(count):
        degree[edges[e, 0]] += 1
        degree[edges[e, 1]] += 1
    adj_start = np.zeros(n, dtype=np.int64)
    for v in range(1, n):
        adj_start[v] = adj_start[v - 1] + degree[v - 1] + 1  # one spare: ``compiled_reduce``
    slots = adj_start[n - 1] + degree[n - 1] + 1 if n else 0
    adj_count, adj_nbr, adj_edge = np.zeros(n, np.int64), np.zeros(slots, np.int64), np.zeros(slots, np.int64)
    e_row, e_col, e_at = np.zeros(count + n, np.int64), np.zeros(count + n, np.int64), np.zeros(count + n, np.int64)
    for e in range(count):  # each node's neighbours in edge order, as ``Graph`` inserts them
        u, v = edges[e, 0], edges[e, 1]
        for w, x in ((u, v), (v, u)):
            adj_nbr[adj_start[w] + adj_count[w]] = x
            adj_edge[adj_start[w] + adj_count[w]] = e
            adj_count[w] += 1
        e_row[e], e_col[e], e_at[e] = u, v, table_at[table_of_edge[e]]
    counters = np.zeros(COUNTERS, dtype=np.int64)
    counters[EDGES], counters[ARENA] = count, shared
    kmax = 0
    for v in range(n):
        kmax = max(kmax, k[v])
    budget, prune_memory, dominance, scan, budget_rtol, separable_rtol, max_work = settings
    return _State(
        start, k.copy(), dom, unary.copy(), mem, has_mem, np.ones(n, dtype=np.bool_),
        adj_start, adj_count, adj_nbr, adj_edge, e_row, e_col, e_at,
        np.zeros(count + n, dtype=np.bool_), arena,
        np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.bool_),
        np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros((n, 2), np.int64),
        np.zeros((n, 3), np.int64), np.zeros(n, np.int64), np.zeros((n, 7), np.int64),
        np.empty(3 * kmax * n + 1, np.int64),
        counters, np.zeros(SUMS),
        budget, prune_memory, dominance, scan, budget_rtol, separable_rtol, max_work,
    )


@_jit
def _survivor_tables(g: _State, survivors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The edges among the survivors as ``presolve._reduced_problem`` lists them (each
    survivor's higher neighbours, in adjacency order; reduced indices), with their
    tables (the lower end's labels as rows) packed one after another."""
    index = np.full(g.alive.shape[0], -1, dtype=np.int64)
    for i in range(survivors.shape[0]):
        index[survivors[i]] = i
    size, nbr, arena = g.size, g.adj_nbr, g.arena
    count, entries = 0, 0
    for v in survivors:
        for p in range(g.adj_start[v], g.adj_start[v] + g.adj_count[v]):
            if nbr[p] > v:
                count += 1
                entries += size[v] * size[nbr[p]]
    edges, at, packed = np.empty((count, 2), np.int64), np.empty(count + 1, np.int64), np.empty(entries)
    m, at[0] = 0, 0
    for v in survivors:
        for p in range(g.adj_start[v], g.adj_start[v] + g.adj_count[v]):
            u = nbr[p]
            if u > v:
                edges[m, 0], edges[m, 1] = index[v], index[u]
                base, rows, cols = _strides(g, g.adj_edge[p], v)
                ku = size[u]
                for s in range(size[v]):
                    for j in range(ku):
                        packed[at[m] + s * ku + j] = arena[base + s * rows + j * cols]
                at[m + 1] = at[m] + size[v] * ku
                m += 1
    return edges, packed


@_jit
def _expand(g: _State, x: np.ndarray) -> None:
    """Fill the eliminated nodes of ``x`` (collapsed indices; survivors set), last
    elimination first, as ``Graph.expand``."""
    ints, arena, unary = g.ints, g.arena, g.unary
    for r in range(g.counters[RECORDS] - 1, -1, -1):
        kind, v, at = g.r_kind[r], g.r_node[r], g.r_ints[r]
        if kind == FIXED or kind == ISOLATED:
            x[v] = ints[at]
        elif kind == LEAF:
            ku = g.r_sizes[r, 0]
            x[v] = ints[at + ku + np.searchsorted(ints[at : at + ku], x[g.r_parent[r, 0]])]
        else:
            ku, kv, kw = g.r_sizes[r, 0], g.r_sizes[r, 1], g.r_sizes[r, 2]
            i = np.searchsorted(ints[at : at + ku], x[g.r_parent[r, 0]])
            j = np.searchsorted(ints[at + ku : at + ku + kw], x[g.r_parent[r, 1]])
            # ``kernels.first_argmin_plus`` of the elimination's ``left`` (the u-v table
            # plus v's unary) and ``right`` (the v-w table), read where they lie
            link = g.r_link
            at1, rows1, cols1 = link[r, 0], link[r, 1], link[r, 2]
            at2, rows2, cols2, own = link[r, 3], link[r, 4], link[r, 5], link[r, 6]
            best, cost = 0, 0.0
            for s in range(kv):
                c = (arena[at1 + i * rows1 + s * cols1] + unary[own + s]) + arena[at2 + s * rows2 + j * cols2]
                if s == 0 or c < cost:
                    best, cost = s, c
            x[v] = ints[at + ku + kw + best]
