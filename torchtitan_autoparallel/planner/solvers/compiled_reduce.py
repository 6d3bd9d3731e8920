"""``reduce.Graph``'s fixed point in one compiled call, on flat arrays.

``Graph`` keeps the graph as dictionaries of numpy tables, and on the 2-D
meshes its few hundred node visits spent about 70% of the presolve in Python
bookkeeping around kernels that take microseconds. This runs the same rules
in the same order (``reduce`` documents them) inside numba: the work list,
each node's tables in ``Graph``'s dictionary order, and every sum with the
same operands in the same order, so the reduced problem, its offset and every
expanded plan are bitwise ``Graph``'s (``tests/test_compiled_reduce.py``).
``Graph`` stays the reference, and the base of the overlap presolve, whose
rules differ.

Layout (``_State``): node ``v`` owns ``k0[v]`` slots of the node pools from
``start[v]``, its ``size[v]`` current labels compacted at their front; its
neighbours sit in adjacency slots from ``adj_start[v]`` (capacity: its first
degree plus one, which no reduction exceeds), in insertion order. Edge ``e``'s
table lives in ``arena`` from ``e_at[e]``, row-major, rows indexed by
``e_row[e]``'s labels. The arena starts with the problem's distinct tables,
which parallel layers' edges share; an edge gets a table of its own
(``e_own``) only when one of its entries is first written, so the tables only
ever read are never copied. Restricting a node compacts its own tables in
place; a chain elimination that creates an edge appends its table.
Eliminations are recorded (``r_*``, their integers in a pool) so that a plan of
the survivors expands in one compiled pass too. A chain link's record points at
its two tables and its unary where they lie: once a node is eliminated nothing
writes them again (its edges left every adjacency, and new tables go to the end
of the arena), so they need no copy.

The state is a numba ``StructRef``: every helper takes it as one pointer. As a
tuple of its 34 fields it was unpacked, and its references counted, field by
field at every call, which made the engine's first compile twice as long
(about 45 s against 25 s here) for no faster run. Each field read off it still
counts a reference (an atomic update), so loops read arrays bound to local
names first: reading them off the state inside the loops made this slower
than ``Graph``.
"""

from __future__ import annotations

from collections import namedtuple

import numba
import numpy as np
from numba.core import types
from numba.experimental import structref

from torchtitan_autoparallel.planner.solvers import kernels

_jit = numba.njit(cache=True, nogil=True)
_inline = numba.njit(cache=True, nogil=True, inline="always")

OK, NOTHING_LEFT, OUT_OF_ROOM = 0, 1, 2  # ``counters[STATUS]``
FIXED, ISOLATED, LEAF, LINK = 0, 1, 2, 3  # ``r_kind``
# ``counters`` slots
EDGES, ARENA, RECORDS, INTS, HEAD, QUEUED, STATUS, STATUS_NODE = range(8)
# ``sums`` slots
OFFSET, FIXED_MEMORY = 0, 1

FIELDS = (
    "start", "size", "dom", "unary", "mem", "has_mem", "alive",
    "adj_start", "adj_count", "adj_nbr", "adj_edge",
    "e_row", "e_col", "e_at", "e_own", "arena",
    "ring", "queued",
    "r_kind", "r_node", "r_parent", "r_sizes", "r_ints", "r_link", "ints",
    "counters", "sums",
    "budget", "prune_memory", "dominance", "scan",
    "budget_rtol", "separable_rtol", "max_work",
)


@structref.register
class StateType(types.StructRef):
    """The numba type of ``_State``; fields keep their types as built."""

    def preprocess_fields(self, fields):
        return tuple((name, types.unliteral(t)) for name, t in fields)


class _State(structref.StructRefProxy):
    """The engine's arrays and settings (``FIELDS``); ``compiled_graph._new_state`` builds it."""


structref.define_proxy(_State, StateType, FIELDS)
# what the Python side reads of a finished run (``readout``)
Readout = namedtuple("Readout", "alive sums counters dom start size has_mem mem unary")


