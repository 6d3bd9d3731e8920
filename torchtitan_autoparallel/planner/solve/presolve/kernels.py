"""Compiled inner loops of the presolve (numba, cached on disk).

numpy spends these loops building temporaries far larger than the answer
(a ``(k_u, k_v, k_w)`` block for a min-plus product, a ``(k, k, width)`` one
for dominance), which on the 3-D meshes (hundreds of strategies per node)
made the shared presolve slower than the approximate solver itself. Compiled,
each loop keeps its running minima in registers and skips work as soon as the
answer is known (a pair already ruled out). The tie groups' sums
(``add_rows``) are here for the opposite reason: many tiny steps whose Python
overhead outweighs their arithmetic. They add in the order of the Python they
replace, so every result keeps its bits.

On AMD cores a loop that updates an array in place only where a value is
smaller compiles to masked stores, which are slow: running minima are kept in
registers a few entries at a time instead (``min_plus``; TRW-S's ``trws._send``
likewise), which made the min-plus products about 1.5x faster.

Inside the hot loops (dead-end elimination here, TRW-S's sweep in ``trws``)
helpers are inlined (``_inline``) and arrays are indexed in place rather than
sliced: a call to a compiled helper or an array view counts references on
every array it passes (atomic updates), which on the small tables of 2-D
meshes cost more than the arithmetic. Doing without them made the sweep
about 40% faster and the presolve 10-30% faster, with the same bits.

They compile on first use and are cached on disk, or run as Python on small
plans (``jit.py``).
"""

from __future__ import annotations

import numpy as np

from torchtitan_autoparallel import jit

_jit = jit.jit
_inline = jit.inline
SCAN_BLOCK = 32  # columns between early-exit checks of the exact dominance scan


