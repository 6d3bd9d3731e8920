"""Tie collapsing: every tie group becomes one node of an equivalent tie-free problem.

Tied nodes always pick the same strategy index, so a group behaves exactly like
one node whose unary (and memory) is the sum of its members'. An edge between
two groups keeps its table; parallel edges between the same two groups are
summed into one table; an edge inside a group only ever sees equal indices, so
its diagonal joins the group's unary. The collapsed problem's energy of ``x``
equals the original's energy of ``x[group_of]`` for every ``x``: the reduction
is exact, and it is what makes a stack of repeated layers cost one layer.

Node vectors are summed in one compiled pass over the problem's flat arrays
(``Problem.arrays``) and parallel tables accumulated in place, so collapsing
takes no Python step per node and stays cheap on graphs of tens of thousands
of edges.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from torchtitan_autoparallel.planner.problem import sums
from torchtitan_autoparallel.planner.problem.problem import (
    FlatProblem,
    InfeasibleProblem,
    Problem,
    ProblemArrays,
)
from torchtitan_autoparallel.planner.solve.presolve import kernels


@dataclass
class Collapsed:
    """The tie-free problem of one node per tie group, as flat arrays (``flat``);
    ``problem()`` makes it a ``Problem`` for the solvers that want names and lists."""

    source: Problem  # the problem collapsed
    flat: FlatProblem
    reps: np.ndarray  # each group's first node in ``source``
    group_of: np.ndarray  # each node of ``source``'s group

    def problem(self) -> Problem:
        flat, reps = self.flat, self.reps.tolist()
        return Problem.from_arrays(
            [self.source.node_names[r] for r in reps],
            [self.source.strategy_labels[r] for r in reps],
            flat.arrays, flat.edges, flat.memory_budget, flat.pins,
        )


def collapse_ties(problem: Problem) -> tuple[Problem, np.ndarray]:
    """The tie-free problem of one node per tie group, and each node's group."""
    collapsed = collapse(problem)
    return collapsed.problem(), collapsed.group_of


def collapse(problem: Problem) -> Collapsed:
    """``collapse_ties`` as flat arrays (module docstring)."""
    flat = problem.arrays
    reps, group_of = _groups(problem)
    k = flat.k
    kg = k[reps]
    unary = _group_rows(flat.unary, k, group_of, kg)
    # memory: only holders; the zeros of the others would add nothing to any sum's bits
    holders = flat.memory_nodes
    memory = _group_rows(flat.memory, k[holders], group_of[holders], kg)
    edges, tables, shapes, table_of_edge = _group_edges(problem, group_of, kg, unary)
    kept = np.arange(unary.shape[1]) < kg[:, None]  # each group's strategies in its row
    has_memory = _present(group_of[holders], len(kg))
    arrays = ProblemArrays.packed(
        kg, unary[kept], has_memory, memory[has_memory][kept[has_memory]],
        tables, shapes, table_of_edge,
    )
    flat_problem = FlatProblem(arrays, edges, problem.memory_budget, _group_pins(problem, group_of))
    return Collapsed(problem, flat_problem, reps, group_of)


def _groups(problem: Problem) -> tuple[np.ndarray, np.ndarray]:
    """Each tie group's first node (in node order), and each node's group."""
    flat = problem.arrays
    disjoint, reps, group_of = sums.tie_groups(problem.num_nodes, flat.tie_nodes, flat.tie_first)
    if disjoint:
        return reps, group_of
    comp = group_components(problem.num_nodes, flat.tie_nodes, flat.tie_sizes, problem.ties)
    reps = _present(comp, problem.num_nodes)
    return reps, np.searchsorted(reps, comp)


def _present(values: np.ndarray, size: int) -> np.ndarray:
    """``np.unique(values)`` for values in ``[0, size)``, without its sort."""
    present = np.zeros(size, dtype=bool)
    present[values] = True
    return np.flatnonzero(present)


def _group_rows(
    flat: np.ndarray, k: np.ndarray, group_of: np.ndarray, kg: np.ndarray
) -> np.ndarray:
    """Per group (a row, padded with zeros), the sum of its members' vectors (``k[v]``
    entries of ``flat`` each, node after node; members added in node order)."""
    out = np.zeros((len(kg), int(kg.max(initial=1))))
    if len(k):
        kernels.add_rows(out, flat, k, group_of)
    return out


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


def _no_edges() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``_group_edges``' answer without edges."""
    return np.zeros((0, 2), np.int64), np.zeros(0), np.zeros((0, 2), np.int64), np.zeros(0, np.int64)


