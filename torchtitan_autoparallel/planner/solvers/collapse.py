"""Tie collapsing: every tie group becomes one node of an equivalent tie-free problem.

Tied nodes always pick the same strategy index, so a group behaves exactly like
one node whose unary (and memory) is the sum of its members'. An edge between
two groups keeps its table; parallel edges between the same two groups are
summed into one table; an edge inside a group only ever sees equal indices, so
its diagonal joins the group's unary. The collapsed problem's energy of ``x``
equals the original's energy of ``x[group_of]`` for every ``x``: the reduction
is exact, and it is what makes a stack of repeated layers cost one layer.

Node vectors are summed in one compiled pass and parallel tables accumulated in
place, so collapsing stays cheap on graphs of tens of thousands of edges.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from torchtitan_autoparallel.planner.problem import InfeasibleProblem, Problem
from torchtitan_autoparallel.planner.solvers import kernels
from torchtitan_autoparallel.planner.solvers.ilp_model import tie_components

PAIRWISE_BLOCK = 128  # numpy's PW_BLOCKSIZE: its pairwise sum recurses above this


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


def _group_sums(
    parts: list[np.ndarray], k: np.ndarray, group_of: np.ndarray, kg: np.ndarray
) -> list[np.ndarray]:
    """Per group, the sum of its members' vectors (members added in node order)."""
    out = np.zeros((len(kg), int(k.max(initial=1))))
    if len(k):
        flat = np.concatenate(parts, dtype=np.float64)
        kernels.add_rows(out, flat, k, group_of)
    return [out[g, : kg[g]].copy() for g in range(len(kg))]