# --- the work list and the adjacency -------------------------------------------


@_inline
def _push(g: _State, v: int) -> None:
    if g.alive[v] and not g.queued[v]:
        g.queued[v] = True
        n = g.ring.shape[0]
        g.ring[(g.counters[HEAD] + g.counters[QUEUED]) % n] = v
        g.counters[QUEUED] += 1


@_inline
def _pop(g: _State) -> int:
    v = g.ring[g.counters[HEAD]]
    g.counters[HEAD] = (g.counters[HEAD] + 1) % g.ring.shape[0]
    g.counters[QUEUED] -= 1
    g.queued[v] = False
    return v


@_inline
def _find(g: _State, v: int, u: int) -> int:
    """Where ``u`` sits in ``v``'s adjacency, or -1."""
    lo, nbr = g.adj_start[v], g.adj_nbr
    for p in range(lo, lo + g.adj_count[v]):
        if nbr[p] == u:
            return p
    return -1


@_jit
def _unlink(g: _State, v: int, u: int) -> None:
    """``u`` out of ``v``'s adjacency, the others keeping their order (``del`` on a dict)."""
    p, nbr, edge = _find(g, v, u), g.adj_nbr, g.adj_edge
    last = g.adj_start[v] + g.adj_count[v] - 1
    for q in range(p, last):
        nbr[q] = nbr[q + 1]
        edge[q] = edge[q + 1]
    g.adj_count[v] -= 1


@_inline
def _append(g: _State, v: int, u: int, e: int) -> None:
    p = g.adj_start[v] + g.adj_count[v]
    g.adj_nbr[p] = u
    g.adj_edge[p] = e
    g.adj_count[v] += 1


@_jit
def _drop_edge(g: _State, v: int, u: int) -> None:
    _unlink(g, v, u)
    _unlink(g, u, v)


@_jit
def _push_neighbours(g: _State, v: int) -> None:
    lo = g.adj_start[v]
    for p in range(lo, lo + g.adj_count[v]):
        _push(g, g.adj_nbr[p])


# --- tables --------------------------------------------------------------------


@_inline
def _strides(g: _State, e: int, v: int) -> tuple[int, int, int]:
    """Edge ``e``'s table seen from ``v``: entry (``v``'s label ``s``, the other end's
    ``j``) sits at ``at + s * rows + j * cols`` of the arena."""
    if g.e_row[e] == v:
        return g.e_at[e], g.size[g.e_col[e]], 1
    return g.e_at[e], 1, g.size[v]


@_jit
def _side_by_side(g: _State, v: int) -> tuple[np.ndarray, np.ndarray]:
    """``v``'s tables (its labels as rows), in adjacency order, as ``reduce._side_by_side``."""
    size, nbr, arena = g.size, g.adj_nbr, g.arena
    kv, lo, count = size[v], g.adj_start[v], g.adj_count[v]
    starts = np.zeros(count + 1, dtype=np.int64)
    for i in range(count):
        starts[i + 1] = starts[i] + size[nbr[lo + i]]
    side = np.empty((kv, starts[count]))
    for i in range(count):
        at, rows, cols = _strides(g, g.adj_edge[lo + i], v)
        c0, ku = starts[i], size[nbr[lo + i]]
        if cols == 1:  # rows ours: each row a run of the arena (a loop the compiler widens)
            for s in range(kv):
                for j in range(ku):
                    side[s, c0 + j] = arena[at + s * rows + j]
        else:  # stored the other way round: each column of ``side`` a run of the arena
            for j in range(ku):
                for s in range(kv):
                    side[s, c0 + j] = arena[at + j * cols + s]
    return side, starts


@_jit
def _memory_of(g: _State, v: int) -> np.ndarray:
    """``v``'s memory row, or an empty one where it holds none (the kernels' convention)."""
    if g.has_mem[v]:
        return g.mem[g.start[v] : g.start[v] + g.size[v]].copy()
    return np.zeros(0)


