"""Compiled loops over a ``Problem``'s flat arrays (``ProblemArrays``): scoring a
plan, and the sums and grouping of tie collapsing.

Walking the per-node lists costs a Python step per node and per edge,
milliseconds on the 15 to 19 thousand of a LLaMA3-70B problem, as much as the
approximate solver's own search. These add the same terms in the same order
as the code they replace (``sum`` from 0.0, node after node, then edge after
edge; numpy's pairwise sum for stacked layers), so every result keeps its bits.
"""

from __future__ import annotations

import numpy as np

from torchtitan_autoparallel import jit

_jit = jit.jit
_inline = jit.inline


@_jit
def energy(
    unary: np.ndarray, starts: np.ndarray, x: np.ndarray, ends: np.ndarray,
    flat_tables: np.ndarray, table_at: np.ndarray, table_cols: np.ndarray,
    table_of_edge: np.ndarray,
) -> float:
    """``sum_v unary[v][x_v]``, then plus ``sum_e table_e[x_u, x_v]`` (``ends``: (E, 2))."""
    own = 0.0
    for v in range(x.shape[0]):
        own += unary[starts[v] + x[v]]
    pairs = 0.0
    for e in range(ends.shape[0]):
        t = table_of_edge[e]
        pairs += flat_tables[table_at[t] + x[ends[e, 0]] * table_cols[t] + x[ends[e, 1]]]
    return own + pairs


@_jit
def memory_used(memory: np.ndarray, starts: np.ndarray, nodes: np.ndarray, x: np.ndarray) -> float:
    """``sum`` over the memory holders ``nodes`` of their bytes at ``x`` (``starts[i]``:
    where holder ``i``'s vector starts in ``memory``)."""
    total = 0.0
    for i in range(nodes.shape[0]):
        total += memory[starts[i] + x[nodes[i]]]
    return total


@_jit
def ties_kept(x: np.ndarray, members: np.ndarray, first: np.ndarray) -> bool:
    """Whether every tied node picks what its group's first member picks."""
    for i in range(members.shape[0]):
        if x[members[i]] != x[first[i]]:
            return False
    return True


@_jit
def tie_groups(num_nodes: int, members: np.ndarray, first: np.ndarray):
    """Tie collapsing's groups where no node is in two tie groups (what the planner
    makes; ``first``: each member's group's first member, ``ProblemArrays.tie_first``):
    whether that holds, each group's first node in node order, and each node's group
    (a node in no tie group is a group of its own). ``ilp_model.group_components``
    numbers them alike; this is its disjoint case in one pass per array, where its
    numpy steps made eight node-length arrays on LLaMA3-70B's 14,531 nodes."""
    root = np.arange(num_nodes)
    present = np.zeros(num_nodes, np.bool_)
    for i in range(members.shape[0]):
        if present[members[i]]:  # in two groups: the caller unites them instead
            return False, root[:0], root[:0]
        present[members[i]] = True
        root[members[i]] = first[i]
    present[:] = False
    for v in range(num_nodes):
        present[root[v]] = True
    rank = np.empty(num_nodes, np.int64)  # groups that start before each node
    count = 0
    for v in range(num_nodes):
        rank[v] = count
        if present[v]:
            count += 1
    reps = np.empty(count, np.int64)
    for v in range(num_nodes):
        if present[v]:
            reps[rank[v]] = v
        # a group's first node is its own root, so its rank, read before or after its
        # own turn here, is the group's number
        rank[v] = rank[root[v]]
    return True, reps, rank


@_jit
def _leaf(a: np.ndarray, lo: int, n: int, x: float, copies: bool) -> float:
    """numpy's pairwise sum of at most 128 terms: ``a[lo:lo + n]``, or ``n`` copies of
    ``x``. Below 8 a running sum from zero; else eight running sums combined as a
    tree, then the rest."""
    if n < 8:
        total = 0.0
        for i in range(n):
            total += x if copies else a[lo + i]
        return total
    done = n - n % 8
    if copies:  # eight equal lanes: one is summed, the tree adds it to itself
        lane = x
        for i in range(8, done, 8):
            lane += x
        pair = lane + lane
        quad = pair + pair
        total = quad + quad
    else:
        lanes = np.empty(8)
        for j in range(8):
            lanes[j] = a[lo + j]
        for i in range(8, done, 8):
            for j in range(8):
                lanes[j] += a[lo + i + j]
        total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + (
            (lanes[4] + lanes[5]) + (lanes[6] + lanes[7])
        )
    for i in range(done, n):
        total += x if copies else a[lo + i]
    return total


