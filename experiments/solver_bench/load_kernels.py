"""Load (or compile, the first time) every compiled loop a solve calls, before the solve is timed.

numba compiles, or loads from its cache, one version of a loop per argument type on
that type's first call; read-only tables (shared ones are) and transposed tables are
types of their own. A solver child calls ``load_all`` once, timed apart
(``kernel_load_s``), so that no solver's time carries loads another one was spared.
"""

from __future__ import annotations

import logging

import numpy as np

from torchtitan_autoparallel.planner.problem.problem import Problem
from torchtitan_autoparallel.planner.solve import get_solver
from torchtitan_autoparallel.planner.solve.approx import kernels as search_kernels
from torchtitan_autoparallel.planner.solve.presolve import kernels as presolve_kernels


def load_all() -> None:
    _presolve_loops()
    _search_loops()
    level = logging.getLogger("torchtitan_autoparallel.planner").level
    logging.getLogger("torchtitan_autoparallel.planner").setLevel(logging.WARNING)
    try:  # the loops called from Python inside a solve, priced and unpriced
        for budget in (4.0, None):
            get_solver("approx").solve(_tiny(budget))
    finally:
        logging.getLogger("torchtitan_autoparallel.planner").setLevel(level)


def _presolve_loops() -> None:
    table = np.zeros((2, 2))
    frozen = np.zeros((2, 2))
    frozen.flags.writeable = False
    presolve_kernels.min_plus(table, table)
    presolve_kernels.min_plus(table, frozen)
    starts = np.array([0, 2])
    presolve_kernels.dominated(np.zeros(2), table, starts, np.zeros(0))
    presolve_kernels.scan(np.zeros(2), table, starts, 0.0, np.zeros(0), 0.0, 1.0)
    for t in (table, table.T, frozen, frozen.T):
        presolve_kernels.separable(t, 0.0)
    one = np.zeros(1, np.int64)
    presolve_kernels.add_rows(np.zeros((1, 1)), np.zeros(1), one + 1, one)


def _search_loops() -> None:
    one = np.zeros(1, np.int64)
    search_kernels.picked_sum(np.zeros(1), one, one)
    graph = (np.zeros(2, np.int64), one[:0], one[:0], np.zeros(0, np.bool_), one[:0], one[:0])
    search_kernels.tree_block(np.zeros((1, 1)), np.zeros((1, 1)), one, one + 1, np.zeros(0), graph, 0, 1, 0.0)
    search_kernels.neighbour_costs(np.zeros((1, 1)), one[:1] * 0, one, np.zeros(0), graph)


def _tiny(budget: float | None) -> Problem:
    """Five nodes with ties, a pin, a forbidden pair and (with ``budget``) memory that binds."""
    rng = np.random.default_rng(0)
    k = [3, 2, 3, 2, 3]
    edges = [(0, 1), (1, 2), (2, 3), (3, 4), (0, 2), (1, 3)]
    tables = [rng.uniform(0, 10, (k[a], k[b])) for a, b in edges]
    tables[0][0, 0] = np.inf
    memory = [np.array([3.0, 2.0, 1.0]), None, np.array([3.0, 2.0, 1.0]), None, None]
    return Problem(
        node_names=[f"n{v}" for v in range(5)],
        strategy_labels=[[str(s) for s in range(kv)] for kv in k],
        unary=[rng.uniform(0, 10, kv) for kv in k],
        edges=np.array(edges),
        pairwise=tables,
        memory=memory if budget is not None else [None] * 5,
        memory_budget=budget,
        pins={4: 1},
        ties=[[0, 2]],
    )