# --- dropping labels --------------------------------------------------------------


@_inline
def _room(g: _State, entries: int) -> int:
    """Where ``entries`` new arena entries start (-1, with the status set, if the arena
    is full: the engine starts again with more)."""
    at = g.counters[ARENA]
    if at + entries > g.arena.shape[0]:
        g.counters[STATUS] = OUT_OF_ROOM
        return -1
    g.counters[ARENA] += entries
    return at


@_jit
def _restrict(g: _State, v: int, keep: np.ndarray) -> None:
    """Keep ``v``'s labels where ``keep``: its vectors and every table, compacted (each
    entry moves only towards the front, after it has been read: in place where the
    edge owns its table, else into a table of its own)."""
    kv, lo, arena = g.size[v], g.start[v], g.arena
    kept = 0
    for s in range(kv):
        kept += keep[s]
    for p in range(g.adj_start[v], g.adj_start[v] + g.adj_count[v]):
        e, ku = g.adj_edge[p], g.size[g.adj_nbr[p]]
        at = to = g.e_at[e]
        if not g.e_own[e]:
            to = _room(g, kept * ku)
            if to < 0:
                return
            g.e_at[e], g.e_own[e] = to, True
        if g.e_row[e] == v:
            r = 0
            for s in range(kv):
                if keep[s]:
                    for j in range(ku):
                        arena[to + r * ku + j] = arena[at + s * ku + j]
                    r += 1
        else:
            for i in range(ku):
                c = 0
                for s in range(kv):
                    if keep[s]:
                        arena[to + i * kept + c] = arena[at + i * kv + s]
                        c += 1
    dom, unary, mem = g.dom, g.unary, g.mem
    r = 0
    for s in range(kv):
        if keep[s]:
            dom[lo + r], unary[lo + r], mem[lo + r] = dom[lo + s], unary[lo + s], mem[lo + s]
            r += 1
    g.size[v] = kept


@_jit
def _normalise_memory(g: _State, v: int) -> None:
    """``Graph._normalise_memory``: the least memory moves into the fixed part."""
    kv, lo, mem = g.size[v], g.start[v], g.mem
    if not g.has_mem[v] or kv == 0:
        return
    least = mem[lo]
    for s in range(1, kv):
        least = min(least, mem[lo + s])
    if not np.isfinite(least):
        return
    g.sums[FIXED_MEMORY] += least
    nonzero = False
    for s in range(kv):
        mem[lo + s] = mem[lo + s] - least
        nonzero |= mem[lo + s] != 0
    if not nonzero:
        g.has_mem[v] = False
        _push(g, v)


@_jit
def _drop(g: _State, v: int, keep: np.ndarray) -> None:
    kv = g.size[v]
    kept = 0
    for s in range(kv):
        kept += keep[s]
    if kv and kept == kv:
        return
    if kept == 0:
        g.counters[STATUS], g.counters[STATUS_NODE] = NOTHING_LEFT, v
        return
    _restrict(g, v, keep)
    _normalise_memory(g, v)
    _push_neighbours(g, v)


@_jit
def _fold_separable(g: _State, v: int) -> tuple[np.ndarray, bool, np.ndarray, np.ndarray, bool]:
    """``Graph._fold_separable``: fold ``v``'s separable tables into the unaries; returns
    which labels are usable, whether all are, and the tables side by side as scanned
    with whether they still are (nothing folded)."""
    kv, lo = g.size[v], g.start[v]
    side, starts = _side_by_side(g, v)
    limit = np.inf
    if g.prune_memory and g.has_mem[v]:
        limit = g.budget * (1 + g.budget_rtol)
    split, usable, any_split, all_usable = kernels.scan(
        g.unary[lo : lo + kv].copy(), side, starts, g.separable_rtol,
        _memory_of(g, v), g.sums[FIXED_MEMORY], limit,
    )
    if any_split:
        a0, count = g.adj_start[v], g.adj_count[v]
        nbrs, edges = g.adj_nbr[a0 : a0 + count].copy(), g.adj_edge[a0 : a0 + count].copy()
        unary, arena = g.unary, g.arena
        for i in range(count):
            if split[i]:
                u = nbrs[i]
                at, rows, cols = _strides(g, edges[i], v)
                for s in range(kv):
                    unary[lo + s] += arena[at + s * rows]
                ulo, corner = g.start[u], arena[at]
                for j in range(g.size[u]):
                    unary[ulo + j] += arena[at + j * cols] - corner
                _drop_edge(g, v, u)
                _push(g, u)
    return usable, all_usable, side, starts, not any_split


