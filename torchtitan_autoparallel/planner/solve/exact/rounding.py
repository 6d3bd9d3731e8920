"""From an LP optimum to a plan: per-node marginals, rounded and then polished.

The exact solver's incumbent for reduced-cost fixing (``fixing``) when the LP
is fractional.
"""

from __future__ import annotations

import numpy as np

from torchtitan_autoparallel.planner.problem.problem import Problem
from torchtitan_autoparallel.planner.solve.approx.local_search import polish
from torchtitan_autoparallel.planner.solve.approx.mrf import NoLabels, build_mrf
from torchtitan_autoparallel.planner.solve.exact.model import IlpModel
from torchtitan_autoparallel.planner.solve.presolve.collapse import collapse_ties


def marginals(problem: Problem, model: IlpModel, x_values: np.ndarray) -> np.ndarray:
    """(n, kmax) LP value of each node's strategies; strategies the model dropped stay at -1."""
    out = np.full((problem.num_nodes, int(problem.num_strategies.max(initial=1))), -1.0)
    out[model.x_node, model.x_strategy] = x_values
    return out


def round_and_polish(
    problem: Problem, node_marginals: np.ndarray, deadline: float | None
) -> np.ndarray | None:
    """Largest marginal per node (over strategies a feasible plan may use), then local
    search under the budget; None when no feasible plan comes out."""
    collapsed, group_of = collapse_ties(problem)
    try:
        mrf = build_mrf(collapsed)
    except NoLabels:
        return None
    first = np.unique(group_of, return_index=True)[1]  # tied members share marginals
    picks = [int(np.argmax(node_marginals[v][d])) for v, d in zip(first.tolist(), mrf.domains)]
    labels = np.array(picks, dtype=np.int64)
    x = polish(mrf, labels, deadline)
    return mrf.expand(x)[group_of] if mrf.feasible(x) else None
