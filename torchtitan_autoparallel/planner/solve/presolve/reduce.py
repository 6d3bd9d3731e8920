"""Exact graph reductions of a tie-free ``Problem``, iterated to a fixed point.

Each reduction keeps the optimum (and the set of optimal energies) unchanged:

* strategies that no feasible plan can use are dropped: infinite unary or
  memory, a table row that is all ``inf``, memory that alone breaks the budget;
* a strategy dominated by another (no better unary, no better row in any
  incident table, no less memory) is dropped;
* a table that is a sum ``a[s] + b[t]`` (a constant one in particular) moves
  into the two unaries;
* a node with one strategy left is fixed: its table rows join its neighbours'
  unaries;
* a memory-free node of degree 0, 1 or 2 is eliminated by min-marginalisation
  (a min-plus product for degree 2, only when that does not grow the problem),
  recording the argmin (for degree 2, the product's operands: the argmin is
  found only for the neighbours' labels a plan picks) so the plan can be
  rebuilt.

The graph is kept as adjacency dictionaries of oriented tables (the two
orientations of a table are a view of each other), and a work list revisits
only the nodes whose neighbourhood changed.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import NoReturn

import numpy as np

from torchtitan_autoparallel.planner.problem.problem import InfeasibleProblem, Problem
from torchtitan_autoparallel.planner.solve.base import memory_message
from torchtitan_autoparallel.planner.solve.presolve import kernels

BUDGET_RTOL = 1e-6  # the slack Problem.is_feasible grants the budget
SEPARABLE_RTOL = 1e-12  # a table this close to a + b is folded (rounding only)
DOMINANCE_MAX_WORK = 50_000_000  # k * k * neighbour strategies above which it is skipped
_UNSCANNED = (-1, None, None)  # ``Graph._scanned`` when no node's tables are at hand


@dataclass
class Elimination:
    """How to rebuild one eliminated node from the nodes that outlived it."""

    node: int
    parents: tuple[int, ...]
    parent_domains: tuple[np.ndarray, ...]  # the parents' strategies when it was eliminated
    # indexed by the parents' positions in those domains -> strategy; None for a link,
    # whose choice is found only for the parents' labels a plan picks (``link``)
    choice: np.ndarray | None
    link: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # left, right, strategies

    def pick(self, at: tuple[int, ...]) -> int:
        if self.link is None:
            return int(self.choice[at])
        left, right, strategies = self.link
        return int(strategies[kernels.first_argmin_plus(left, right, *at)])


class Graph:
    """A tie-free problem being reduced in place."""

    def __init__(self, problem: Problem, prune_memory: bool = True) -> None:
        n = problem.num_nodes
        self.problem = problem
        self.prune_memory = prune_memory
        self.domain = [np.arange(k) for k in problem.num_strategies]
        self.unary = [np.asarray(u, dtype=np.float64).copy() for u in problem.unary]
        self.budget = problem.memory_budget
        use_memory = self.budget is not None
        self.memory: list[np.ndarray | None] = [
            np.asarray(m, dtype=np.float64).copy() if use_memory and m is not None else None
            for m in problem.memory
        ]
        self.adj: list[dict[int, np.ndarray]] = [{} for _ in range(n)]
        self.alive = np.ones(n, dtype=bool)
        self.offset = 0.0  # energy of the eliminated parts
        self.fixed_memory = 0.0  # memory every remaining plan uses, taken out of the nodes
        self.eliminations: list[Elimination] = []
        self.dominance = True
        self._queue: deque[int] = deque()
        self._queued = np.zeros(n, dtype=bool)
        # (node, its tables side by side, where each starts) while they stay as scanned
        self._scanned: tuple = _UNSCANNED
        for e, (u, v) in enumerate(problem.edges.tolist()):
            table = np.asarray(problem.pairwise[e], dtype=np.float64)
            if u == v:
                self.unary[u] += np.diag(table)
            else:
                self._add_table(u, v, table)
        for v, s in problem.pins.items():
            self._restrict(v, self.domain[v] == s)
        for v in range(n):
            self._normalise_memory(v)

    # --- the fixed point ---------------------------------------------------

    def reduce(self, dominance: bool = True) -> None:
        self.dominance = dominance
        for v in range(len(self.alive)):
            self._push(v)
        fixed_seen = None
        while True:
            while self._queue:
                v = self._queue.popleft()
                self._queued[v] = False
                if self.alive[v]:
                    self._visit(v)
            if self.prune_memory and self.fixed_memory != fixed_seen:
                # more fixed memory leaves less room for every remaining choice
                fixed_seen = self.fixed_memory
                for v in self._memory_holders():
                    self._push(v)
                continue
            if not self._drop_slack_memory():
                return

    def _visit(self, v: int) -> None:
        # a chain link or leaf goes before its tables are scanned: eliminating it is
        # exact whatever they hold, and it is most of the visits
        if len(self.domain[v]) > 1 and self._try_eliminate(v):
            return
        usable = self._fold_separable(v)
        if usable is not None:
            self._drop(v, usable)
        if self._try_eliminate(v):
            return
        # dead-end elimination is the costly check: only for nodes that stay
        if self.dominance and len(self.domain[v]) > 1:
            self._drop(v, ~self._dominated(v))
            self._try_eliminate(v)

    def _drop(self, v: int, keep: np.ndarray) -> None:
        if len(keep) and keep.all():  # the common case first (an empty domain is no plan)
            return
        if not keep.any():
            self._nothing_left(v)
        self._restrict(v, keep)
        self._normalise_memory(v)
        self._push_neighbours(v)

    def _nothing_left(self, v: int) -> NoReturn:
        raise InfeasibleProblem(nothing_left(self.problem.node_names[v]))

    def _try_eliminate(self, v: int) -> bool:
        if len(self.domain[v]) == 1:
            self._eliminate_fixed(v)
        elif self.memory[v] is None and len(self.adj[v]) <= 2 and self._energy_only(v):
            degree = len(self.adj[v])
            if degree == 0:
                self._eliminate_isolated(v)
            elif degree == 1:
                self._eliminate_leaf(v)
            else:
                return self._eliminate_link(v)
        else:
            return False
        return True

    # --- hooks: what else a node's choice prices (``overlap.presolve``) -------

    def _energy_only(self, v: int) -> bool:
        """Whether ``v``'s choice matters to nothing but the energy (and memory), so that
        minimising it out stays exact (``_margin`` decides dominance)."""
        return True

    def _energy_only_table(self, v: int, u: int) -> bool:
        """Whether the ``v``-``u`` table may move into the unaries when separable."""
        return True

    def _push(self, v: int) -> None:
        if self.alive[v] and not self._queued[v]:
            self._queued[v] = True
            self._queue.append(v)

    def _push_neighbours(self, v: int) -> None:
        for u in self.adj[v]:
            self._push(u)

    # --- dropping strategies -----------------------------------------------

    def _dominated(self, v: int) -> np.ndarray:
        """Goldstein's dead-end elimination: ``s`` goes when some ``t`` is at least as
        good in every context of the neighbours, i.e.

            U[s] - U[t] + sum_e min_j (T_e[s, j] - T_e[t, j]) >= 0

        and it uses no less memory. It subsumes entry-wise dominance (every
        difference >= 0) and is exact: swapping ``s`` for ``t`` in any plan never
        raises its energy or memory. Of two equivalent strategies the lower index
        stays, so one always survives.

        Each table's difference at ``s``'s cheapest column bounds ``min_j`` from
        above, so most pairs are ruled out at a fraction of the cost
        (``kernels.dominated``); only the pairs that survive get the exact minimum.
        """
        k = len(self.domain[v])
        if self._scanned[0] == v:
            side = self._scanned[1:]
        else:
            side = _side_by_side(list(self.adj[v].values()), k)
        if k * k * side[0].shape[1] > DOMINANCE_MAX_WORK:
            return np.zeros(k, dtype=bool)
        memory = self.memory[v]
        return kernels.dominated(
            self.unary[v], *side, np.zeros(0) if memory is None else memory
        )

    def _restrict(self, v: int, keep: np.ndarray) -> None:
        self._scanned = _UNSCANNED
        self.domain[v] = self.domain[v][keep]
        self.unary[v] = self.unary[v][keep]
        if self.memory[v] is not None:
            self.memory[v] = self.memory[v][keep]
        for u, table in self.adj[v].items():
            self._set_table(v, u, table[keep])

    def _normalise_memory(self, v: int) -> None:
        """Move each node's least memory into ``fixed_memory``; drop a constant vector."""
        m = self.memory[v]
        if m is None or not len(m) or not np.isfinite(m.min()):
            return
        least = float(m.min())
        self.fixed_memory += least
        self.memory[v] = m - least
        if not self.memory[v].any():
            self.memory[v] = None
            self._push(v)

    def _memory_holders(self) -> list[int]:
        return [int(v) for v in np.flatnonzero(self.alive) if self.memory[v] is not None]

    def _drop_slack_memory(self) -> bool:
        """When even the hungriest plan fits the budget, the budget never binds."""
        holders = self._memory_holders()
        if not holders:
            return False
        worst = self.fixed_memory + sum(float(self.memory[v].max()) for v in holders)
        if not worst <= self.budget * (1 + BUDGET_RTOL):
            return False
        for v in holders:
            self.memory[v] = None
            self._push(v)
        return True

    # --- tables ------------------------------------------------------------

    def _set_table(self, u: int, v: int, table: np.ndarray) -> None:
        self._scanned = _UNSCANNED
        self.adj[u][v] = table
        self.adj[v][u] = table.T

    def _add_table(self, u: int, v: int, table: np.ndarray) -> None:
        if v in self.adj[u]:
            table = self.adj[u][v] + table
        self._set_table(u, v, table)

    def _drop_edge(self, u: int, v: int) -> None:
        self._scanned = _UNSCANNED
        del self.adj[u][v]
        del self.adj[v][u]

    def _fold_separable(self, v: int) -> np.ndarray | None:
        """Move ``v``'s separable tables into the unaries. Returns which of its
        strategies are usable (``kernels.scan``; the folding changes none of them),
        or None when all are."""
        neighbours = list(self.adj[v].items())
        side, starts = _side_by_side([t for _, t in neighbours], len(self.domain[v]))
        m = self.memory[v]
        limit = self.budget * (1 + BUDGET_RTOL) if self.prune_memory and m is not None else np.inf
        split, usable, any_split, all_usable = kernels.scan(
            self.unary[v], side, starts, SEPARABLE_RTOL,
            np.zeros(0) if m is None else m, self.fixed_memory, limit,
        )
        self._scanned = (v, side, starts)  # until a table changes (``_set_table``)
        for (u, t), fold in zip(neighbours, split.tolist() if any_split else ()):
            if fold and self._energy_only_table(v, u):
                self.unary[v] += t[:, 0]
                self.unary[u] += t[0, :] - t[0, 0]
                self._drop_edge(v, u)
                self._push(u)
        return None if all_usable else usable

    # --- eliminations --------------------------------------------------------

    def _remove(
        self, v: int, parents: tuple[int, ...], choice: np.ndarray | None, link=None
    ) -> None:
        domains = tuple(self.domain[p] for p in parents)  # replaced, never written (``_restrict``)
        self.eliminations.append(Elimination(v, parents, domains, choice, link))
        for u in list(self.adj[v]):
            self._drop_edge(v, u)
            self._push(u)
        self.alive[v] = False

    def _eliminate_fixed(self, v: int) -> None:
        for u, table in self.adj[v].items():
            self.unary[u] += table[0, :]
        self.offset += float(self.unary[v][0])
        if self.memory[v] is not None:
            self.fixed_memory += float(self.memory[v][0])
        self._remove(v, (), self.domain[v][:1].reshape(()))

    def _eliminate_isolated(self, v: int) -> None:
        best = int(np.argmin(self.unary[v]))
        if self.unary[v][best] == np.inf:  # unscanned (``_visit``): nothing is usable
            self._nothing_left(v)
        self.offset += float(self.unary[v][best])
        self._remove(v, (), self.domain[v][best].reshape(()))

    def _eliminate_leaf(self, v: int) -> None:
        (u,) = self.adj[v]
        cost = self.adj[u][v] + self.unary[v][None, :]  # (k_u, k_v)
        best = np.argmin(cost, axis=1)
        self.unary[u] += cost[np.arange(len(best)), best]
        self._remove(v, (u,), self.domain[v][best])

    def _eliminate_link(self, v: int) -> bool:
        u, w = self.adj[v]
        ku, kv, kw = len(self.domain[u]), len(self.domain[v]), len(self.domain[w])
        if w not in self.adj[u] and ku * kw > kv * (ku + kw):
            return False  # the u-w table would outgrow the two it replaces
        left = np.ascontiguousarray(self.adj[u][v] + self.unary[v][None, :])  # (k_u, k_v)
        right = np.ascontiguousarray(self.adj[v][w])
        self._add_table(u, w, kernels.min_plus(left, right))
        self._remove(v, (u, w), None, (left, right, self.domain[v]))
        return True

    # --- results -----------------------------------------------------------

    def expand(self, values: dict[int, int]) -> np.ndarray:
        """A full plan from the strategies of the surviving nodes (original indices)."""
        x = np.full(len(self.alive), -1, dtype=np.int64)
        for v, s in values.items():
            x[v] = s
        for rec in reversed(self.eliminations):
            at = tuple(
                int(np.searchsorted(d, x[p])) for p, d in zip(rec.parents, rec.parent_domains)
            )
            x[rec.node] = rec.pick(at)
        return x

    def expand_plan(self, survivors: np.ndarray, x: np.ndarray) -> np.ndarray:
        """``expand`` of a reduced plan ``x``: the labels of ``survivors``, in order."""
        labels = np.asarray(x, dtype=np.int64).tolist()
        return self.expand(
            {int(v): int(self.domain[v][s]) for v, s in zip(survivors.tolist(), labels)}
        )

    def reduced_problem(self, collapsed: Problem) -> tuple[Problem, np.ndarray]:
        """The problem over the surviving nodes of ``collapsed`` (the problem this graph
        was made from), and which those are."""
        survivors = np.flatnonzero(self.alive)
        index = {int(v): i for i, v in enumerate(survivors)}
        edges, tables = [], []
        for v in survivors.tolist():
            for u, table in self.adj[v].items():
                if u > v:
                    edges.append((index[v], index[u]))
                    tables.append(np.ascontiguousarray(table))
        memory = [self.memory[v] for v in survivors]
        holders = [i for i, m in enumerate(memory) if m is not None]
        if holders:  # the memory every plan uses rides on one holder, so the budget stays as is
            memory[holders[0]] = memory[holders[0]] + self.fixed_memory
        reduced = Problem(
            node_names=[collapsed.node_names[v] for v in survivors],
            strategy_labels=[
                [collapsed.strategy_labels[v][s] for s in self.domain[v]] for v in survivors
            ],
            unary=[self.unary[v] for v in survivors],
            edges=np.array(edges, dtype=np.int64).reshape(-1, 2),
            pairwise=tables,
            memory=memory,
            memory_budget=self.budget if holders else None,
        )
        return reduced, survivors

    def check_fixed_memory(self) -> None:
        """With no memory left to choose, the fixed part alone must fit."""
        if self.budget is None or self._memory_holders():
            return
        if self.fixed_memory > self.budget * (1 + BUDGET_RTOL):
            raise InfeasibleProblem(memory_message(self.budget, self.fixed_memory))