@_jit
def _dominated(
    g: _State, v: int, side: np.ndarray, starts: np.ndarray, current: bool
) -> np.ndarray:
    """``Graph._dominated`` on ``v``'s tables side by side (laid out again unless
    ``current``: as ``Graph`` reuses its scan while no table changed)."""
    kv, lo = g.size[v], g.start[v]
    if not current:
        side, starts = _side_by_side(g, v)
    if kv * kv * side.shape[1] > g.max_work:
        return np.zeros(kv, dtype=np.bool_)
    return kernels.dominated(
        g.unary[lo : lo + kv].copy(), side, starts, _memory_of(g, v)
    )


# --- eliminations --------------------------------------------------------------


@_jit
def _record(g: _State, kind: int, v: int, u: int, w: int, ints: int) -> int:
    """A new elimination record with room for ``ints``; returns its index."""
    r = g.counters[RECORDS]
    g.r_kind[r], g.r_node[r], g.r_parent[r, 0], g.r_parent[r, 1] = kind, v, u, w
    g.r_ints[r] = g.counters[INTS]
    g.counters[RECORDS] += 1
    g.counters[INTS] += ints
    return r


@_jit
def _copy_domain(g: _State, v: int, to: int) -> int:
    """``v``'s labels into the record integers from ``to``; returns where they end."""
    ints, dom, lo = g.ints, g.dom, g.start[v]
    for s in range(g.size[v]):
        ints[to + s] = dom[lo + s]
    return to + g.size[v]


@_jit
def _remove(g: _State, v: int) -> None:
    """``Graph._remove`` once the record is made: every edge goes, its ends re-queued."""
    while g.adj_count[v]:
        u = g.adj_nbr[g.adj_start[v]]
        _drop_edge(g, v, u)
        _push(g, u)
    g.alive[v] = False


@_jit
def _eliminate_fixed(g: _State, v: int) -> None:
    lo, unary, arena = g.start[v], g.unary, g.arena
    for p in range(g.adj_start[v], g.adj_start[v] + g.adj_count[v]):
        u = g.adj_nbr[p]
        at, _, cols = _strides(g, g.adj_edge[p], v)
        ulo = g.start[u]
        for j in range(g.size[u]):
            unary[ulo + j] += arena[at + j * cols]
    g.sums[OFFSET] += unary[lo]
    if g.has_mem[v]:
        g.sums[FIXED_MEMORY] += g.mem[lo]
    r = _record(g, FIXED, v, -1, -1, 1)
    g.ints[g.r_ints[r]] = g.dom[lo]
    _remove(g, v)


@_jit
def _eliminate_isolated(g: _State, v: int) -> None:
    lo, best, unary = g.start[v], 0, g.unary
    for s in range(1, g.size[v]):
        if unary[lo + s] < unary[lo + best]:
            best = s
    if unary[lo + best] == np.inf:  # unscanned (``Graph._visit``): nothing is usable
        g.counters[STATUS], g.counters[STATUS_NODE] = NOTHING_LEFT, v
        return
    g.sums[OFFSET] += unary[lo + best]
    r = _record(g, ISOLATED, v, -1, -1, 1)
    g.ints[g.r_ints[r]] = g.dom[lo + best]
    _remove(g, v)


