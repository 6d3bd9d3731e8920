"""The chosen strategy of every node, and placement comparisons the executor relies on.

The solver returns one strategy index per problem node; the executor needs the
``Strategy`` itself (output placements + required input placements), keyed by
graph node. Placements are compared after normalising negative shard dims,
because torch's rules and ours may spell ``Shard(-1)`` and ``Shard(ndim-1)``
differently for the same layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from torch import fx
from torch.distributed.tensor.placement_types import Placement, Shard, _StridedShard

from torchtitan_autoparallel.planner.build import BuiltProblem
from torchtitan_autoparallel.planner.placement import Placements
from torchtitan_autoparallel.planner.solve.base import Solution
from torchtitan_autoparallel.planner.strategy import Strategy


def chosen_strategies(built: BuiltProblem, solution: Solution) -> dict[fx.Node, Strategy]:
    """Graph node -> the strategy the solution picked for it."""
    x = np.asarray(solution.assignment, dtype=np.int64)
    if len(x) != len(built.nodes):
        raise ValueError(
            f"solution assigns {len(x)} nodes but the problem has {len(built.nodes)}; "
            "was it solved for another trace?"
        )
    chosen: dict[fx.Node, Strategy] = {}
    for i, node in enumerate(built.nodes):
        options = built.strategies(node)
        k = int(x[i])
        if not 0 <= k < len(options):
            raise ValueError(f"node {node.name}: strategy {k} out of range (it has {len(options)})")
        chosen[node] = options[k]
    return chosen


def normalise(placements: Sequence[Placement], ndim: int) -> Placements:
    """Shard dims made non-negative (``_StridedShard`` keeps its split factor)."""
    out: list[Placement] = []
    for p in placements:
        if isinstance(p, _StridedShard) and p.dim < 0:
            out.append(_StridedShard(p.dim + ndim, split_factor=p.split_factor))
        elif isinstance(p, Shard) and not isinstance(p, _StridedShard) and p.dim < 0:
            out.append(Shard(p.dim + ndim))
        else:
            out.append(p)
    return tuple(out)


def same_placements(a: Sequence[Placement], b: Sequence[Placement], ndim: int) -> bool:
    return normalise(a, ndim) == normalise(b, ndim)


def placements_text(placements: Sequence[Placement] | None) -> str:
    if placements is None:
        return "-"
    return "(" + ", ".join(str(p) for p in placements) + ")"
