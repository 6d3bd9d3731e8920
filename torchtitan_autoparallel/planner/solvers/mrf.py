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

from torchtitan_autoparallel.planner.problem import Problem
from torchtitan_autoparallel.planner.solvers import kernels

BUDGET_RTOL = 1e-9  # float slack on the budget: sums of the same bytes in another order
BIG_FACTOR = 1e6  # ``big`` is this many times the largest feasible energy


class NoLabels(ValueError):
    """Some node has no usable label left: the problem (or its budget) is infeasible."""


@dataclass
class Mrf:
    domains: list[np.ndarray]  # node -> the original strategy index of each label kept
    unary: list[np.ndarray]  # node -> (k,) finite costs
    edges: np.ndarray  # (E, 2), edges[:, 0] < edges[:, 1]
    tables: list[np.ndarray]  # (k_a, k_b), forbidden pairs at ``big``
    memory: list[np.ndarray] | None  # node -> (k,) bytes (zeros if none); None: budget never binds
    budget: float  # bytes (inf without a budget)
    big: float
    flat: np.ndarray  # every table raveled, for vectorised lookups
    offset: np.ndarray  # (E,) where each table starts in ``flat``

    @property
    def num_nodes(self) -> int:
        return len(self.unary)

    @cached_property
    def k(self) -> np.ndarray:  # the label counts never change once built
        return np.array([len(u) for u in self.unary], dtype=np.int64)

    @cached_property
    def columns(self) -> np.ndarray:
        return np.array([t.shape[1] for t in self.tables], dtype=np.int64)

    @cached_property
    def starts(self) -> np.ndarray:  # where each node's labels start in a flat unary
        return np.concatenate([[0], np.cumsum(self.k)]).astype(np.int64)

    @cached_property
    def flat_unary(self) -> np.ndarray:
        return np.concatenate(self.unary) if self.unary else np.zeros(0)

    @cached_property
    def flat_memory(self) -> np.ndarray:  # memory laid out as ``flat_unary`` (needs memory)
        return np.concatenate(self.memory) if self.memory else np.zeros(0)

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

    def energy(self, x: np.ndarray, unary: np.ndarray | None = None) -> float:
        """Energy of a compact labeling; ``>= big`` means it uses a forbidden pair.
        ``unary``: a flat unary (node ``v``'s from ``starts[v]``) to use instead of its own."""
        flat = self.flat_unary if unary is None else unary
        total = kernels.picked_sum(flat, self.starts, np.ascontiguousarray(x, dtype=np.int64))
        if len(self.edges):
            a, b = self.edges[:, 0], self.edges[:, 1]
            total += float(self.flat[self.offset + x[a] * self.columns + x[b]].sum())
        return total

    def memory_used(self, x: np.ndarray) -> float:
        if self.memory is None:
            return 0.0
        x = np.ascontiguousarray(x, dtype=np.int64)
        return kernels.picked_sum(self.flat_memory, self.starts, x)  # node by node, as sum() adds

    def fits(self, x: np.ndarray) -> bool:
        return self.memory is None or self.memory_used(x) <= self.budget

    def feasible(self, x: np.ndarray) -> bool:
        return self.energy(x) < self.big and self.fits(x)

    def expand(self, x: np.ndarray) -> np.ndarray:
        """Compact labels -> the problem's strategy indices."""
        return np.array([d[i] for d, i in zip(self.domains, x.tolist())], dtype=np.int64)


def build_mrf(problem: Problem) -> Mrf:
    """The compact form of a tie-free problem (pins allowed); raises ``NoLabels``."""
    unary = [np.asarray(u, dtype=np.float64).copy() for u in problem.unary]
    edges, tables = _oriented_edges(problem, unary)
    # None where a table is all finite (most are): nothing to prune or replace there
    finite = [None if bool(f.all()) else f for f in (np.isfinite(t) for t in tables)]
    allowed = [np.isfinite(u) for u in unary]
    for v, s in problem.pins.items():
        allowed[v] &= np.arange(len(allowed[v])) == s
    memory = _memory_rows(problem, allowed)
    budget = np.inf if problem.memory_budget is None else float(problem.memory_budget)
    cap = budget * (1 + BUDGET_RTOL) if budget > 0 else budget
    _prune(allowed, edges, finite, memory, cap)
    domains = [np.flatnonzero(a) for a in allowed]
    unary = [u[d] for u, d in zip(unary, domains)]
    tables = _restrict(tables, edges, allowed, domains)
    kept_memory = None
    if memory is not None:
        rows = [m[d] for m, d in zip(memory, domains)]
        if sum(float(r.max()) for r in rows) > cap:  # else no plan can break the budget
            kept_memory = rows
    sizes = np.array([t.size for t in tables], dtype=np.int64)
    offset = np.cumsum(sizes) - sizes  # one start per edge
    flat = np.concatenate([t.ravel() for t in tables]) if tables else np.zeros(0)
    allowed_pairs = np.isfinite(flat)
    big = BIG_FACTOR * _scale(unary, flat, allowed_pairs, offset)
    flat = np.where(allowed_pairs, flat, big)
    tables = [flat[at : at + t.size].reshape(t.shape) for at, t in zip(offset.tolist(), tables)]
    return Mrf(domains, unary, edges, tables, kept_memory, cap, big, flat, offset)


