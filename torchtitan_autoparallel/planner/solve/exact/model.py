"""The local-polytope ILP of a ``Problem``, built as sparse arrays (no per-variable objects).

Columns: one binary ``x[v,s]`` per *allowed* strategy of every node, then one
continuous ``y[e,s,t]`` per finite entry of every edge table that still matters.
Rows, all equalities except the memory row:

* ``sum_s x[v,s] = 1`` per node;
* ``sum_t y[e,s,t] - x[u,s] = 0`` and ``sum_s y[e,s,t] - x[v,t] = 0`` per edge
  and allowed ``s`` / ``t`` (inf entries have no ``y``, so the marginals forbid them);
* ``x[a,s] - x[b,s] = 0`` for consecutive members of a tie group;
* ``sum (memory[v][s] - min_s memory[v]) * x[v,s] <= budget - sum min``, divided
  through by the budget so its coefficients stay O(1).

Pins, infinite unaries, non-finite memory and tie groups only shrink the set of
allowed strategies, so they remove columns instead of adding rows. Edges whose
table is constant over the allowed strategies (all-zero ones in particular) go
into ``offset`` and add no column.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np

from torchtitan_autoparallel.planner.problem.problem import InfeasibleProblem, Problem
from torchtitan_autoparallel.planner.solve.base import GIB, Solution, memory_message
from torchtitan_autoparallel.planner.solve.presolve.collapse import tie_components


@dataclass
class IlpModel:
    num_nodes: int
    x_node: np.ndarray  # (num_x,) node of each x column
    x_strategy: np.ndarray  # (num_x,) strategy index of each x column
    col_cost: np.ndarray  # (num_col,) x columns first, then y columns
    row_start: np.ndarray  # CSR, (num_row + 1,)
    row_index: np.ndarray
    row_value: np.ndarray
    row_lower: np.ndarray
    row_upper: np.ndarray
    offset: float  # constant energy removed from the model (folded edges)
    has_memory_row: bool  # when True it is the last row
    col_memory: np.ndarray  # (num_col,) memory above each node's minimum, in budgets
    memory_offset: float  # sum of the per-node minima, in budgets
    y_pair: np.ndarray  # (num_y, 2) the two x columns each y column is the product of
    start: np.ndarray | None = None  # a feasible plan to warm-start from, if greedy found one
    # the approximate solver's result on the problem, once a solver ran it: not run twice
    approx: Solution | None = None

    @property
    def num_x(self) -> int:
        return len(self.x_node)

    @property
    def num_col(self) -> int:
        return len(self.col_cost)

    @property
    def num_row(self) -> int:
        return len(self.row_lower)

    @property
    def num_nz(self) -> int:
        return len(self.row_index)

    def describe(self) -> str:
        return (
            f"{self.num_col} variables ({self.num_x} binary), {self.num_row} constraints, "
            f"{self.num_nz} nonzeros"
        )

    def assignment(self, col_value: np.ndarray) -> np.ndarray:
        """The strategy of each node: its x column with the largest value."""
        xv = np.asarray(col_value, dtype=np.float64)[: self.num_x]
        order = np.lexsort((-xv, self.x_node))  # by node, largest value first
        first = np.ones(len(order), dtype=bool)
        first[1:] = self.x_node[order][1:] != self.x_node[order][:-1]
        out = np.zeros(self.num_nodes, dtype=np.int64)
        out[self.x_node[order][first]] = self.x_strategy[order][first]
        return out

    def col_values(self, assignment: np.ndarray) -> np.ndarray:
        """The full column vector (x and y) of a plan, e.g. to warm-start a solver."""
        x = (assignment[self.x_node] == self.x_strategy).astype(np.float64)
        return np.concatenate([x, x[self.y_pair[:, 0]] * x[self.y_pair[:, 1]]])

    def min_memory_model(self) -> IlpModel:
        """Same constraints minus the budget, minimising memory instead of time."""
        if not self.has_memory_row:
            raise ValueError("the model has no memory row")
        last = self.row_start[-2]
        return replace(
            self,
            col_cost=self.col_memory.copy(),
            row_start=self.row_start[:-1],
            row_index=self.row_index[:last],
            row_value=self.row_value[:last],
            row_lower=self.row_lower[:-1],
            row_upper=self.row_upper[:-1],
            offset=self.memory_offset,
            has_memory_row=False,
            approx=None,  # its bound is for time, not memory
        )


class _Coo:
    """Growing lists of (row, col, value) blocks and row bounds."""

    def __init__(self) -> None:
        self.rows: list[np.ndarray] = []
        self.cols: list[np.ndarray] = []
        self.vals: list[np.ndarray] = []
        self.lower: list[np.ndarray] = []
        self.upper: list[np.ndarray] = []
        self.num_row = 0

    def new_rows(self, count: int, lower: float, upper: float) -> int:
        first = self.num_row
        self.num_row += count
        self.lower.append(np.full(count, lower))
        self.upper.append(np.full(count, upper))
        return first

    def add(self, rows: np.ndarray, cols: np.ndarray, vals: float | np.ndarray) -> None:
        self.rows.append(np.asarray(rows, dtype=np.int64))
        self.cols.append(np.asarray(cols, dtype=np.int64))
        self.vals.append(np.broadcast_to(np.asarray(vals, dtype=np.float64), len(self.rows[-1])))

    def to_csr(self) -> tuple[np.ndarray, ...]:
        rows = np.concatenate(self.rows) if self.rows else np.zeros(0, np.int64)
        cols = np.concatenate(self.cols) if self.cols else np.zeros(0, np.int64)
        vals = np.concatenate(self.vals) if self.vals else np.zeros(0)
        order = np.argsort(rows, kind="stable")
        start = np.zeros(self.num_row + 1, dtype=np.int64)
        np.cumsum(np.bincount(rows, minlength=self.num_row), out=start[1:])
        lower = np.concatenate(self.lower) if self.lower else np.zeros(0)
        upper = np.concatenate(self.upper) if self.upper else np.zeros(0)
        return start, cols[order], vals[order], lower, upper


def _padded(parts: list[np.ndarray], k: np.ndarray, fill: float) -> np.ndarray:
    """Stack ragged per-node vectors into an (n, kmax) array."""
    n, kmax = len(k), int(k.max(initial=1))
    out = np.full((n, kmax), fill, dtype=np.float64)
    if n:
        rows = np.repeat(np.arange(n), k)
        cols = np.arange(int(k.sum())) - np.repeat(np.cumsum(k) - k, k)
        out[rows, cols] = np.concatenate(parts).astype(np.float64)
    return out


def allowed_strategies(problem: Problem, unary: np.ndarray) -> np.ndarray:
    """(n, kmax) mask of strategies any feasible plan may use, before edges."""
    kmax = unary.shape[1]
    allowed = np.isfinite(unary)
    for v, s in problem.pins.items():
        allowed[v] &= np.arange(kmax) == s
    if problem.memory_budget is not None:
        for v, m in enumerate(problem.memory):
            if m is not None:
                allowed[v, : len(m)] &= np.isfinite(m)
    if problem.ties:
        comp = tie_components(problem.num_nodes, problem.ties)
        # a tied strategy survives only if every member of the component allows it
        votes = np.zeros_like(allowed, dtype=np.int64)
        np.add.at(votes, comp, allowed.astype(np.int64))
        size = np.bincount(comp, minlength=problem.num_nodes)
        allowed = votes[comp] == size[comp][:, None]
    empty = np.flatnonzero(~allowed.any(axis=1))
    if len(empty):
        names = ", ".join(problem.node_names[v] for v in empty[:5])
        raise InfeasibleProblem(
            f"{len(empty)} node(s) have no allowed strategy after pins, ties and "
            f"infinite costs: {names}"
        )
    return allowed


def _edge_blocks(
    edges: np.ndarray,
    pairwise: list[np.ndarray],
    k: np.ndarray,
    allowed: np.ndarray,
    offset: list[float],
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Yield (u, v, tables, finite-and-allowed mask) per table shape, stacked.

    Edges whose table is constant over the allowed strategies (all-zero ones in
    particular) are folded into ``offset[0]`` instead.
    """
    if not len(edges):
        return
    shapes = np.stack([k[edges[:, 0]], k[edges[:, 1]]], axis=1)
    for ku, kv in np.unique(shapes, axis=0):
        ids = np.flatnonzero((shapes[:, 0] == ku) & (shapes[:, 1] == kv))
        u, v = edges[ids, 0], edges[ids, 1]
        tables = np.stack([pairwise[e] for e in ids]).astype(np.float64)
        mask = allowed[u, :ku, None] & allowed[v, None, :kv]
        finite = np.isfinite(tables) & mask
        hi = np.where(mask, tables, -np.inf).max(axis=(1, 2))
        lo = np.where(mask, tables, np.inf).min(axis=(1, 2))
        constant = (finite == mask).all(axis=(1, 2)) & (hi == lo)
        offset[0] += float(lo[constant].sum())
        keep = ~constant
        if keep.any():
            yield u[keep], v[keep], tables[keep], finite[keep]