@_jit
def _eliminate_leaf(g: _State, v: int) -> None:
    """Per label ``i`` of the neighbour ``u``: ``v``'s first best label and its cost."""
    p = g.adj_start[v]
    u = g.adj_nbr[p]
    at, rows, cols = _strides(g, g.adj_edge[p], u)
    ku, kv, lo, ulo = g.size[u], g.size[v], g.start[v], g.start[u]
    r = _record(g, LEAF, v, u, -1, 2 * ku)
    g.r_sizes[r, 0] = ku
    choice = _copy_domain(g, u, g.r_ints[r])
    unary, arena, ints, dom = g.unary, g.arena, g.ints, g.dom
    for i in range(ku):
        best, cost = 0, arena[at + i * rows] + unary[lo]
        for s in range(1, kv):
            c = arena[at + i * rows + s * cols] + unary[lo + s]
            if c < cost:
                best, cost = s, c
        unary[ulo + i] += cost
        ints[choice + i] = dom[lo + best]
    _remove(g, v)


@_jit
def _eliminate_link(g: _State, v: int) -> bool:
    """``Graph._eliminate_link``: the min-plus product of ``v``'s two tables joins the
    ``u``-``w`` table (made if need be, unless it would outgrow the two it replaces)."""
    a0 = g.adj_start[v]
    u, w, e_uv, e_vw = g.adj_nbr[a0], g.adj_nbr[a0 + 1], g.adj_edge[a0], g.adj_edge[a0 + 1]
    ku, kv, kw, lo = g.size[u], g.size[v], g.size[w], g.start[v]
    p = _find(g, u, w)
    if p < 0 and ku * kw > kv * (ku + kw):
        return False
    shared = p >= 0 and not g.e_own[g.adj_edge[p]]
    if (p < 0 or shared) and g.counters[ARENA] + ku * kw > g.arena.shape[0]:
        g.counters[STATUS] = OUT_OF_ROOM
        return True
    arena, unary = g.arena, g.unary
    left, right = np.empty((ku, kv)), np.empty((kv, kw))
    at, rows, cols = _strides(g, e_uv, u)
    for i in range(ku):
        for s in range(kv):
            left[i, s] = arena[at + i * rows + s * cols] + unary[lo + s]
    at, rows, cols = _strides(g, e_vw, v)
    for s in range(kv):
        for j in range(kw):
            right[s, j] = arena[at + s * rows + j * cols]
    product = kernels.min_plus(left, right)
    if p >= 0:  # into the u-w table (a copy of its own first, where it shares one)
        e = g.adj_edge[p]
        at, rows, cols = _strides(g, e, u)
        to = at
        if shared:
            to = _room(g, ku * kw)
            g.e_at[e], g.e_own[e] = to, True
        for i in range(ku):
            for j in range(kw):
                arena[to + i * rows + j * cols] = arena[at + i * rows + j * cols] + product[i, j]
    else:
        e = g.counters[EDGES]
        g.counters[EDGES] += 1
        at = _room(g, ku * kw)
        g.e_row[e], g.e_col[e], g.e_at[e], g.e_own[e] = u, w, at, True
        for i in range(ku):
            for j in range(kw):
                arena[at + i * kw + j] = product[i, j]
        _append(g, u, w, e)
        _append(g, w, u, e)
    _record_link(g, v, u, w, e_uv, e_vw)
    _remove(g, v)
    return True


@_jit
def _record_link(g: _State, v: int, u: int, w: int, e_uv: int, e_vw: int) -> None:
    """The three domains, and where the ``u``-``v`` table (seen from ``u``), the
    ``v``-``w`` one (seen from ``v``) and ``v``'s unary lie: all frozen from now on."""
    ku, kv, kw = g.size[u], g.size[v], g.size[w]
    r = _record(g, LINK, v, u, w, ku + kw + kv)
    g.r_sizes[r, 0], g.r_sizes[r, 1], g.r_sizes[r, 2] = ku, kv, kw
    _copy_domain(g, v, _copy_domain(g, w, _copy_domain(g, u, g.r_ints[r])))
    g.r_link[r, 0], g.r_link[r, 1], g.r_link[r, 2] = _strides(g, e_uv, u)
    g.r_link[r, 3], g.r_link[r, 4], g.r_link[r, 5] = _strides(g, e_vw, v)
    g.r_link[r, 6] = g.start[v]