@_jit
def pairwise_sum(a: np.ndarray, lo: int, n: int, x: float = 0.0, copies: bool = False) -> float:
    """numpy's ``pairwise_sum`` (what ``ndarray.sum`` does on a contiguous vector) of
    ``a[lo:lo + n]``, or of ``n`` copies of ``x``: above 128 terms the two halves,
    split at a multiple of 8, summed apart and added. Walked with a stack of its
    own, as numba's cache cannot hold a recursive function."""
    if n <= 128:
        return _leaf(a, lo, n, x, copies)
    at, size = np.empty(64, dtype=np.int64), np.empty(64, dtype=np.int64)
    left_done, left = np.zeros(64, dtype=np.bool_), np.empty(64)
    top, at[0], size[0] = 0, lo, n
    total = 0.0
    while top >= 0:
        if size[top] > 128:  # a split not yet started: its left half first
            half = size[top] // 2 - (size[top] // 2) % 8
            left_done[top + 1], at[top + 1], size[top + 1] = False, at[top], half
            top += 1
            continue
        total = _leaf(a, at[top], size[top], x, copies)
        top -= 1
        while top >= 0:  # hand the finished half to the split above it
            half = size[top] // 2 - (size[top] // 2) % 8
            if not left_done[top]:  # its left half: now the right one
                left_done[top], left[top] = True, total
                at[top + 1], size[top + 1], left_done[top + 1] = at[top] + half, size[top] - half, False
                top += 1
                break
            total = left[top] + total
            top -= 1
    return total


@_jit
def repeated_sums(
    flat_tables: np.ndarray, table_at: np.ndarray, shapes: np.ndarray, which: np.ndarray,
    flip: np.ndarray, counts: np.ndarray, room: int,
) -> tuple[np.ndarray, np.ndarray]:
    """For each ``i``, ``counts[i]`` copies of table ``which[i]`` (transposed where
    ``flip[i]``) added as ``np.add.reduceat`` adds a segment: the first, plus the
    pairwise sum of the rest. The sums one after another, then ``room`` entries left
    for the caller's other tables (written there, not concatenated: a copy of every
    sum), and where each sum starts."""
    at = np.zeros(which.shape[0] + 1, dtype=np.int64)
    for i in range(which.shape[0]):
        at[i + 1] = at[i] + shapes[which[i], 0] * shapes[which[i], 1]
    out = np.empty(at[-1] + room)
    for i in range(which.shape[0]):
        rows, cols, base = shapes[which[i], 0], shapes[which[i], 1], table_at[which[i]]
        total = _copies_of_each(flat_tables[base : base + rows * cols], counts[i] - 1)
        for r in range(rows):
            for c in range(cols):
                # transposed: entry (r, c) of the table is entry (c, r) of the sum
                to = at[i] + (c * rows + r if flip[i] else r * cols + c)
                x = flat_tables[base + r * cols + c]
                out[to] = x if counts[i] == 1 else x + total[r * cols + c]
    return out, at


@_jit
def _copies_of_each(x: np.ndarray, n: int) -> np.ndarray:
    """``pairwise_sum`` of ``n`` copies of each entry of ``x``: the same additions, an
    operation at a time over all the entries, so that the entries' chains of
    dependent additions overlap instead of running one after another."""
    total = np.zeros(x.shape[0])
    if n > 128:  # split as numpy splits: entry by entry (no stack of layers is this deep)
        for i in range(x.shape[0]):
            total[i] = pairwise_sum(x, 0, n, x[i], True)
        return total
    if n < 8:
        for _ in range(n):
            for i in range(x.shape[0]):
                total[i] += x[i]
        return total
    lane = x.copy()
    for _ in range(8, n - n % 8, 8):
        for i in range(x.shape[0]):
            lane[i] += x[i]
    for i in range(x.shape[0]):
        pair = lane[i] + lane[i]
        quad = pair + pair
        total[i] = quad + quad
    for _ in range(n % 8):
        for i in range(x.shape[0]):
            total[i] += x[i]
    return total


