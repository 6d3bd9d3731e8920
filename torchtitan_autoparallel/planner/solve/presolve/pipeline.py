"""Exact presolve: shrink a ``Problem`` before a solver sees it, then rebuild the plan.

Two stages, both exact (the reduced optimum plus ``offset`` is the original
optimum, and every reduced plan expands to an original plan of exactly that
energy):

1. ``collapse.collapse_ties``: one node per tie group (repeated layers cost one);
2. ``reduce.Graph``: drop unusable and dominated strategies, fold separable
   tables, fix single-strategy nodes and eliminate memory-free chains and
   leaves, to a fixed point.

``PresolvingSolver`` wraps any solver with it; ``get_solver`` does so by default.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from torchtitan_autoparallel.planner.problem.problem import FlatProblem, InfeasibleProblem, Problem
from torchtitan_autoparallel.planner.solve.base import Solution, Solver
from torchtitan_autoparallel.planner.solve.presolve.collapse import collapse
from torchtitan_autoparallel.planner.solve.presolve.reduce import Graph

LOG = logging.getLogger("torchtitan_autoparallel.planner")
ENERGY_RTOL = 1e-6  # reduced energy + offset vs the expanded plan's energy
# (tie-collapsed problem, each original node's group, prune_memory) -> the graph to reduce
GraphFactory = Callable[[Problem, np.ndarray, bool], Graph]


@dataclass
class Presolved:
    original: Problem
    offset: float  # energy of everything eliminated, added to any reduced energy
    seconds: float
    _group_of: np.ndarray  # original node -> node of the tie-collapsed problem
    _graph: Graph
    _survivors: np.ndarray  # reduced node -> node of the tie-collapsed problem
    reduced: Problem  # tie-free and pin-free; its memory includes the eliminated nodes'

    @property
    def reduced_flat(self) -> FlatProblem:
        """``reduced`` as flat arrays: what the approximate solver reads, without the
        names and labels a ``Problem`` carries."""
        return self.reduced.flat_problem

    def expand(self, reduced_assignment: np.ndarray) -> np.ndarray:
        """The original plan of a reduced plan; its energy is the reduced one + offset."""
        return self._graph.expand_plan(self._survivors, reduced_assignment)[self._group_of]

    def restrict(self, assignment: np.ndarray) -> np.ndarray | None:
        """The reduced plan that keeps an original plan's surviving choices (a warm start),
        or None where the plan uses a strategy the presolve dropped."""
        x = np.asarray(assignment, dtype=np.int64)
        member = np.full(len(self._graph.alive), -1, dtype=np.int64)
        member[self._group_of] = np.arange(len(x))  # one original node per collapsed node
        out = np.empty(len(self._survivors), dtype=np.int64)
        for i, v in enumerate(self._survivors.tolist()):
            domain = np.asarray(self._graph.domain[v])
            where = np.flatnonzero(domain == x[member[v]])
            if not len(where):
                return None
            out[i] = where[0]
        return out

    def summary(self) -> str:
        before, after = problem_size(self.original), problem_size(self.reduced)
        return (
            f"presolve: {_size_text(before)} -> {_size_text(after)} in {self.seconds:.2f} s"
        )


def problem_size(problem: Problem) -> dict[str, int]:
    """Nodes, edges, strategies and ILP-scale variables (strategies + finite table entries)."""
    flat = problem.arrays
    strategies = int(flat.k.sum())
    finite = np.isfinite(flat.flat_tables)
    per_table = np.add.reduceat(finite, flat.table_at) if len(finite) else finite[:0]
    uses = np.bincount(flat.table_of_edge, minlength=len(flat.table_at))
    entries = int((per_table * uses[: len(per_table)]).sum())
    return {
        "nodes": problem.num_nodes,
        "edges": len(problem.edges),
        "strategies": strategies,
        "variables": strategies + entries,
    }


def _size_text(size: dict[str, int]) -> str:
    return ", ".join(f"{v} {k}" for k, v in size.items())


def presolve(
    problem: Problem,
    *,
    dominance: bool = True,
    prune_memory: bool = True,
    make_graph: GraphFactory | None = None,
) -> Presolved:
    """Reduce ``problem`` exactly. ``prune_memory=False`` keeps strategies that only
    the memory budget rules out, so a solver can still name the smallest budget.
    ``make_graph`` swaps in a ``Graph`` that protects more than the energy
    (``overlap.presolve``)."""
    start = time.perf_counter()
    collapsed = collapse(problem)
    tie_free = collapsed.problem()
    graph = Graph(tie_free, prune_memory) if make_graph is None else make_graph(
        tie_free, collapsed.group_of, prune_memory
    )
    graph.reduce(dominance=dominance)
    graph.check_fixed_memory()
    reduced, survivors = graph.reduced_problem(tie_free)
    seconds = time.perf_counter() - start
    return Presolved(
        problem, graph.offset, seconds, collapsed.group_of, graph, survivors, reduced
    )


class PresolvingSolver:
    """Presolve, solve the reduced problem with ``inner``, expand, re-score."""

    def __init__(self, inner: Solver, dominance: bool = True) -> None:
        self.inner = inner
        self.name = inner.name
        self.dominance = dominance

    def solve(self, problem: Problem, time_limit: float | None = None) -> Solution:
        start = time.perf_counter()
        pre = self._presolve(problem)
        LOG.info("%s: %s", self.name, pre.summary())
        if pre.reduced.num_nodes:
            sub = self.inner.solve(pre.reduced, _remaining(start, time_limit))
        else:
            sub = Solution(np.zeros(0, np.int64), 0.0, 0.0, self.name, "optimal", 0.0)
        assignment = pre.expand(sub.assignment)
        objective = problem.energy(assignment)
        expected = sub.objective + pre.offset
        if not math.isclose(objective, expected, rel_tol=ENERGY_RTOL, abs_tol=ENERGY_RTOL):
            raise RuntimeError(
                f"{self.name}: expanded plan costs {objective!r}, the reduced one {expected!r}"
            )
        if not problem.is_feasible(assignment, energy=objective):
            raise RuntimeError(f"{self.name}: the expanded plan violates the problem's constraints")
        lower = objective
        if sub.status != "optimal":  # the reduced bound plus what was eliminated
            lower = min(objective, sub.lower_bound + pre.offset)
        seconds = time.perf_counter() - start
        return Solution(assignment, objective, lower, self.name, sub.status, seconds)

    def _presolve(self, problem: Problem) -> Presolved:
        try:
            return presolve(problem, dominance=self.dominance)
        except InfeasibleProblem:
            if problem.memory_budget is None:
                raise
            # the budget may be what emptied a node; without that pruning the
            # solver's own diagnosis names the smallest feasible budget
            return presolve(problem, dominance=self.dominance, prune_memory=False)


def _remaining(start: float, time_limit: float | None) -> float | None:
    if time_limit is None:
        return None
    return max(time_limit - (time.perf_counter() - start), min(1.0, time_limit))