def _restrict(
    tables: list[np.ndarray],
    edges: np.ndarray,
    allowed: list[np.ndarray],
    domains: list[np.ndarray],
) -> list[np.ndarray]:
    """Tables cut down to the labels kept."""
    full = [bool(a.all()) for a in allowed]
    out = []
    for t, (a, b) in zip(tables, edges.tolist()):
        out.append(t if full[a] and full[b] else t[np.ix_(domains[a], domains[b])])
    return out


def _scale(
    unary: list[np.ndarray], flat: np.ndarray, allowed: np.ndarray, offset: np.ndarray
) -> float:
    """An upper bound on the magnitude of any feasible plan's energy: the largest
    magnitude of each unary, then of each table's allowed entries (``flat`` from
    ``offset``), added one after another."""
    # cumsum adds one after another, as the loop it replaces did: the same bits
    total = 1.0
    if unary:
        starts = np.concatenate([[0], np.cumsum([len(u) for u in unary])[:-1]]).astype(np.int64)
        total += np.cumsum(np.maximum.reduceat(np.abs(np.concatenate(unary)), starts))[-1]
    if len(flat):
        largest = np.maximum.reduceat(np.abs(np.where(allowed, flat, 0.0)), offset)
        largest = largest[np.logical_or.reduceat(allowed, offset)]  # tables with an allowed pair
        total = np.cumsum(np.concatenate([[total], largest]))[-1]
    return float(total)


def _oriented_edges(
    problem: Problem, unary: list[np.ndarray]
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Edges low -> high with their tables; self-loops fold into ``unary``."""
    edges, tables = [], []
    for (u, v), table in zip(problem.edges.tolist(), problem.pairwise):
        table = np.asarray(table, dtype=np.float64)
        if u == v:
            unary[u] = unary[u] + np.diag(table)
        elif u < v:
            edges.append((u, v))
            tables.append(table)
        else:
            edges.append((v, u))
            tables.append(table.T)
    return np.array(edges, dtype=np.int64).reshape(-1, 2), tables


def _memory_rows(problem: Problem, allowed: list[np.ndarray]) -> list[np.ndarray] | None:
    if problem.memory_budget is None or all(m is None for m in problem.memory):
        return None
    rows = []
    for m, ok in zip(problem.memory, allowed):
        row = np.zeros(len(ok)) if m is None else np.asarray(m, dtype=np.float64)
        ok &= np.isfinite(row)
        rows.append(np.where(np.isfinite(row), row, 0.0))
    return rows


def _prune(
    allowed: list[np.ndarray],
    edges: np.ndarray,
    finite: list[np.ndarray | None],
    memory: list[np.ndarray] | None,
    cap: float,
) -> None:
    """Drop labels no finite, budget-respecting plan uses, to a fixed point."""
    partial = [(a, b, f) for (a, b), f in zip(edges.tolist(), finite) if f is not None]
    changed = True
    while changed:
        changed = False
        for v, ok in enumerate(allowed):
            if not ok.any():
                raise NoLabels(v)
        if memory is not None:
            changed |= _prune_memory(allowed, memory, cap)
        for a, b, fin in partial:
            rows = (fin & allowed[b][None, :]).any(axis=1)
            cols = (fin & allowed[a][:, None]).any(axis=0)
            if (allowed[a] & ~rows).any() or (allowed[b] & ~cols).any():
                allowed[a] &= rows
                allowed[b] &= cols
                changed = True


def _prune_memory(allowed: list[np.ndarray], memory: list[np.ndarray], cap: float) -> bool:
    """Labels whose extra memory over the node's least exceeds the budget's slack."""
    least = [float(m[ok].min()) for m, ok in zip(memory, allowed)]
    slack = cap - sum(least)
    changed = False
    for m, ok, lo in zip(memory, allowed, least):
        drop = ok & (m - lo > slack)
        if drop.any():
            ok &= ~drop
            changed = True
    return changed
