"""The exact solve under memory rows (``problem.rows``): the cheapest plan whose every
row stays within its limit.

The rows ride on the presolve of ``presolve.pipeline`` kept exact for them: a
node whose choice moves a row is never minimised out (the energy-best choice
may hold more bytes) and keeps all its strategies through dominance (a
cheaper strategy may hold more). Every other reduction stands, tie groups
included: tied layers' terms add up on their group's columns. Each row is then
written over the reduced ILP's columns (``overlap.presolve.ReducedPricer``)
and added to it, scaled to its limit, before the parameter-memory row; HiGHS
or CBC solves the ILP as ``exact.ilp`` does, without the reduced-cost fixing,
whose warm plans know nothing of the rows.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace

import numpy as np

from torchtitan_autoparallel.planner.problem.problem import InfeasibleProblem, Problem
from torchtitan_autoparallel.planner.problem.rows import GIB, MemoryRow
from torchtitan_autoparallel.planner.solve.base import Solution
from torchtitan_autoparallel.planner.solve.exact.ilp import HighsILPSolver, IlpSolver, _remaining
from torchtitan_autoparallel.planner.solve.exact.model import IlpModel, build_ilp
from torchtitan_autoparallel.planner.solve.overlap.presolve import ReducedPricer
from torchtitan_autoparallel.planner.solve.overlap.terms import ColumnIndex, LinearBuilder
from torchtitan_autoparallel.planner.solve.presolve.pipeline import ENERGY_RTOL, Presolved, presolve
from torchtitan_autoparallel.planner.solve.presolve.reduce import Graph

LOG = logging.getLogger("torchtitan_autoparallel.planner")
ROW_RTOL = 1e-6  # a plan within this of a row's limit meets it (the LP's own tolerance)


class RowGraph(Graph):
    """A ``Graph`` that keeps every node whose choice moves a memory row."""

    def __init__(self, problem: Problem, prune_memory: bool, row_bytes: dict[int, np.ndarray]) -> None:
        super().__init__(problem, prune_memory=prune_memory)
        self._row_bytes = row_bytes  # collapsed node -> (strategies, rows) bytes

    def _moves_rows(self, v: int) -> bool:
        m = self._row_bytes.get(v)
        if m is None or len(self.domain[v]) <= 1:
            return False
        sub = m[self.domain[v]]
        return bool((sub != sub[:1]).any())

    def _energy_only(self, v: int) -> bool:
        return not self._moves_rows(v) and super()._energy_only(v)

    def _dominated(self, v: int) -> np.ndarray:
        if self._moves_rows(v):
            return np.zeros(len(self.domain[v]), dtype=bool)
        return super()._dominated(v)


def presolve_for_rows(problem: Problem, rows: list[MemoryRow]) -> Presolved:
    """The exact presolve, each tie group carrying its members' row bytes (``RowGraph``)."""

    def make_graph(collapsed: Problem, group_of: np.ndarray, prune_memory: bool) -> Graph:
        row_bytes: dict[int, np.ndarray] = {}
        for r, row in enumerate(rows):
            for v, vec in row.terms.items():
                g = int(group_of[v])
                if g not in row_bytes:
                    row_bytes[g] = np.zeros((len(vec), len(rows)))
                row_bytes[g][:, r] += vec
        return RowGraph(collapsed, prune_memory, row_bytes)

    return presolve(problem, make_graph=make_graph)


