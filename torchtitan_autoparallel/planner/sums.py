"""Compiled loops over a ``Problem``'s flat arrays (``ProblemArrays``): scoring a
plan, and the sums and grouping of tie collapsing.

Walking the per-node lists costs a Python step per node and per edge,
milliseconds on the 15 to 19 thousand of a LLaMA3-70B problem, as much as the
approximate solver's own search. These add the same terms in the same order
as the code they replace (``sum`` from 0.0, node after node, then edge after
edge; numpy's pairwise sum for stacked layers), so every result keeps its bits.
"""

from __future__ import annotations

import numba
import numpy as np

_jit = numba.njit(cache=True, nogil=True)


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
    flip: np.ndarray, counts: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """For each ``i``, ``counts[i]`` copies of table ``which[i]`` (transposed where
    ``flip[i]``) added as ``np.add.reduceat`` adds a segment: the first, plus the
    pairwise sum of the rest. The sums one after another, and where each starts."""
    at = np.zeros(which.shape[0] + 1, dtype=np.int64)
    for i in range(which.shape[0]):
        at[i + 1] = at[i] + shapes[which[i], 0] * shapes[which[i], 1]
    out = np.empty(at[-1])
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
    order, each slot's edges in edge order (a stable sort: by the high group, then the
    low one). Returns the inner edges, the sorted edges, which table each has and
    whether it is turned round (its first end in the higher group), where each slot
    starts, each slot's pair, and whether its terms are all one table one way round."""
    count = edges.shape[0]
    lo, hi = np.empty(count, np.int64), np.empty(count, np.int64)
    turned = np.empty(count, np.bool_)
    inner = 0
    for e in range(count):
        a, b = group_of[edges[e, 0]], group_of[edges[e, 1]]
        lo[e], hi[e], turned[e] = min(a, b), max(a, b), a > b
        inner += a == b
    inside, outer = np.empty(inner, np.int64), np.empty(count - inner, np.int64)
    i = j = 0
    for e in range(count):
        if lo[e] == hi[e]:
            inside[i] = e
            i += 1
        else:
            outer[j] = e
            j += 1
    order = _pair_order(outer, lo, hi, groups)
    # one pass in sorted order; at most one slot per edge, trimmed after
    m = order.shape[0]
    which, flipped = np.empty(m, np.int64), np.empty(m, np.bool_)
    bounds, pairs, uniform = np.empty(m + 1, np.int64), np.empty((m, 2), np.int64), np.ones(m, np.bool_)
    s = -1
    for i in range(m):
        e = order[i]
        which[i], flipped[i] = table_of_edge[e], turned[e]
        if s < 0 or lo[e] != pairs[s, 0] or hi[e] != pairs[s, 1]:
            s += 1
            bounds[s], pairs[s, 0], pairs[s, 1] = i, lo[e], hi[e]
        elif which[i] != which[i - 1] or flipped[i] != flipped[i - 1]:
            uniform[s] = False
    slots = s + 1
    bounds[slots] = m
    return inside, order, which, flipped, bounds[: slots + 1], pairs[:slots], uniform[:slots]


@_jit
def _pair_order(outer: np.ndarray, lo: np.ndarray, hi: np.ndarray, groups: int) -> np.ndarray:
    """``outer`` stably sorted by (``lo``, ``hi``): one counting sort on the pair where
    its buckets are not many more than the edges, else by ``hi`` then by ``lo``."""
    if groups * groups > 4 * outer.shape[0] + 4096:
        return _counting_sort(outer, lo, groups, _counting_sort(outer, hi, groups, outer))
    key = np.empty(lo.shape[0], np.int64)
    for e in outer:
        key[e] = lo[e] * groups + hi[e]
    return _counting_sort(outer, key, groups * groups, outer)


@_jit
def _counting_sort(items: np.ndarray, key: np.ndarray, size: int, order: np.ndarray) -> np.ndarray:
    """``order`` (a permutation of ``items``) stably sorted by ``key`` (in ``[0, size)``)."""
    start = np.zeros(size + 1, dtype=np.int64)
    for e in order:
        start[key[e] + 1] += 1
    for i in range(size):
        start[i + 1] += start[i]
    out = np.empty(order.shape[0], dtype=np.int64)
    for e in order:
        out[start[key[e]]] = e
        start[key[e]] += 1
    return out
