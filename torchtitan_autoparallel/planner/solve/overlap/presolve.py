"""The exact presolve, kept exact for the overlap objective ``energy(x) - savings(x)``.

The savings of a plan (``overlap.model``) depend on two things only: the
compute ``c_j(x_j)`` of every node at its step position, and the cost
``comm_e(x_u, x_v)`` of every overlappable edge. The presolve of
``presolve.pipeline`` stays exact for that objective when

* tie collapsing keeps every member node and edge as its own term, priced on
  the group's columns (members share their strategy, so ``c_j`` and
  ``comm_e`` are linear in the group's ``x`` / the group pair's ``y``), at the
  member's own position in the step;
* a node is *protected* while it has more than one strategy left and either
  ends an overlappable edge or has a compute that differs between its
  strategies: it is never minimised out (leaf, chain, isolated), because the
  energy-best choice may hide less, and it drops a strategy only when another
  beats it by more than the savings the swap could lose
  (``overlap.dominance``). Nodes whose choice moves only the energy (views,
  casts, constant compute) are reduced as before: their compute is one
  constant whatever they choose;
* a table that carries an overlappable edge is never folded into the
  unaries, so the edge's ``y`` columns stay in the reduced ILP;
* fixing a single-strategy node is always fine: each term it touches becomes
  linear in the other endpoint's ``x``, or a constant.

Dropping strategies no feasible plan can use changes nothing, and a dropped
dominated strategy always has a kept one no worse in every context. So every
reduced plan expands to a full plan with the same energy (plus the offset) and
the same savings, and every full plan has a reduced plan no worse: the reduced
optimum is the full optimum. One case is only safe, not exact: when the
reduced ILP folds a whole pair table into its offset (constant over the
allowed pairs) while an overlappable edge on it is not constant, the edge is
credited at most its cheapest entry; ``OverlapTerms.slack`` bounds what that
can cost and the solver widens its bound by it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from torchtitan_autoparallel.planner.problem.problem import Problem
from torchtitan_autoparallel.planner.solve.exact.model import IlpModel
from torchtitan_autoparallel.planner.solve.overlap.dominance import NodeOverlap, overlap_margin
from torchtitan_autoparallel.planner.solve.overlap.model import OverlapSpec
from torchtitan_autoparallel.planner.solve.overlap.terms import (
    ColumnIndex,
    LinearBuilder,
    OverlapTerms,
    overlappable,
)
from torchtitan_autoparallel.planner.solve.presolve.pipeline import Presolved, presolve
from torchtitan_autoparallel.planner.solve.presolve.reduce import Graph, beaten


class OverlapGraph(Graph):
    """A ``Graph`` that never reduces away what the savings model prices."""

    def __init__(
        self, problem: Problem, prune_memory: bool, nodes: list[NodeOverlap],
        carrying: set[tuple[int, int]],
    ) -> None:
        super().__init__(problem, prune_memory=prune_memory)
        self._nodes = nodes  # per node: what the savings model prices of it
        self._carrying = carrying  # node pairs (low, high) whose table holds an overlappable edge

    def _energy_only(self, v: int) -> bool:
        dom = self.domain[v]
        node = self._nodes[v]
        if len(dom) <= 1:
            return True
        if node.endpoint:
            return False
        if node.compute is None:
            return True
        sub = node.compute[:, dom]
        return bool(np.isfinite(sub).all() and (sub == sub[:, :1]).all())

    def _energy_only_table(self, v: int, u: int) -> bool:
        return (min(u, v), max(u, v)) not in self._carrying

    def _dominated(self, v: int) -> np.ndarray:
        if self._energy_only(v):
            return super()._dominated(v)
        margin = overlap_margin(self, v, self._nodes[v])
        if margin is None:
            return np.zeros(len(self.domain[v]), dtype=bool)
        return beaten(margin, self.memory[v])


@dataclass
class OverlapPresolved:
    """The reduced problem and how to price the savings terms on its ILP."""

    pre: Presolved
    spec: OverlapSpec

    @property
    def reduced(self) -> Problem:
        return self.pre.reduced

    @property
    def offset(self) -> float:
        return self.pre.offset

    def expand(self, reduced_assignment: np.ndarray) -> np.ndarray:
        return self.pre.expand(reduced_assignment)

    def summary(self) -> str:
        return self.pre.summary()

    def terms(self, base: IlpModel) -> OverlapTerms:
        """Compute and communication terms of the original problem over ``base``'s columns
        (``base`` is ``build_ilp(self.reduced)``)."""
        pricer = ReducedPricer(self.pre, ColumnIndex(base))
        problem = self.pre.original
        compute = LinearBuilder()
        for j in range(problem.num_nodes):
            pricer.node(compute, j, np.asarray(problem.unary[j], dtype=np.float64))
        edges, prefetch, anchor = overlappable(problem, self.spec)
        comm = LinearBuilder()
        for e in edges.tolist():
            u, v = (int(a) for a in problem.edges[e])
            pricer.edge(comm, u, v, np.asarray(problem.pairwise[e], dtype=np.float64))
        return OverlapTerms(np.asarray(self.spec.position, np.int64), compute.build(), edges,
                            prefetch, anchor, comm.build(), pricer.slack)


class ReducedPricer:
    """Writes one original node's or edge's term over the reduced ILP's columns."""

    def __init__(self, pre: Presolved, index: ColumnIndex) -> None:
        self.group_of = pre._group_of
        self.domain = pre._graph.domain
        self.survivor = np.full(len(self.domain), -1, dtype=np.int64)
        self.survivor[pre._survivors] = np.arange(len(pre._survivors))
        self.index = index
        self.slack = 0.0

    def node(self, out: LinearBuilder, j: int, values: np.ndarray) -> None:
        g = int(self.group_of[j])
        self._vector(out, g, values[self.domain[g]], what=f"compute of node {j}")

    def edge(self, out: LinearBuilder, u: int, v: int, table: np.ndarray) -> None:
        a, b = int(self.group_of[u]), int(self.group_of[v])
        sub = table[np.ix_(self.domain[a], self.domain[b])]
        if a == b:  # inside a tie group: both ends take the same strategy
            self._vector(out, a, np.diag(sub), what=f"edge {u}->{v}")
        elif self.survivor[a] < 0 or self.survivor[b] < 0:
            fixed_a, fixed_b = self.survivor[a] < 0, self.survivor[b] < 0
            self._require_fixed(a if fixed_a else b, f"edge {u}->{v}")
            if fixed_a and fixed_b:
                out.add(float(sub[0, 0]))
            elif fixed_a:
                self._vector(out, b, sub[0, :], what=f"edge {u}->{v}")
            else:
                self._vector(out, a, sub[:, 0], what=f"edge {u}->{v}")
        else:
            self._pair(out, a, b, sub)

    def _vector(self, out: LinearBuilder, g: int, values: np.ndarray, what: str) -> None:
        """A term that depends on group ``g``'s strategy only: its x, or a constant."""
        i = int(self.survivor[g])
        if i >= 0:
            cols, s = self.index.x_cols(i)
            out.add(0.0, cols, values[s])
            return
        # eliminated: one strategy left, or a choice that prices nothing but energy
        if not (values == values[0]).all():
            raise RuntimeError(f"presolve: the {what} varies on an eliminated node")
        out.add(float(values[0]))

    def _pair(self, out: LinearBuilder, a: int, b: int, sub: np.ndarray) -> None:
        cols, s, t = self.index.y_cols(int(self.survivor[a]), int(self.survivor[b]))
        if len(cols):
            out.add(0.0, cols, sub[s, t])
            return
        # the reduced table was constant over the allowed pairs and left the ILP:
        # credit the cheapest entry (safe) and account for what that may miss
        _, sa = self.index.x_cols(int(self.survivor[a]))
        _, sb = self.index.x_cols(int(self.survivor[b]))
        allowed = sub[np.ix_(sa, sb)]
        finite = allowed[np.isfinite(allowed)]
        low = float(finite.min()) if finite.size else 0.0
        self.slack += float(finite.max()) - low if finite.size else 0.0
        out.add(low)

    def _require_fixed(self, g: int, what: str) -> None:
        if len(self.domain[g]) != 1:
            raise RuntimeError(f"presolve: an end of {what} was eliminated with a choice left")