def nothing_left(name: str) -> str:
    return (
        "no plan satisfies the pins, ties and forbidden (inf) choices "
        f"(presolve: nothing is left for {name})"
    )


def swap_difference(a: np.ndarray, b: np.ndarray, finite: bool) -> np.ndarray:
    """``a - b`` for dominance. A forbidden ``a`` entry puts no constraint on swapping
    ``s`` away (such plans cost ``inf`` already), so it counts as ``+inf``; a
    forbidden ``b`` entry against a finite ``a`` one blocks the swap (``-inf``)."""
    with np.errstate(invalid="ignore"):
        diff = a - b
    if not finite:
        diff = np.where(np.isinf(a), np.inf, diff)
    return diff


def beaten(margin: np.ndarray, memory: np.ndarray | None) -> np.ndarray:
    """Strategies ``s`` with some ``t`` at ``margin[s, t] > 0``, or ``>= 0`` when ``t < s``
    (of two equivalent strategies the lower index stays), that uses no more memory."""
    k = margin.shape[0]
    if memory is not None:
        margin = np.where(memory[:, None] < memory[None, :], -np.inf, margin)
    lower = np.tri(k, k, -1, dtype=bool)  # lower[s, t]: t < s
    out = (margin > 0) | ((margin >= 0) & lower)
    np.fill_diagonal(out, False)
    return out.any(axis=1)


def _side_by_side(tables: list[np.ndarray], rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The tables (``rows`` rows each) as one C-contiguous array, and where each starts."""
    starts = np.fromiter(
        itertools.accumulate((t.shape[1] for t in tables), initial=0), np.int64, len(tables) + 1
    )
    side = np.empty((rows, int(starts[-1])))  # always a fresh C array: one kernel signature
    if tables:
        np.concatenate(tables, axis=1, out=side)
    return side, starts
