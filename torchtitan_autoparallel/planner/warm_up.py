"""Compile the planner's numba loops now, into numba's on-disk cache.

Nothing needs this: each loop compiles the first time a plan calls it (and
1-D plans run them as Python, ``jit.py``), logging a compile that
takes a while. Run it where the first 2-D or 3-D plan on a machine should not
pay that compile (a few minutes on 2 cores), e.g. when building an image;
later runs load the cached code in about a second. Run it again after
changing a compiled module, or let the next plan recompile.

    python -m torchtitan_autoparallel.planner.warm_up
"""

from __future__ import annotations

import logging
import time

import numpy as np

from torchtitan_autoparallel.planner.cost import pricer
from torchtitan_autoparallel.planner.problem.problem import Problem
from torchtitan_autoparallel.planner.solve.approx.solver import ApproxSolver
from torchtitan_autoparallel.planner.solve.presolve import kernels

LOG = logging.getLogger("torchtitan_autoparallel.planner")


def compile_all() -> None:
    """Call every compiled loop once with each argument type a plan passes it (numba
    compiles one version per type; read-only and transposed arrays are types of
    their own)."""
    pricer.warm_up()
    table = np.zeros((2, 2))
    frozen = np.zeros((2, 2))
    frozen.flags.writeable = False  # shared tables are read-only: another signature
    kernels.min_plus(table, table)
    kernels.min_plus(table, frozen)
    starts = np.array([0, 2])
    kernels.dominated(np.zeros(2), table, starts, np.zeros(0))
    kernels.scan(np.zeros(2), table, starts, 0.0, np.zeros(0), 0.0, 1.0)
    for t in (table, table.T, frozen, frozen.T):
        kernels.separable(t, 0.0)
    one = np.zeros(1, np.int64)
    kernels.picked_sum(np.zeros(1), one, one)
    kernels.add_rows(np.zeros((1, 1)), np.zeros(1), one + 1, one)
    graph = (np.zeros(2, np.int64), one[:0], one[:0], np.zeros(0, np.bool_), one[:0], one[:0])
    kernels.tree_block(np.zeros((1, 1)), np.zeros((1, 1)), one, one + 1, np.zeros(0), graph, 0, 1, 0.0)
    kernels.neighbour_costs(np.zeros((1, 1)), one[:1] * 0, one, np.zeros(0), graph)
    _solve_small()


def _solve_small() -> None:
    """The loops outside ``kernels`` (presolve, scoring, message passing, local
    search) for the argument types a real solve passes: one tiny solve of every kind
    it meets (ties, a pin, a budget that binds, a forbidden pair)."""
    rng = np.random.default_rng(0)
    k = [3, 2, 3, 2, 3]
    edges = [(0, 1), (1, 2), (2, 3), (3, 4), (0, 2), (1, 3)]
    tables = [rng.uniform(0, 10, (k[a], k[b])) for a, b in edges]
    tables[0][0, 0] = np.inf
    problem = Problem(
        node_names=[f"n{v}" for v in range(5)],
        strategy_labels=[[str(s) for s in range(kv)] for kv in k],
        unary=[rng.uniform(0, 10, kv) for kv in k],
        edges=np.array(edges),
        pairwise=tables,
        memory=[np.array([3.0, 2.0, 1.0]), None, np.array([3.0, 2.0, 1.0]), None, None],
        memory_budget=4.0,
        pins={4: 1},
        ties=[[0, 2]],
    )
    level = LOG.level
    LOG.setLevel(logging.WARNING)  # the solver's own lines are no news here
    try:
        ApproxSolver(exact_fallback=False).solve(problem)
    finally:
        LOG.setLevel(level)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    LOG.info("compiling the planner's loops (a few minutes on 2 cores; seconds once cached) ...")
    compile_all()
    LOG.info("planner loops ready (%.1f s)", time.perf_counter() - start)


if __name__ == "__main__":
    main()
