"""What the overlap model prices, as linear expressions over an ILP's columns.

The savings model (``overlap.model``) needs two kinds of numbers of a plan:

* the compute ``c_j(x)`` of every node of the step, at the node's step position;
* the communication ``comm_e(x)`` of every overlappable edge, anchored at its
  consumer (prefetch) or producer (backward).

Each is ``const + sum coeff * column`` over the columns of one node's ``x`` or
one edge's ``y`` (exactly one of which is 1 in an integral plan), so the
largest value an expression can take is ``const + max coeff``. Keeping them
separate from the ILP they refer to is what lets the same savings model run on
the full problem (``full_terms``), on a fixed plan (``fixed_terms``, all
constants) and on the presolved problem (``overlap.presolve``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from torchtitan_autoparallel.planner.problem.problem import Problem
from torchtitan_autoparallel.planner.solve.exact.model import IlpModel


@dataclass
class Linear:
    """Expressions ``const[i] + sum_k coeff[k] * col[k]`` for ``k`` in ``ptr[i]:ptr[i+1]``."""

    const: np.ndarray
    ptr: np.ndarray
    cols: np.ndarray
    coeffs: np.ndarray

    def __len__(self) -> int:
        return len(self.const)

    def largest(self) -> np.ndarray:
        """The most each expression can be (one column of each is 1)."""
        top = np.zeros(len(self))
        sizes = np.diff(self.ptr)
        has = sizes > 0
        if has.any():
            top[has] = np.maximum.reduceat(self.coeffs, self.ptr[:-1][has])
        return self.const + top

    def terms(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.ptr[i], self.ptr[i + 1]
        return self.cols[lo:hi], self.coeffs[lo:hi]


class LinearBuilder:
    """Collects expressions one at a time."""

    def __init__(self) -> None:
        self.const: list[float] = []
        self.sizes: list[int] = []
        self.cols: list[np.ndarray] = []
        self.coeffs: list[np.ndarray] = []

    def add(self, const: float, cols: np.ndarray | None = None, coeffs: np.ndarray | None = None) -> None:
        cols = np.zeros(0, np.int64) if cols is None else np.asarray(cols, dtype=np.int64)
        coeffs = np.zeros(0) if coeffs is None else np.asarray(coeffs, dtype=np.float64)
        self.const.append(float(const))
        self.sizes.append(len(cols))
        self.cols.append(cols)
        self.coeffs.append(coeffs)

    def build(self) -> Linear:
        ptr = np.zeros(len(self.sizes) + 1, dtype=np.int64)
        np.cumsum(self.sizes, out=ptr[1:])
        cat = (lambda parts, dt: np.concatenate(parts).astype(dt) if parts else np.zeros(0, dt))
        return Linear(np.asarray(self.const, dtype=np.float64), ptr,
                      cat(self.cols, np.int64), cat(self.coeffs, np.float64))


@dataclass
class OverlapTerms:
    """Compute per node and communication per overlappable edge, with their positions."""

    node_pos: np.ndarray  # step position of each compute expression
    compute: Linear
    edges: np.ndarray  # original problem edge of each communication expression
    prefetch: np.ndarray  # bool: prefetch chain (else backward)
    anchor: np.ndarray  # pos[consumer] (prefetch) or -pos[producer] (backward)
    comm: Linear
    # the most savings the expressions may under-credit: an edge whose reduced
    # table folded into the ILP's offset is credited its cheapest entry (safe)
    slack: float = 0.0


def overlappable(problem: Problem, spec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # noqa: ANN001
    """Overlappable non-loop edges, whether each is a prefetch, and its chain anchor."""
    edges = np.union1d(spec.prefetch, spec.backward).astype(np.int64)
    edges = edges[problem.edges[edges, 0] != problem.edges[edges, 1]]  # loops sit in the unary
    prefetch = np.isin(edges, spec.prefetch)
    pos = spec.position
    anchor = np.where(prefetch, pos[problem.edges[edges, 1]], -pos[problem.edges[edges, 0]])
    return edges, prefetch, anchor


class ColumnIndex:
    """x columns per node and y columns per node pair of an ``IlpModel``."""

    def __init__(self, base: IlpModel) -> None:
        self.base = base
        n = max(base.num_nodes, 1)
        self._x_order = np.argsort(base.x_node, kind="stable")
        self._x_start = np.searchsorted(base.x_node[self._x_order], np.arange(n + 1))
        y0, y1 = base.y_pair[:, 0], base.y_pair[:, 1]
        key = base.x_node[y0] * n + base.x_node[y1]
        self._y_order = np.argsort(key, kind="stable")
        self._y_key = key[self._y_order]
        self._n = n

    def x_cols(self, v: int) -> tuple[np.ndarray, np.ndarray]:
        """Columns and strategies of node ``v``."""
        cols = self._x_order[self._x_start[v] : self._x_start[v + 1]]
        return cols, self.base.x_strategy[cols]

    def y_cols(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Columns of the ``a``-``b`` table and the strategies of ``a`` and ``b`` they pair."""
        for first, second, flip in ((a, b, False), (b, a, True)):
            key = first * self._n + second
            lo, hi = np.searchsorted(self._y_key, [key, key + 1])
            if hi > lo:
                cols = self.base.num_x + self._y_order[lo:hi]
                pair = self.base.y_pair[cols - self.base.num_x]
                s, t = self.base.x_strategy[pair[:, 0]], self.base.x_strategy[pair[:, 1]]
                return (cols, t, s) if flip else (cols, s, t)
        empty = np.zeros(0, np.int64)
        return empty, empty, empty


