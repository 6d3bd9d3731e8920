"""Communication/computation overlap as extra LP columns and rows on the sharding ILP.

The plain objective charges every redistribution in full. With overlap some of
it runs while compute proceeds; the model credits that with a continuous saving
``s_e`` per overlappable edge:

* ``s_e <= comm_e(x) = sum_(s,t) cost_e[s,t] * y[e,s,t]`` (at most what the
  chosen pair costs; for an edge folded into the ILP's offset, its constant);
* each node's compute ``c_j(x) = sum_s unary[j,s] * x[j,s]`` is split as
  ``f_j + b_j <= c_j(x)`` between two budget chains, so the same compute never
  hides two transfers;
* prefetch chain (parameter gathers): walking the step in order,
  ``B_k = B_(k-1) + sum f_j (nodes between anchors) - sum s_e (edges whose
  consumer sits at anchor k)``, ``B_k >= 0``, ``B_0 = 0``: a gather can only
  hide behind compute that runs before its consumer;
* backward chain (gradient reductions): the same in reverse order, anchored at
  each edge's producer: a reduction hides behind compute that follows it.

Compute and communication come in as ``OverlapTerms`` (``overlap.terms``):
linear expressions over the base ILP's columns, so the same model is built on
the full problem, on one fixed plan (all constants) or on the presolved
problem (``overlap.presolve``), where one expression can stand for many tied
edges and shares a capped column.

The objective gains ``- sum s_e``. Every new column is scaled into [0, 1] (by
the largest value it can take), so the existing backends, which bound every
column by [0, 1], take the model unchanged. Rows of the chains stay in
microseconds; HiGHS scales them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from torchtitan_autoparallel.planner.problem.problem import Problem
from torchtitan_autoparallel.planner.solve.exact.model import IlpModel, build_ilp
from torchtitan_autoparallel.planner.solve.overlap.terms import Linear, OverlapTerms, full_terms


@dataclass
class OverlapSpec:
    """Which edges may overlap with compute, and in what order the step runs."""

    num_nodes: int
    prefetch: np.ndarray  # edge indices hidden by compute that precedes their consumer
    backward: np.ndarray  # edge indices hidden by compute that follows their producer
    position: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # node -> step order

    def __post_init__(self) -> None:
        self.prefetch = np.asarray(self.prefetch, dtype=np.int64).reshape(-1)
        self.backward = np.asarray(self.backward, dtype=np.int64).reshape(-1)
        if len(self.position) == 0:  # problem index order is graph order by default
            self.position = np.arange(self.num_nodes, dtype=np.int64)
        self.position = np.asarray(self.position, dtype=np.int64)
        # an edge in both lists would be credited twice
        self.prefetch = np.setdiff1d(self.prefetch, self.backward)


@dataclass
class OverlapIlpModel(IlpModel):
    """The ILP plus overlap columns; ``saving_col[i]`` is the column of ``saving_edge[i]``."""

    saving_edge: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    saving_col: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    saving_scale: np.ndarray = field(default_factory=lambda: np.zeros(0))  # us per unit column
    num_base_col: int = 0
    # base columns -> full columns with the best overlap variables (set by the solver)
    completion: Callable[[np.ndarray], np.ndarray] | None = None

    def col_values(self, assignment: np.ndarray) -> np.ndarray:
        """The plan's x and y, with the savings it can best achieve (a warm start worth its value)."""
        base = super().col_values(assignment)[: self.num_base_col]
        zeros = np.concatenate([base, np.zeros(self.num_col - self.num_base_col)])
        return self.completion(base) if self.completion is not None else zeros

    def savings(self, col_value: np.ndarray) -> np.ndarray:
        """Microseconds saved per ``saving_edge`` in a solution."""
        return np.asarray(col_value, dtype=np.float64)[self.saving_col] * self.saving_scale