def build_ilp(problem: Problem) -> IlpModel:
    """Vectorised construction of the marginal-polytope ILP of ``problem``."""
    n = problem.num_nodes
    k = problem.num_strategies
    unary = _padded(problem.unary, k, np.inf)
    offset = [0.0]
    # self-loops change the unaries, so fold them before deciding what is allowed
    loops = problem.edges[:, 0] == problem.edges[:, 1]
    for e in np.flatnonzero(loops):
        v = problem.edges[e, 0]
        unary[v, : k[v]] += np.diag(problem.pairwise[e])
    allowed = allowed_strategies(problem, unary)
    x_node, x_strategy = np.nonzero(allowed)
    xcol = np.full(allowed.shape, -1, dtype=np.int64)
    xcol[x_node, x_strategy] = np.arange(len(x_node))
    costs = [unary[x_node, x_strategy]]
    y_pairs = [np.zeros((0, 2), dtype=np.int64)]
    coo = _Coo()

    first = coo.new_rows(n, 1.0, 1.0)
    coo.add(first + x_node, xcol[x_node, x_strategy], 1.0)

    num_col = len(x_node)
    pairwise = [t for t, lp in zip(problem.pairwise, loops) if not lp]
    for u, v, tables, finite in _edge_blocks(problem.edges[~loops], pairwise, k, allowed, offset):
        g, s, t = np.nonzero(finite)
        ycol = num_col + np.arange(len(g))
        num_col += len(g)
        costs.append(tables[g, s, t])
        y_pairs.append(np.stack([xcol[u[g], s], xcol[v[g], t]], axis=1))
        ku, kv = tables.shape[1:]
        for nodes, width, idx in ((u, ku, s), (v, kv, t)):
            ok = allowed[nodes, :width]  # one marginal row per allowed strategy
            row_of = np.full(ok.shape, -1, dtype=np.int64)
            row_of[ok] = coo.new_rows(int(ok.sum()), 0.0, 0.0) + np.arange(int(ok.sum()))
            coo.add(row_of[g, idx], ycol, 1.0)
            gg, ss = np.nonzero(ok)
            coo.add(row_of[gg, ss], xcol[nodes[gg], ss], -1.0)

    _add_tie_rows(problem, allowed, xcol, coo)
    col_memory = np.zeros(num_col)
    memory_offset, has_memory_row = _add_memory_row(problem, allowed, (x_node, x_strategy), col_memory, coo)
    start, index, value, lower, upper = coo.to_csr()
    return IlpModel(
        num_nodes=n,
        x_node=x_node,
        x_strategy=x_strategy,
        col_cost=np.concatenate(costs),
        row_start=start,
        row_index=index,
        row_value=value,
        row_lower=lower,
        row_upper=upper,
        offset=offset[0],
        has_memory_row=has_memory_row,
        col_memory=col_memory,
        memory_offset=memory_offset,
        y_pair=np.concatenate(y_pairs),
        start=_greedy_plan(problem, allowed, unary),
    )