def full_terms(problem: Problem, spec, base: IlpModel) -> OverlapTerms:  # noqa: ANN001
    """Terms over ``build_ilp(problem)`` itself: no reduction in between."""
    index = ColumnIndex(base)
    compute = LinearBuilder()
    for v in range(problem.num_nodes):
        cols, s = index.x_cols(v)
        compute.add(0.0, cols, np.asarray(problem.unary[v], dtype=np.float64)[s])
    edges, prefetch, anchor = overlappable(problem, spec)
    comm = LinearBuilder()
    for e in edges.tolist():
        u, v = (int(a) for a in problem.edges[e])
        cols, s, t = index.y_cols(u, v)
        if len(cols):
            comm.add(0.0, cols, problem.pairwise[e][s, t])
        else:  # folded into the offset: constant over the allowed pairs
            comm.add(_cheapest(problem.pairwise[e], index.x_cols(u)[1], index.x_cols(v)[1]))
    return OverlapTerms(np.asarray(spec.position, np.int64), compute.build(), edges, prefetch,
                        anchor, comm.build())


def fixed_terms(problem: Problem, spec, assignment: np.ndarray) -> OverlapTerms:  # noqa: ANN001
    """Terms of one fixed plan: every compute and communication is a constant."""
    x = np.asarray(assignment, dtype=np.int64)
    compute = LinearBuilder()
    for v in range(problem.num_nodes):
        compute.add(float(problem.unary[v][x[v]]))
    edges, prefetch, anchor = overlappable(problem, spec)
    comm = LinearBuilder()
    for e in edges.tolist():
        u, v = problem.edges[e]
        comm.add(float(problem.pairwise[e][x[u], x[v]]))
    return OverlapTerms(np.asarray(spec.position, np.int64), compute.build(), edges, prefetch,
                        anchor, comm.build())


def _cheapest(table: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> float:
    sub = np.asarray(table, dtype=np.float64)[np.ix_(rows, cols)]
    finite = sub[np.isfinite(sub)]
    return float(finite.min()) if finite.size else 0.0


def empty_model() -> IlpModel:
    """An ILP with no columns or rows, for the savings LP of a fixed plan."""
    zi, zf = np.zeros(0, np.int64), np.zeros(0)
    return IlpModel(
        num_nodes=0, x_node=zi, x_strategy=zi, col_cost=zf, row_start=np.zeros(1, np.int64),
        row_index=zi, row_value=zf, row_lower=zf, row_upper=zf, offset=0.0,
        has_memory_row=False, col_memory=zf, memory_offset=0.0, y_pair=np.zeros((0, 2), np.int64),
    )