def add_rows(base: IlpModel, pre: Presolved, rows: list[MemoryRow]) -> IlpModel:
    """``base`` (``build_ilp(pre.reduced)``) with each row, in fractions of its limit,
    inserted before the parameter-memory row (which stays last)."""
    pricer = ReducedPricer(pre, ColumnIndex(base))
    written = [_row_over_columns(pricer, row) for row in rows]
    first = base.num_row - (1 if base.has_memory_row else 0)
    base_rows = np.repeat(np.arange(base.num_row), np.diff(base.row_start))
    base_rows = np.where(base_rows >= first, base_rows + len(rows), base_rows)
    new_rows = [np.full(len(cols), first + r) for r, (cols, _, _) in enumerate(written)]
    all_rows = np.concatenate([base_rows, *new_rows])
    order = np.argsort(all_rows, kind="stable")
    num_row = base.num_row + len(rows)
    start = np.zeros(num_row + 1, dtype=np.int64)
    np.cumsum(np.bincount(all_rows, minlength=num_row), out=start[1:])

    def insert(bounds: np.ndarray, new: list[float]) -> np.ndarray:
        return np.concatenate([bounds[:first], np.asarray(new, dtype=np.float64), bounds[first:]])

    return replace(
        base,
        row_start=start,
        row_index=np.concatenate([base.row_index, *(cols for cols, _, _ in written)])[order],
        row_value=np.concatenate([base.row_value, *(vals for _, vals, _ in written)])[order],
        row_lower=insert(base.row_lower, [-np.inf] * len(rows)),
        row_upper=insert(base.row_upper, [upper for _, _, upper in written]),
        start=None,
        approx=None,
    )


def _row_over_columns(pricer: ReducedPricer, row: MemoryRow) -> tuple[np.ndarray, np.ndarray, float]:
    """One row as (columns, coefficients, upper bound), each column once, scaled to the limit."""
    terms = LinearBuilder()
    for v, vec in row.terms.items():
        pricer.node(terms, v, np.asarray(vec, dtype=np.float64))
    linear = terms.build()
    cols, at = np.unique(linear.cols, return_inverse=True)
    coeffs = np.bincount(at, weights=linear.coeffs, minlength=len(cols))
    upper = (row.limit - row.const - float(linear.const.sum())) / row.limit
    return cols, coeffs / row.limit, upper


def solve_with_rows(
    problem: Problem, rows: list[MemoryRow], time_limit: float | None = None,
    solver: IlpSolver | None = None,
) -> Solution:
    """The cheapest plan of ``problem`` within every row. Raises ``InfeasibleProblem``
    (naming the row and the least it can be) when no plan meets them all."""
    solver = solver or HighsILPSolver()
    start = time.perf_counter()
    pre = presolve_for_rows(problem, rows)
    LOG.info("%s under %d memory row(s): %s", solver.name, len(rows), pre.summary())
    if pre.reduced.num_nodes:
        model = add_rows(build_ilp(pre.reduced), pre, rows)
        run = solver._run(model, _remaining(start, time_limit))
        if run.status in ("infeasible", "no_solution"):
            raise InfeasibleProblem(_no_plan(rows, run.status, time_limit))
        reduced_x = model.assignment(run.col_value)
        bound = run.bound + model.offset
    else:
        reduced_x, bound = np.zeros(0, np.int64), 0.0
    x = pre.expand(reduced_x)
    objective = problem.energy(x)
    expected = objective if not pre.reduced.num_nodes else run.objective + model.offset + pre.offset
    if not math.isclose(objective, expected, rel_tol=ENERGY_RTOL, abs_tol=ENERGY_RTOL):
        raise RuntimeError(f"{solver.name}: expanded plan costs {objective!r}, the reduced one {expected!r}")
    broken = [row for row in rows if row.value(x) > row.limit * (1 + ROW_RTOL)]
    if broken and not pre.reduced.num_nodes:  # the presolve left one plan, and it does not fit
        raise InfeasibleProblem(_no_plan(rows, "infeasible", time_limit))
    if broken or not problem.is_feasible(x, energy=objective):
        raise RuntimeError(f"{solver.name}: the plan breaks {'a memory row' if broken else 'the problem'}")
    status = "optimal" if not pre.reduced.num_nodes else run.status
    lower = objective if status == "optimal" else min(objective, bound + pre.offset)
    return Solution(x, objective, lower, solver.name, status, time.perf_counter() - start)


def _no_plan(rows: list[MemoryRow], status: str, time_limit: float | None) -> str:
    if status == "no_solution":
        return f"no plan within the memory rows was found in the time limit ({time_limit} s)"
    tight = max(rows, key=lambda row: row.least() / row.limit)
    if tight.least() > tight.limit:
        return (
            f"no plan fits {tight.limit / GIB:.2f} GiB per device at {tight.where}: "
            f"it holds at least {tight.least() / GIB:.2f} GiB there whatever is chosen"
        )
    return f"no plan meets the {len(rows)} memory rows together ({', '.join(r.describe() for r in rows)})"