def _group_memory(
    problem: Problem, k: np.ndarray, group_of: np.ndarray, kg: np.ndarray
) -> list[np.ndarray | None]:
    holders = np.array([v for v, m in enumerate(problem.memory) if m is not None], dtype=np.int64)
    if not len(holders):
        return [None] * len(kg)
    # only holders: the zeros of the others would add nothing to any sum's bits
    sums = _group_sums([problem.memory[v] for v in holders], k[holders], group_of[holders], kg)
    group_has = np.zeros(len(kg), dtype=bool)
    group_has[group_of[holders]] = True
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
    tables = _sum_parallel(problem.pairwise, outer, flip, slot.reshape(-1), len(uniq))
    edges = np.stack([uniq // len(kg), uniq % len(kg)], axis=1).astype(np.int64)
    return edges, tables


def _sum_parallel(
    pairwise: list[np.ndarray], outer: np.ndarray, flip: np.ndarray, slot: np.ndarray, count: int
) -> list[np.ndarray]:
    """One table per slot: the sum of its edges' (oriented) tables.

    Summing the tables of each slot directly reads each one once; stacking them
    first (then ``reduceat``) copied every entry, over a gigabyte on the largest
    problems. The additions follow ``np.add.reduceat``'s order, so the tables are
    bitwise those of the stacked version (and the plans the same).

    Slots that add the same tables in the same order get the same bits, so each
    such sequence is summed once and its slots share the result, read-only as
    the problem's own shared tables are: the 80-layer stacks of LLaMA3-70B make
    about 100 distinct sums out of 230 slots."""
    # repeated layers share one table object (``problem.share_tables``): which
    # object, and which way round, says which terms are equal without reading them
    # (the objects outlive this call, so their ids stay distinct; addresses fit 62 bits)
    which = np.fromiter(map(id, pairwise), dtype=np.int64, count=len(pairwise))
    order = np.argsort(slot, kind="stable")  # edge order within a slot, as reduceat adds
    edges = outer[order]
    terms = _Terms(pairwise, edges, flip[edges], which[edges] * 2 + flip[edges])
    bounds = np.searchsorted(slot[order], np.arange(count + 1))
    # slots whose terms are all one table the same way round (nearly all of them)
    repeats = np.ones(len(terms), dtype=bool)
    repeats[1:] = terms.ident[1:] == terms.ident[:-1]
    repeats[bounds[:-1]] = True
    uniform = np.logical_and.reduceat(repeats, bounds[:-1]) if count else repeats[:0]
    sums: dict[bytes, np.ndarray] = {}
    copies: dict[int, dict[int, np.ndarray]] = {}  # ident -> count -> sum of that many
    out = []
    for a, b, same in zip(bounds[:-1].tolist(), bounds[1:].tolist(), uniform.tolist()):
        key = terms.ident[a:b].tobytes()
        table = sums.get(key)
        if table is None:
            if same:  # a lone table is only copied, as ``_reduceat_sum`` would
                memo = copies.setdefault(int(terms.ident[a]), {})
                table = _repeated_sum(terms.table(a), b - a, memo)
            else:
                table = _reduceat_sum(terms[a:b])
            table.flags.writeable = False
            sums[key] = table
        out.append(table)
    return out


@dataclass
class _Terms:
    """Edge tables to add up, in order, each oriented; equal ``ident``: equal tables."""

    pairwise: list[np.ndarray]
    edge: np.ndarray
    flip: np.ndarray
    ident: np.ndarray

    def __len__(self) -> int:
        return len(self.edge)

    def __getitem__(self, at: slice) -> _Terms:
        return _Terms(self.pairwise, self.edge[at], self.flip[at], self.ident[at])

    def table(self, i: int) -> np.ndarray:
        t = np.asarray(self.pairwise[self.edge[i]], dtype=np.float64)
        return t.T if self.flip[i] else t

    def tables(self) -> list[np.ndarray]:
        return [self.table(i) for i in range(len(self))]


def _reduceat_sum(terms: _Terms) -> np.ndarray:
    """``np.add.reduceat`` of the stacked tables over one segment, as a new C array:
    the first table plus numpy's pairwise sum of the rest."""
    first = np.array(terms.table(0), order="C")  # a copy: the problem's tables stay untouched
    if len(terms) > 1:
        first += _pairwise(terms[1:])
    return first


def _pairwise(terms: _Terms) -> np.ndarray:
    """Elementwise numpy's pairwise summation (``pairwise_sum`` in its add loop):
    below 8 terms a running sum from zero, up to 128 eight running sums combined
    as a tree plus the rest, above that the two halves (split at a multiple of 8).

    Running sums over the same sequence of tables are the same bits, so where
    the layers share their tables one lane is summed and the others reuse it:
    a stack of 80 layers costs about 23 additions of its table instead of 79."""
    n = len(terms)
    if n < 8:
        return _add_all(terms.table(0) + 0.0, terms[1:])  # from zero, as numpy starts
    if n <= PAIRWISE_BLOCK:
        done = n - n % 8
        summed: dict[bytes, np.ndarray] = {}
        lanes = []
        for j in range(8):
            lane = terms[j:done:8]
            key = lane.ident.tobytes()
            if key not in summed:
                summed[key] = _add_all(np.array(lane.table(0), order="C"), lane[1:])
            lanes.append(summed[key])  # never written again: sharing it is safe
        total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + (
            (lanes[4] + lanes[5]) + (lanes[6] + lanes[7])
        )
        return _add_all(total, terms[done:])
    half = n // 2
    half -= half % 8
    return _pairwise(terms[:half]) + _pairwise(terms[half:])


def _repeated_sum(x: np.ndarray, n: int, memo: dict[int, np.ndarray]) -> np.ndarray:
    """``_reduceat_sum`` of ``n`` copies of ``x``, as a new C array: the same
    additions, found from the count alone (``memo``: the pairwise sums of so many
    copies made so far, shared by the slots that repeat the same table)."""
    first = np.array(x, order="C")
    if n > 1:
        first += _copies(x, n - 1, memo)
    return first


def _copies(x: np.ndarray, n: int, memo: dict[int, np.ndarray]) -> np.ndarray:
    """``_pairwise`` of ``n`` copies of ``x`` (never written after it is made)."""
    if n in memo:
        return memo[n]
    if n < 8:
        total = x + 0.0
        for _ in range(n - 1):
            total += x
    elif n <= PAIRWISE_BLOCK:  # eight equal lanes, combined as a tree
        done = n - n % 8
        lane = np.array(x, order="C")
        for _ in range(done // 8 - 1):
            lane += x
        pair = lane + lane
        quad = pair + pair
        total = quad + quad
        for _ in range(n - done):
            total += x
    else:
        half = n // 2
        half -= half % 8
        total = _copies(x, half, memo) + _copies(x, n - half, memo)
    memo[n] = total
    return total


def _add_all(total: np.ndarray, terms: _Terms) -> np.ndarray:
    """``total`` (a fresh array) plus each of ``terms`` in turn, in place."""
    for t in terms.tables():
        total += t
    return total