class _Rows:
    """Rows and columns appended to an existing model, as COO blocks."""

    def __init__(self, first_row: int, first_col: int) -> None:
        self.first_row, self.first_col = first_row, first_col
        self.num_row = self.num_col = 0
        self.rows: list[np.ndarray] = []
        self.cols: list[np.ndarray] = []
        self.vals: list[np.ndarray] = []
        self.upper: list[float] = []
        self.lower: list[float] = []
        self.cost: list[np.ndarray] = []

    def new_cols(self, count: int, cost: np.ndarray | float = 0.0) -> np.ndarray:
        cols = self.first_col + self.num_col + np.arange(count)
        self.num_col += count
        self.cost.append(np.broadcast_to(np.asarray(cost, dtype=np.float64), (count,)).copy())
        return cols

    def new_row(self, lower: float, upper: float) -> int:
        self.lower.append(lower)
        self.upper.append(upper)
        self.num_row += 1
        return self.first_row + self.num_row - 1

    def add(self, row: int | np.ndarray, cols: np.ndarray, vals: np.ndarray | float) -> None:
        cols = np.asarray(cols, dtype=np.int64).reshape(-1)
        self.rows.append(np.broadcast_to(np.asarray(row, dtype=np.int64), cols.shape).copy())
        self.cols.append(cols)
        self.vals.append(np.broadcast_to(np.asarray(vals, dtype=np.float64), cols.shape).copy())


def build_overlap_ilp(problem: Problem, spec: OverlapSpec) -> OverlapIlpModel:
    """``build_ilp(problem)`` plus the savings, split and budget-chain variables."""
    if spec.num_nodes != problem.num_nodes:
        raise ValueError(f"overlap spec for {spec.num_nodes} nodes, problem has {problem.num_nodes}")
    base = build_ilp(problem)
    return add_overlap(base, full_terms(problem, spec, base))


def add_overlap(base: IlpModel, terms: OverlapTerms) -> OverlapIlpModel:
    """``base`` plus the savings model of ``terms`` (expressions over ``base``'s columns)."""
    memory_last = base.has_memory_row
    extra = _Rows(base.num_row - (1 if memory_last else 0), base.num_col)
    node_scale = terms.compute.largest()
    f_col, b_col = _split_columns(terms.compute, node_scale, extra)
    keep, s_col, s_scale = _saving_columns(terms.comm, extra)
    fwd, anchor = terms.prefetch[keep], terms.anchor[keep]
    pos = terms.node_pos
    has = node_scale > 0
    for chain, cols, node_pos in ((fwd, f_col, pos), (~fwd, b_col, -pos)):
        _chain_rows(node_pos[has], cols[has], node_scale[has], anchor[chain], s_col[chain],
                    s_scale[chain], extra)
    model = _merged(base, extra, memory_last)
    model.saving_edge, model.saving_col, model.saving_scale = terms.edges[keep], s_col, s_scale
    return model


def _split_columns(
    compute: Linear, node_scale: np.ndarray, extra: _Rows
) -> tuple[np.ndarray, np.ndarray]:
    """f_j, b_j per node with compute: f_j + b_j <= c_j(x), in units of the node's largest c_j."""
    n = len(node_scale)
    nodes = np.flatnonzero(node_scale > 0)
    f_col = np.full(n, -1, dtype=np.int64)
    b_col = np.full(n, -1, dtype=np.int64)
    f_col[nodes] = extra.new_cols(len(nodes))
    b_col[nodes] = extra.new_cols(len(nodes))
    for v in nodes.tolist():
        scale = node_scale[v]
        row = extra.new_row(-np.inf, compute.const[v] / scale)
        cols, coeffs = compute.terms(v)
        extra.add(row, np.concatenate([[f_col[v], b_col[v]], cols]),
                  np.concatenate([[1.0, 1.0], -coeffs / scale]))
    return f_col, b_col