@_jit
def mixed_sum(
    flat_tables: np.ndarray, table_at: np.ndarray, shapes: np.ndarray, which: np.ndarray,
    flip: np.ndarray,
) -> np.ndarray:
    """The tables ``which`` (each transposed where ``flip``) added as
    ``np.add.reduceat`` adds a segment of them stacked: the first, plus the pairwise
    sum of the rest, entry by entry."""
    first = which[0]
    rows, cols = shapes[first, 0], shapes[first, 1]
    if flip[0]:
        rows, cols = cols, rows
    out = np.empty((rows, cols))
    rest = np.empty(which.shape[0] - 1)
    for r in range(rows):
        for c in range(cols):
            for m in range(which.shape[0]):
                t = which[m]
                # entry (r, c) of the oriented table: (c, r) of a stored one turned round
                at = table_at[t] + (c * shapes[t, 1] + r if flip[m] else r * shapes[t, 1] + c)
                if m == 0:
                    out[r, c] = flat_tables[at]
                else:
                    rest[m - 1] = flat_tables[at]
            if rest.shape[0]:
                out[r, c] += pairwise_sum(rest, 0, rest.shape[0])
    return out


@_jit
def edge_slots(edges: np.ndarray, group_of: np.ndarray, groups: int, table_of_edge: np.ndarray):
    """Tie collapsing's edge grouping: the edges inside a group (in edge order), and
    the others by the pair of groups they join (low, high), one slot per pair in pair
    order, each slot's edges in edge order. Returns the inner edges; for the others,
    in that order, each one's table and whether it is turned round (its first end in
    the higher group), as one identity ``2 * table + turned``; where each slot starts,
    each slot's pair, and whether its terms are all one table one way round.

    The order is a radix sort, stable by the high group and then by the low one,
    reading the groups again from ``group_of`` at each pass rather than keeping them
    per edge, in 32-bit positions: every page a process touches first is a fault
    (about 3 us on a VM), and on LLaMA3-70B's 18,868 edges this was the high-water
    mark of a fresh process's first solve."""
    count = edges.shape[0]
    by_high, by_low = np.zeros(groups + 1, np.int64), np.zeros(groups + 1, np.int64)
    inner = 0
    for e in range(count):
        a, b = group_of[edges[e, 0]], group_of[edges[e, 1]]
        if a == b:
            inner += 1
        else:
            by_high[max(a, b) + 1] += 1
            by_low[min(a, b) + 1] += 1
    for g in range(groups):
        by_high[g + 1] += by_high[g]
        by_low[g + 1] += by_low[g]
    m = count - inner
    inside, high_first = np.empty(inner, np.int64), np.empty(m, np.int32)
    i = 0
    for e in range(count):
        a, b = group_of[edges[e, 0]], group_of[edges[e, 1]]
        if a == b:
            inside[i] = e
            i += 1
        else:
            high_first[by_high[max(a, b)]] = e
            by_high[max(a, b)] += 1
    order = np.empty(m, np.int32)
    for e in high_first:
        low = min(group_of[edges[e, 0]], group_of[edges[e, 1]])
        order[by_low[low]] = e
        by_low[low] += 1
    return (inside,) + _slots(order, edges, group_of, table_of_edge)


@_jit
def _slots(order: np.ndarray, edges: np.ndarray, group_of: np.ndarray, table_of_edge: np.ndarray):
    """``edge_slots``' pass over the sorted edges: the slots counted first, so that
    each slot's arrays are made to size."""
    m, slots, last = order.shape[0], 0, (-1, -1)
    for i in range(m):
        pair = _pair(edges, group_of, order[i])
        if pair != last:
            slots, last = slots + 1, pair
    ident = np.empty(m, np.int64)
    bounds, pairs, uniform = np.empty(slots + 1, np.int64), np.empty((slots, 2), np.int64), np.ones(slots, np.bool_)
    s = -1
    for i in range(m):
        e = order[i]
        low, high = _pair(edges, group_of, e)
        ident[i] = 2 * table_of_edge[e] + (group_of[edges[e, 0]] > group_of[edges[e, 1]])
        if s < 0 or low != pairs[s, 0] or high != pairs[s, 1]:
            s += 1
            bounds[s], pairs[s, 0], pairs[s, 1] = i, low, high
        elif ident[i] != ident[i - 1]:
            uniform[s] = False
    bounds[slots] = m
    return ident, bounds, pairs, uniform


@_inline
def _pair(edges: np.ndarray, group_of: np.ndarray, e: int) -> tuple[int, int]:
    """The groups edge ``e`` joins, low then high."""
    a, b = group_of[edges[e, 0]], group_of[edges[e, 1]]
    return min(a, b), max(a, b)