@_jit
def _try_eliminate(g: _State, v: int) -> bool:
    if g.size[v] == 1:
        _eliminate_fixed(g, v)
        return True
    if g.has_mem[v] or g.adj_count[v] > 2:
        return False
    if g.adj_count[v] == 0:
        _eliminate_isolated(g, v)
    elif g.adj_count[v] == 1:
        _eliminate_leaf(g, v)
    else:
        return _eliminate_link(g, v)
    return True


# --- the fixed point -------------------------------------------------------------


@_jit
def _visit(g: _State, v: int) -> None:
    """``Graph._visit``: cheap eliminations first, dead-end elimination last."""
    if g.size[v] > 1 and _try_eliminate(g, v):
        return
    if not g.scan:  # eliminations alone: a fixed node still goes into its neighbours
        if g.size[v] == 1:
            _try_eliminate(g, v)
        return
    usable, all_usable, side, starts, current = _fold_separable(g, v)
    if not all_usable:
        _drop(g, v, usable)
        if g.counters[STATUS] != OK:
            return
    if _try_eliminate(g, v):  # when it leaves ``v``, nothing changed
        return
    if g.dominance and g.size[v] > 1:
        _drop(g, v, ~_dominated(g, v, side, starts, current and all_usable))
        if g.counters[STATUS] == OK:
            _try_eliminate(g, v)


@_jit
def _drop_slack_memory(g: _State) -> bool:
    """``Graph._drop_slack_memory``: when even the hungriest plan fits, memory is free."""
    worst, holders, mem = 0.0, 0, g.mem
    for v in range(g.alive.shape[0]):
        if g.alive[v] and g.has_mem[v]:
            lo = g.start[v]
            most = mem[lo]
            for s in range(1, g.size[v]):
                most = max(most, mem[lo + s])
            worst += most
            holders += 1
    if holders == 0 or not g.sums[FIXED_MEMORY] + worst <= g.budget * (1 + g.budget_rtol):
        return False
    for v in range(g.alive.shape[0]):
        if g.alive[v] and g.has_mem[v]:
            g.has_mem[v] = False
            _push(g, v)
    return True


@_jit
def _run(g: _State, pin_nodes: np.ndarray, pin_labels: np.ndarray) -> None:
    """``Graph.__init__``'s pins and memory normalisation, then ``Graph.reduce``."""
    n = g.alive.shape[0]
    for i in range(pin_nodes.shape[0]):
        v = pin_nodes[i]
        keep = g.dom[g.start[v] : g.start[v] + g.size[v]] == pin_labels[i]
        _restrict(g, v, keep)
        if g.counters[STATUS] != OK:
            return
    for v in range(n):
        _normalise_memory(g, v)
    for v in range(n):
        _push(g, v)
    seen, fixed_seen = False, 0.0
    while True:
        while g.counters[QUEUED]:
            v = _pop(g)
            if g.alive[v]:
                _visit(g, v)
                if g.counters[STATUS] != OK:
                    return
        if g.prune_memory and (not seen or g.sums[FIXED_MEMORY] != fixed_seen):
            # more fixed memory leaves less room for every remaining choice
            seen, fixed_seen = True, g.sums[FIXED_MEMORY]
            for v in range(n):
                if g.alive[v] and g.has_mem[v]:
                    _push(g, v)
            continue
        if not _drop_slack_memory(g):
            return


@_jit
def readout(g: _State) -> Readout:
    return Readout(g.alive, g.sums, g.counters, g.dom, g.start, g.size, g.has_mem, g.mem, g.unary)
