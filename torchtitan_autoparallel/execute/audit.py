"""The collective audit: what one step executes versus what the plan said it would.

``CommDebugMode`` counts the functional collectives DTensor issues. The audit
runs ``PlannedStep.run_graph`` only: the scalar all-reduce that turns a
Partial loss into a loggable number (``PlannedStep.step``) is outside the
plan, which has no edge from the loss to a consumer.

Kinds are compared by name. On gloo DTensor has no all-to-all and gathers
then chunks instead, so a planned ``all_to_all`` is expected as an
``all_gather`` there.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from torchtitan_autoparallel.execute.compiled import KINDS
from torchtitan_autoparallel.execute.step import PlannedStep
from torchtitan_autoparallel.planner.plan.plan import Plan


def expected_collectives(plan: Plan, backend: str | None = None) -> Counter:
    """Kind -> count of the collectives one step of ``plan`` runs."""
    backend = backend or _backend()
    expected: Counter = Counter()
    for c in plan.collectives:
        kind = "all_gather" if c.kind == "all_to_all" and backend == "gloo" else c.kind
        expected[kind] += c.count
    return expected


def executed_collectives(comm_counts: dict) -> Counter:
    """``CommDebugMode.get_comm_counts()`` -> kind -> count (other ops under their own name)."""
    executed: Counter = Counter()
    for op, n in comm_counts.items():
        name = str(op).split(".")[-1] if "." in str(op) else str(op)
        kind = next((k for k in KINDS if k in name), name)
        executed[kind] += n
    return Counter({k: v for k, v in executed.items() if v})


def audit(planned_step: PlannedStep, plan: Plan, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[Counter, Counter]:
    """(expected, executed) collective counts of one step on the global batch.

    The step runs for real (gradients are computed and dropped): call it
    before training or on a throwaway batch.
    """
    dtokens, dlabels = planned_step.distribute_batch(tokens, labels)
    with CommDebugMode() as comm:
        planned_step.run_graph(dtokens, dlabels)
    return expected_collectives(plan), executed_collectives(comm.get_comm_counts())


def _backend() -> str | None:
    return dist.get_backend() if dist.is_initialized() else None