def overlap_presolve(problem: Problem, spec: OverlapSpec) -> OverlapPresolved:
    """Presolve ``problem`` keeping what ``spec``'s savings model prices (module docstring)."""
    if spec.num_nodes != problem.num_nodes:
        raise ValueError(f"overlap spec for {spec.num_nodes} nodes, problem has {problem.num_nodes}")
    start = time.perf_counter()

    def make_graph(collapsed: Problem, group_of: np.ndarray, prune_memory: bool) -> Graph:
        return OverlapGraph(collapsed, prune_memory, *_protection(problem, spec, collapsed, group_of))

    pre = presolve(problem, make_graph=make_graph)
    pre.seconds = time.perf_counter() - start
    return OverlapPresolved(pre, spec)


def _protection(
    problem: Problem, spec: OverlapSpec, collapsed: Problem, group_of: np.ndarray
) -> tuple[list[NodeOverlap], set[tuple[int, int]]]:
    """Per group what the savings model prices of it, and which group pairs' tables carry
    an overlappable edge. Tied copies of one row or table are stored once, times their
    count (the dominance loss is a sum of ``max(0, .)``, which scales)."""
    n = collapsed.num_nodes
    nodes = [NodeOverlap() for _ in range(n)]
    rows: list[list[np.ndarray]] = [[] for _ in range(n)]
    for j, unary in enumerate(problem.unary):
        row = np.asarray(unary, dtype=np.float64)
        if np.any(row != 0):
            rows[int(group_of[j])].append(row)
    for g, members in enumerate(rows):
        if members:
            nodes[g].compute, counts = np.unique(np.stack(members), axis=0, return_counts=True)
            nodes[g].weight = counts.astype(np.float64)
    edges, _, _ = overlappable(problem, spec)
    diagonals: list[dict[bytes, list]] = [{} for _ in range(n)]
    tables: list[dict[tuple[int, bytes], list]] = [{} for _ in range(n)]
    for e in edges.tolist():
        a, b = (int(group_of[x]) for x in problem.edges[e])
        table = np.asarray(problem.pairwise[e], dtype=np.float64)
        if a == b:
            _count(diagonals[a], np.diag(table).tobytes(), np.diag(table))
        else:
            _count(tables[a], (b, table.tobytes()), table)
            _count(tables[b], (a, table.T.tobytes()), table.T)
    for g in range(n):
        nodes[g].diagonals = [value * count for value, count in diagonals[g].values()]
        nodes[g].tables = [(key[0], value * count) for key, (value, count) in tables[g].items()]
    ends = group_of[problem.edges[edges]].reshape(-1, 2)
    carrying = {(int(min(a, b)), int(max(a, b))) for a, b in ends.tolist() if a != b}
    return nodes, carrying


def _count(seen: dict, key: object, value: np.ndarray) -> None:
    entry = seen.setdefault(key, [value, 0])
    entry[1] += 1