@_jit
def min_plus(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """``min_s left[i, s] + right[s, j]``, each entry a running minimum over ``s`` in
    order (so the bits are those of any loop that adds them in that order), four
    entries at a time (module docstring). The argmin is left to the one entry a
    plan asks for (``first_argmin_plus``)."""
    ku, kv = left.shape
    kw = right.shape[1]
    cost = np.empty((ku, kw))
    for i in range(ku):
        j = 0
        while j + 4 <= kw:
            b0 = b1 = b2 = b3 = np.inf
            for s in range(kv):
                a = left[i, s]
                b0 = min(b0, a + right[s, j])
                b1 = min(b1, a + right[s, j + 1])
                b2 = min(b2, a + right[s, j + 2])
                b3 = min(b3, a + right[s, j + 3])
            cost[i, j], cost[i, j + 1], cost[i, j + 2], cost[i, j + 3] = b0, b1, b2, b3
            j += 4
        for j in range(j, kw):
            b = np.inf
            for s in range(kv):
                b = min(b, left[i, s] + right[s, j])
            cost[i, j] = b
    return cost


def first_argmin_plus(left: np.ndarray, right: np.ndarray, i: int, j: int) -> int:
    """The first ``s`` at which ``left[i, s] + right[s, j]`` is least (0 if all are
    ``inf``): the middle strategy behind ``min_plus(left, right)[i, j]``."""
    return int(np.argmin(left[i] + right[:, j]))


@_inline
def _swap_at(rows: np.ndarray, s: int, t: int, j: int) -> float:
    """``rows[s, j] - rows[t, j]`` with ``reduce.swap_difference``'s rule: a forbidden
    ``s`` entry counts as ``+inf``, a forbidden ``t`` one against a finite ``s`` one
    as ``-inf``."""
    x = rows[s, j]
    return np.inf if x == np.inf else x - rows[t, j]


@_inline
def _swap_min(rows: np.ndarray, s: int, t: int, lo: int, hi: int) -> float:
    """``min_j`` of ``_swap_at`` over ``lo <= j < hi``."""
    out = np.inf
    for j in range(lo, hi):
        out = min(out, _swap_at(rows, s, t, j))
    return out


@_inline
def _row_extremes(rows: np.ndarray, s: int, lo: int, hi: int) -> tuple[int, int]:
    """Where ``rows[s, lo:hi]`` is least (the first of equal minima) and where it is
    largest, in one pass: the two chains of comparisons overlap."""
    least_at, least = lo, rows[s, lo]
    most_at, most = lo, least
    for j in range(lo + 1, hi):
        x = rows[s, j]
        if x < least:
            least_at, least = j, x
        if x > most:
            most_at, most = j, x
    return least_at, most_at


@_inline
def _passes(total: float, strict: bool) -> bool:
    return total > 0 if strict else total >= 0


@_inline
def _exact_passes(
    base: float, tables: np.ndarray, starts: np.ndarray, s: int, t: int, strict: bool,
    witness: np.ndarray,
) -> bool:
    """The exact margin's test, scanning each table in blocks: after every block the
    exact sums so far, the block's minimum so far and the later tables' differences
    at their witness columns (``witness[e]``, each no less than its table's minimum)
    add up, in the exact sum's order, to an upper bound, so a failing pair stops
    early."""
    total = base
    num_tables = starts.shape[0] - 1
    for e in range(num_tables):
        low = np.inf
        for lo in range(starts[e], starts[e + 1], SCAN_BLOCK):
            hi = min(lo + SCAN_BLOCK, starts[e + 1])
            low = min(low, _swap_min(tables, s, t, lo, hi))
            bound = total + low
            for later in range(e + 1, num_tables):
                bound += witness[later]
            if not _passes(bound, strict):
                return False
        total += low
    return _passes(total, strict)


@_jit
def dominated(
    unary: np.ndarray, tables: np.ndarray, starts: np.ndarray, memory: np.ndarray
) -> np.ndarray:
    """``reduce.Graph._dominated``: whether some ``t`` makes ``s`` redundant, i.e.

        U[s] - U[t] + sum_e min_j (T_e[s, j] - T_e[t, j]) > 0   (>= 0 when t < s)

    and ``s`` uses no less memory (``memory`` is empty when memory is free). The
    tables sit side by side in ``tables`` (columns ``starts[e]:starts[e + 1]``).

    Cheaper sums bound that one from above and rule most pairs out first: each
    table's difference at ``s``'s cheapest column (where a ``t`` that is no cheaper
    cannot dominate), then, for the pairs that pass, the smaller of that and the
    difference at ``t``'s dearest column (where it is likeliest to lose: on the
    2-D benchmark problems three quarters of the pairs left fail there). The
    pairs left get the exact sum, which stops as soon as what is summed so far,
    with those differences for the tables still to come, falls short.
    Floating-point addition is monotonic, so a bound summed in the same order
    never falls below the exact sum: the answer is the full check's."""
    k, num_tables = unary.shape[0], starts.shape[0] - 1
    cheapest = np.empty((k, num_tables), dtype=np.int64)
    dearest = np.empty((k, num_tables), dtype=np.int64)
    for s in range(k):
        for e in range(num_tables):
            cheapest[s, e], dearest[s, e] = _row_extremes(tables, s, starts[e], starts[e + 1])
    out = np.zeros(k, dtype=np.bool_)
    bound = np.empty(k)
    at_cheapest = np.empty((num_tables, k))
    witness = np.empty(num_tables)
    check_memory = memory.shape[0] == k
    for s in range(k):
        for t in range(k):
            bound[t] = unary[s] - unary[t]
        for e in range(num_tables):
            c = cheapest[s, e]
            for t in range(k):
                d = _swap_at(tables, s, t, c)
                at_cheapest[e, t] = d
                bound[t] += d
        for t in range(k):
            if s == t or (check_memory and memory[s] < memory[t]):
                continue
            strict = t > s
            if not _passes(bound[t], strict):
                continue
            base = total = unary[s] - unary[t]
            for e in range(num_tables):
                witness[e] = min(at_cheapest[e, t], _swap_at(tables, s, t, dearest[t, e]))
                total += witness[e]
            if not _passes(total, strict):
                continue
            if _exact_passes(base, tables, starts, s, t, strict, witness):
                out[s] = True
                break
    return out


@_inline
def _largest_magnitude(table: np.ndarray) -> float:
    """``max |x|`` over ``table``, or -1.0 if an entry is not finite; four running
    maxima (one chain of comparisons was most of ``separable``'s time)."""
    rows, cols = table.shape
    m0 = m1 = m2 = m3 = 0.0
    for i in range(rows):
        j = 0
        while j + 4 <= cols:
            x0, x1, x2, x3 = table[i, j], table[i, j + 1], table[i, j + 2], table[i, j + 3]
            if not (np.isfinite(x0) and np.isfinite(x1) and np.isfinite(x2) and np.isfinite(x3)):
                return -1.0
            m0, m1 = max(m0, abs(x0)), max(m1, abs(x1))
            m2, m3 = max(m2, abs(x2)), max(m3, abs(x3))
            j += 4
        for j in range(j, cols):
            if not np.isfinite(table[i, j]):
                return -1.0
            m0 = max(m0, abs(table[i, j]))
    return max(max(m0, m1), max(m2, m3))


@_jit
def separable(table: np.ndarray, rtol: float) -> bool:
    """Whether a finite ``table`` is ``a[s] + b[t]`` up to ``rtol`` of its largest entry,
    with ``a = table[:, 0]`` and ``b = table[0, :] - table[0, 0]``; stops at the
    first entry that says no."""
    scale = _largest_magnitude(table)
    if scale < 0:
        return False
    limit = rtol * scale
    rows, cols = table.shape
    for i in range(rows):
        a = table[i, 0]
        for j in range(cols):
            if abs(table[i, j] - a - (table[0, j] - table[0, 0])) > limit:
                return False
    return True


@_jit
def scan(
    unary: np.ndarray, tables: np.ndarray, starts: np.ndarray, rtol: float,
    memory: np.ndarray, fixed: float, limit: float,
) -> tuple[np.ndarray, np.ndarray, bool, bool]:
    """A node's first look in ``reduce.Graph._visit``, in one pass over its tables
    (side by side, as ``dominated`` reads them): which are separable (``separable``'s
    test on each), and which strategies are usable: a finite unary, a finite entry
    in every table's row, and finite memory that, added to ``fixed``, stays within
    ``limit`` (``memory`` empty: none to check). A separable table is finite
    everywhere, so folding it first would change neither answer. Also whether any
    table is separable and whether every strategy is usable (the common answers)."""
    k, num_tables = unary.shape[0], starts.shape[0] - 1
    split = np.empty(num_tables, dtype=np.bool_)
    for e in range(num_tables):
        split[e] = separable(tables[:, starts[e] : starts[e + 1]], rtol)
    keep = np.empty(k, dtype=np.bool_)
    check_memory = memory.shape[0] == k
    for s in range(k):
        ok = np.isfinite(unary[s])
        for e in range(num_tables):
            if not ok:
                break
            ok = False
            for j in range(starts[e], starts[e + 1]):
                if np.isfinite(tables[s, j]):
                    ok = True
                    break
        if ok and check_memory:
            ok = np.isfinite(memory[s]) and fixed + memory[s] <= limit
        keep[s] = ok
    return split, keep, split.any(), keep.all()


@_jit
def add_rows(out: np.ndarray, flat: np.ndarray, k: np.ndarray, row: np.ndarray) -> None:
    """Add vector ``v`` (``k[v]`` entries of ``flat``, in order) into ``out[row[v]]``,
    node after node: per row, the sum a loop over its members would make."""
    at = 0
    for v in range(len(k)):
        r = row[v]
        for s in range(k[v]):
            out[r, s] += flat[at + s]
        at += k[v]