def _add_memory_row(
    problem: Problem, allowed: np.ndarray, x_cols: tuple[np.ndarray, np.ndarray], col_memory: np.ndarray, coo: _Coo
) -> tuple[float, bool]:
    """Fill the x columns of ``col_memory`` and add the budget row where a plan's memory
    can vary; returns the memory every plan needs (in budget units) and whether the row exists."""
    if problem.memory_budget is None:
        return 0.0, False
    # in units of the budget, so the solver's absolute row tolerance (1e-6)
    # matches the relative slack of Problem.is_feasible
    scale = problem.memory_budget if problem.memory_budget > 0 else GIB
    x_node, x_strategy = x_cols  # the node and strategy of each x column
    memory = _padded([_memory_of(problem, v) for v in range(problem.num_nodes)], problem.num_strategies, 0.0)
    per_node = np.where(allowed, memory, np.inf).min(axis=1)
    memory_offset = float(per_node.sum()) / scale
    col_memory[: len(x_node)] = (memory[x_node, x_strategy] - per_node[x_node]) / scale
    nz = np.flatnonzero(col_memory)
    budget = problem.memory_budget / scale - memory_offset
    if not len(nz):
        if budget < 0:  # every plan needs the same memory
            raise InfeasibleProblem(memory_message(problem.memory_budget, memory_offset * scale))
        return memory_offset, False
    row = coo.new_rows(1, -np.inf, budget)
    coo.add(np.full(len(nz), row), nz, col_memory[nz])
    return memory_offset, True


