"""Which problem edges of a traced step can overlap with compute (``[autoparallel] overlap``).

* prefetch: an edge whose producer is a parameter, or a cast/view of one,
  carries a weight that exists from the start of the step; its gather can be
  issued early and hide behind the compute before its consumer (FSDP's
  forward/backward prefetch);
* backward: an edge into a node that only finishes parameter gradients (every
  path from it leads to a gradient output), or a gradient -> parameter edge,
  carries a gradient reduction that can run behind the compute that follows
  its producer (DDP/FSDP bucketed reduce-scatters).

Activation redistributions stay exposed: their consumer waits on them.
The solver side is ``planner/solve/overlap/``.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import fx

from torchtitan_autoparallel.planner.plan.plan import Plan, _gradient_tail
from torchtitan_autoparallel.planner.problem.build import GRAD_EDGE, BuiltProblem
from torchtitan_autoparallel.planner.solve.overlap.model import OverlapSpec
from torchtitan_autoparallel.planner.solve.overlap.solver import overlap_breakdown
from torchtitan_autoparallel.planner.strategies.rules import VIEW_OPS
from torchtitan_autoparallel.planner.trace.trace import TracedStep

log = logging.getLogger("torchtitan_autoparallel.planner")


def weight_root(node: fx.Node) -> fx.Node:
    """Walk back through views and dtype casts (mixed precision) to the tensor they reshape."""
    while node.op == "call_function" and (
        node.target in VIEW_OPS or node.target is torch.ops.aten._to_copy.default
    ):
        node = node.args[0]
    return node


def overlap_spec(built: BuiltProblem, traced: TracedStep) -> OverlapSpec:
    """Classify every problem edge as prefetch, backward or exposed."""
    params = set(traced.params.values())
    tail = _gradient_tail(traced)
    prefetch: list[int] = []
    backward: list[int] = []
    for e, parts in enumerate(built.edge_parts):
        if any(p.arg_index == GRAD_EDGE or p.consumer in tail for p in parts):
            backward.append(e)
        elif all(weight_root(p.producer) in params for p in parts):
            prefetch.append(e)
    order = {n: i for i, n in enumerate(traced.graph.graph.nodes)}
    position = np.array([order[n] for n in built.nodes], dtype=np.int64)
    log.info(
        "overlap: %d prefetchable (parameter) edges, %d gradient-side edges of %d",
        len(prefetch), len(backward), len(built.edge_parts),
    )
    return OverlapSpec(len(built.nodes), np.array(prefetch), np.array(backward), position)


def add_overlap_prediction(plan: Plan, built: BuiltProblem, spec: OverlapSpec, assignment: np.ndarray) -> float:
    """Record what the plan hides in ``plan.predicted``; returns the savings (us)."""
    savings = overlap_breakdown(built.problem, spec, assignment).total
    plan.predicted["overlap_savings_us"] = savings
    plan.predicted["effective_us"] = plan.predicted["total_us"] - savings
    return savings


def effective_us(built: BuiltProblem, spec: OverlapSpec, assignment: np.ndarray) -> float:
    """The step time of a plan with what the overlap hides taken off (the overlap solver's objective)."""
    return float(built.problem.energy(assignment)) - overlap_breakdown(built.problem, spec, assignment).total