def _saving_columns(comm: Linear, extra: _Rows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One s_e per expression that can cost anything, capped by it.

    Repeated layers give many edges the very same expression over the reduced
    problem's columns; those share one capped column ``z`` (``s_e <= z``), so the
    model grows by a row per edge, not by a copy of the table per edge.
    """
    scale = comm.largest()
    keep = np.flatnonzero(scale > 0)
    s_col = extra.new_cols(len(keep), -scale[keep])
    groups: dict[tuple[bytes, bytes, float], list[int]] = {}
    for i, e in enumerate(keep.tolist()):
        cols, coeffs = comm.terms(e)
        if len(cols):
            groups.setdefault((cols.tobytes(), coeffs.tobytes(), float(comm.const[e])), []).append(i)
    for members in groups.values():
        e = int(keep[members[0]])
        cap = s_col[members[0]] if len(members) == 1 else extra.new_cols(1)[0]
        _cap_row(comm, e, scale[e], cap, extra)
        if len(members) > 1:  # s_e - z <= 0: same expression, same scale
            for i in members:
                row = extra.new_row(-np.inf, 0.0)
                extra.add(row, [s_col[i], cap], np.array([1.0, -1.0]))
    return keep, s_col, scale[keep]


def _cap_row(comm: Linear, e: int, scale: float, col: int, extra: _Rows) -> None:
    """col * scale <= const + sum coeff * y, divided by scale (a constant needs only the bound)."""
    cols, coeffs = comm.terms(e)
    row = extra.new_row(-np.inf, comm.const[e] / scale)
    extra.add(row, np.concatenate([[col], cols]), np.concatenate([[1.0], -coeffs / scale]))


def _chain_rows(
    node_pos: np.ndarray,
    node_col: np.ndarray,
    node_scale: np.ndarray,
    edge_anchor: np.ndarray,
    edge_col: np.ndarray,
    edge_scale: np.ndarray,
    extra: _Rows,
) -> None:
    """B_r = B_(r-1) + (compute strictly before anchor r, after anchor r-1) - savings at r.

    Positions are ascending in the chain's direction (the backward chain passes
    them negated). B_r is a column scaled by the most it can hold.
    """
    if not len(edge_col):
        return
    anchors = np.unique(edge_anchor)
    node_row = np.searchsorted(anchors, node_pos, side="right")  # anchors <= pos: later rows
    used = node_row < len(anchors)
    capacity = np.cumsum(np.bincount(node_row[used], weights=node_scale[used], minlength=len(anchors)))
    capacity = np.where(capacity > 0, capacity, 1.0)  # no compute yet: B stays 0 anyway
    budget = extra.new_cols(len(anchors))
    rows = np.array([extra.new_row(0.0, 0.0) for _ in range(len(anchors))], dtype=np.int64)
    extra.add(rows, budget, capacity)
    extra.add(rows[1:], budget[:-1], -capacity[:-1])
    extra.add(rows[node_row[used]], node_col[used], -node_scale[used])
    extra.add(rows[np.searchsorted(anchors, edge_anchor)], edge_col, edge_scale)


def _merged(base: IlpModel, extra: _Rows, memory_last: bool) -> OverlapIlpModel:
    """The base model with ``extra`` appended; the memory row (if any) stays last."""
    base_rows = np.repeat(np.arange(base.num_row), np.diff(base.row_start))
    rows = [base_rows] + extra.rows
    if memory_last:  # move it below the new rows
        rows[0] = np.where(base_rows == base.num_row - 1, base.num_row - 1 + extra.num_row, base_rows)
    row = np.concatenate(rows)
    col = np.concatenate([base.row_index] + extra.cols)
    val = np.concatenate([base.row_value] + extra.vals)
    num_row = base.num_row + extra.num_row
    order = np.argsort(row, kind="stable")
    start = np.zeros(num_row + 1, dtype=np.int64)
    np.cumsum(np.bincount(row, minlength=num_row), out=start[1:])
    lower, upper = list(base.row_lower), list(base.row_upper)
    cut = len(lower) - (1 if memory_last else 0)
    lower[cut:cut] = extra.lower
    upper[cut:cut] = extra.upper
    new_cols = extra.num_col
    fields = {f: getattr(base, f) for f in IlpModel.__dataclass_fields__}
    fields.update(
        col_cost=np.concatenate([base.col_cost] + extra.cost),
        row_start=start,
        row_index=col[order],
        row_value=val[order],
        row_lower=np.asarray(lower, dtype=np.float64),
        row_upper=np.asarray(upper, dtype=np.float64),
        col_memory=np.concatenate([base.col_memory, np.zeros(new_cols)]),
    )
    return OverlapIlpModel(**fields, num_base_col=base.num_col)