def _group_edges(
    problem: Problem, group_of: np.ndarray, kg: np.ndarray, unary: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Edges between distinct groups, parallel ones summed; inner ones onto ``unary``.
    Returns the edges, their distinct tables laid out one after another, those
    tables' shapes, and which one each edge has."""
    if not len(problem.edges):
        return _no_edges()
    flat = problem.arrays
    inner, ident, bounds, pairs, uniform = sums.edge_slots(
        problem.edges, group_of, len(kg), flat.table_of_edge
    )
    for e in inner.tolist():  # both ends take one strategy: the diagonal is the group's
        g = int(group_of[problem.edges[e, 0]])
        unary[g, : kg[g]] += np.diag(problem.pairwise[e])
    if not len(ident):
        return _no_edges()
    tables, shapes, table_of_edge = _sum_parallel(flat, _Terms(ident), bounds, uniform)
    return pairs, tables, shapes, table_of_edge


def _sum_parallel(
    flat: ProblemArrays, terms: _Terms, bounds: np.ndarray, uniform: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One table per slot (``bounds``: where each starts in ``terms``): the sum of its
    edges' (oriented) tables.

    Summing the tables of each slot directly reads each one once; stacking them
    first (then ``reduceat``) copied every entry, over a gigabyte on the largest
    problems. The additions follow ``np.add.reduceat``'s order, so the tables are
    bitwise those of the stacked version (and the plans the same).

    Slots that add the same tables in the same order get the same bits, so each
    such sequence is summed once and its slots share the result: the 80-layer
    stacks of LLaMA3-70B make about 100 distinct sums out of 230 slots. Repeated
    layers share one table (``problem.share_tables``), so which one, and which way
    round (``terms.ident``), says which terms are equal without reading them; most
    slots repeat one (``uniform``), and the few others' sums go after theirs.
    Returns the distinct sums laid out one after another, their shapes, and each
    slot's."""
    mixed: dict[bytes, int] = {}
    extra, mixed_of = [], []
    for slot in np.flatnonzero(~uniform).tolist():
        a, b = int(bounds[slot]), int(bounds[slot + 1])
        key = terms.ident[a:b].tobytes()
        if key not in mixed:
            mixed[key] = len(extra)
            which, flip = terms.split(slice(a, b))
            extra.append(sums.mixed_sum(flat.flat_tables, flat.table_at, flat.table_shapes, which, flip))
        mixed_of.append((slot, mixed[key]))
    mixed_entries = sum(t.size for t in extra)
    packed, shapes, of_slot = _uniform_sums(flat, terms, bounds, uniform, mixed_entries)
    at = len(packed) - mixed_entries
    for t in extra:
        packed[at : at + t.size] = t.ravel()
        at += t.size
    for slot, i in mixed_of:
        of_slot[slot] = len(shapes) + i
    if extra:
        shapes = np.concatenate([shapes, np.array([t.shape for t in extra], dtype=np.int64)])
    return packed, shapes, of_slot


def _uniform_sums(
    flat: ProblemArrays, terms: _Terms, bounds: np.ndarray, uniform: np.ndarray, room: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The sums of the slots that repeat one table, in one compiled pass: each (table,
    orientation, count) once. Returns them laid out one after another (then ``room``
    entries to fill), their shapes, and each slot's (-1 for the other slots)."""
    first, counts = bounds[:-1], np.diff(bounds)
    keys = np.where(uniform, terms.ident[first] * (int(counts.max()) + 1) + counts, -1)
    wanted, one, slot_of = np.unique(keys, return_index=True, return_inverse=True)
    if wanted[0] < 0:  # the mixed slots' key: not a sum of its own
        one, slot_of = one[1:], slot_of - 1
    which, flip = terms.split(first[one])  # one slot per key
    packed, _ = sums.repeated_sums(
        flat.flat_tables, flat.table_at, flat.table_shapes, which, flip, counts[one], room
    )
    shapes = flat.table_shapes[which]
    shapes[flip] = shapes[flip][:, ::-1]
    return packed, shapes, slot_of.reshape(-1).astype(np.int64)


@dataclass
class _Terms:
    """Tables to add up, in order, each as ``ident = 2 * table + turned``: which of the
    problem's distinct tables it is and whether it is turned round (equal: equal
    terms)."""

    ident: np.ndarray

    def split(self, at: slice | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The terms ``at``: their tables, and whether each is turned round."""
        ident = self.ident[at]
        return ident >> 1, (ident & 1).astype(bool)


def tie_components(num_nodes: int, ties: list[list[int]]) -> np.ndarray:
    """Component label per node; overlapping tie groups merge (union-find)."""
    members = np.fromiter(itertools.chain.from_iterable(ties), dtype=np.int64)
    sizes = np.fromiter(map(len, ties), dtype=np.int64, count=len(ties))
    return group_components(num_nodes, members, sizes, ties)


def group_components(
    num_nodes: int, members: np.ndarray, sizes: np.ndarray, ties: list[list[int]]
) -> np.ndarray:
    """``tie_components`` with the groups also given flat (``members``, group after
    group, and each group's size), as ``Problem.arrays`` holds them."""
    if not len(members) or np.bincount(members, minlength=num_nodes).max() == 1:
        # disjoint groups (what the planner makes): each member's root is its
        # group's first node, as the union-find below would find, in one pass
        used = sizes > 0
        comp = np.arange(num_nodes, dtype=np.int64)
        comp[members] = np.repeat(members[(np.cumsum(sizes) - sizes)[used]], sizes[used])
        return comp
    parent = np.arange(num_nodes)

    def root(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return int(a)

    for group in ties:
        for a in group[1:]:
            parent[root(a)] = root(group[0])
    return np.array([root(v) for v in range(num_nodes)], dtype=np.int64)