def _add_tie_rows(problem: Problem, allowed: np.ndarray, xcol: np.ndarray, coo: _Coo) -> None:
    pairs = [(g[i], g[i + 1]) for g in problem.ties for i in range(len(g) - 1)]
    if not pairs:
        return
    a, b = np.array(pairs, dtype=np.int64).T
    p, s = np.nonzero(allowed[a])  # tied nodes share their allowed set
    rows = coo.new_rows(len(p), 0.0, 0.0) + np.arange(len(p))
    coo.add(rows, xcol[a[p], s], 1.0)
    coo.add(rows, xcol[b[p], s], -1.0)


def _memory_of(problem: Problem, v: int) -> np.ndarray:
    m = problem.memory[v]
    return np.zeros(len(problem.unary[v])) if m is None else np.asarray(m, dtype=np.float64)


def _greedy_plan(problem: Problem, allowed: np.ndarray, unary: np.ndarray) -> np.ndarray | None:
    """One pass in node order, each node taking its cheapest finite choice given
    the nodes already placed. It gives time-limited solves an incumbent from the
    start; None when the pass dead-ends or breaks the memory budget."""
    n = problem.num_nodes
    comp = tie_components(n, problem.ties)
    incident: list[list[int]] = [[] for _ in range(n)]
    for e, (u, v) in enumerate(problem.edges.tolist()):
        if u != v:  # self-loops are already in ``unary``
            incident[u].append(e)
            incident[v].append(e)
    plan = np.full(n, -1, dtype=np.int64)
    chosen: dict[int, int] = {}  # tie component -> its strategy
    for v in range(n):
        if int(comp[v]) in chosen:
            plan[v] = chosen[int(comp[v])]
            continue
        score = np.where(allowed[v], unary[v], np.inf)[: len(problem.unary[v])]
        for e in incident[v]:
            a, b = problem.edges[e]
            if a == v and plan[b] >= 0:
                score = score + problem.pairwise[e][:, plan[b]]
            elif b == v and plan[a] >= 0:
                score = score + problem.pairwise[e][plan[a], :]
        best = int(np.argmin(score))
        if not np.isfinite(score[best]):
            return None
        plan[v] = chosen[int(comp[v])] = best
    return plan if problem.is_feasible(plan) else None
