"""The buffers of a plan's collectives as the executor runs them, for ``memory.py``.

The planner's walk sees a redistributed input only at the op that reads it.
The executor (``execute/bucketing.py``) merges all-gathers and
reduce-scatters into buckets, by the rule in ``buckets.py`` that this module
applies to the planned collectives in the traced order, and the backend adds
its own scratch (``buckets.backend_scratch_bytes``). What that costs, as
spans of graph positions holding bytes:

* a merged all-gather is waited for before its first member's first use
  (position ``w``): there the packed input (the members' shards,
  concatenated), the gathered buffer and the backend's scratch are live, and
  each member's own gathered copy lives from ``w`` on, instead of from the
  op that reads it (a parameter's: a weight copy);
* a merged reduce-scatter is issued once its last member's input exists: the
  members' unreduced inputs live until then, and its packed input (full
  size) until its wait, before the first use of a result or the next other
  collective, whichever comes first; the backend's scratch is live right
  after the issue, once packing has freed the inputs; its results are views
  of one output buffer, live while any of them is;
* one left alone (and every all-to-all: a shard moved to another tensor dim)
  costs its scratch where it runs, and its input lives until it is issued.

In the traced order a collective runs where its consumer does, and a
parameter's gradient is reduced right after the backward's last read of it
(``buckets.gradient_triggers``), as in the graph the executor records. Its
window, as the executor computes it: collectives after
the first of a redistribution read that first one's result and stay alone;
one along another tensor dim than the first needs its result at once (an
all-gather's) or makes its input right there (a reduce-scatter's); and the
executor's copies back into a traced memory layout (``execute/layout.py``)
are mutations no window crosses.

Not modelled: the overlap scheduler issues an all-gather bucket up to
``buckets.IN_FLIGHT`` collectives early, which moves its buffers before its
wait; the prediction places them at the wait. And the collectives are the
cost model's path (``redistribute_steps``), where the executor runs
``DTensor.redistribute``'s: the same on a 1-D mesh (the buckets predicted for
an FSDP plan are the executed ones, ``tests/planner/test_collective_memory.py``), but
on a 2-D mesh DTensor may take other steps, and the buckets differ (the
2-layer parity model over dp_shard 2 x tp 2: no bucket predicted for 3
executed without recomputation, 7 for 9 with full recomputation; a reduced
gradient is merged only with others, so the executed merges keep what
the prediction keeps alive).
"""

from __future__ import annotations

import bisect
import math
import operator
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import fx
from torch._prims_common import compute_elementwise_output_logical_to_physical_perm
from torch.distributed.tensor.placement_types import Shard

from torchtitan_autoparallel.planner.cost.cost_model import redistribute_steps
from torchtitan_autoparallel.planner.plan.buckets import (
    BUCKET_BYTES,
    BUCKETED_KINDS,
    backend_scratch_bytes,
    gradient_triggers,
    group_buckets,
)
from torchtitan_autoparallel.planner.problem.build import GRAD_EDGE, EdgeInfo
from torchtitan_autoparallel.planner.strategies.rules import VIEW_OPS
from torchtitan_autoparallel.planner.strategies.strategy import Strategy

COLLECTIVE = "collective_buffers"
WEIGHT = "weight_copies"
ACTIVATION = "activations"


@dataclass
class Span:
    first: int  # graph positions, both included
    last: int
    bytes: float
    kind: str  # COLLECTIVE, WEIGHT or ACTIVATION
    # of ``bytes``: the redistributed inputs it holds, each with its bytes in this plan
    # (what a memory row moves with the consumer's choice: ``peak_rows``)
    holds: tuple[tuple[EdgeInfo, float], ...] = ()
    # whose placement sizes them: the consumer's input (a gather's) or the producer's output
    # (a reduce-scatter's unreduced input)
    held_by: str = "consumer"


@dataclass
class PlannedCollective:
    """One collective the executor will issue, as ``buckets.group_buckets`` reads it."""

    kind: str
    key: tuple
    start: int  # position of its input's producer
    end: int  # position of the first op that needs its result
    nbytes: float  # full size: the gathered output, the unreduced input
    local_bytes: float  # the other side: the shard sent, the shard received
    order: tuple  # issue order in the recorded graph
    at: int  # where it runs in the traced order
    part: EdgeInfo
    weight: bool  # gathers a parameter (or a cast or view of one)


@dataclass
class ExecutedCollectives:
    spans: list[Span] = field(default_factory=list)
    # allocation owner -> the position its life is extended to (unreduced inputs)
    held_until: dict[fx.Node, int] = field(default_factory=dict)
    buckets: list[list[PlannedCollective]] = field(default_factory=list)  # merged ones


def executed_collectives(
    order: list[fx.Node],
    chosen: Mapping[fx.Node, Strategy],
    edge_parts: list[list[EdgeInfo]],
    mesh_sizes: tuple[int, ...],
    weights: set[fx.Node],
    gloo: bool,
) -> ExecutedCollectives:
    """The spans and lifetimes the module docstring lists, for the plan ``chosen``."""
    position = {n: i for i, n in enumerate(order)}
    candidates, alone = planned_collectives(order, position, chosen, edge_parts, mesh_sizes, weights)
    out = ExecutedCollectives()
    buckets = group_buckets(candidates, BUCKET_BYTES)
    alone.extend(b[0] for b in buckets if len(b) == 1)
    out.buckets = [b for b in buckets if len(b) > 1]
    issues = sorted([c.at for c in alone] + [_issue(b, len(order) - 1) for b in out.buckets])
    for bucket in out.buckets:
        if bucket[0].kind == "all_gather":
            out.spans.extend(_gather_spans(bucket, position, gloo))
        else:
            _scatter(bucket, out, gloo, len(order) - 1, position, issues)
    for c in alone:
        at = min(c.at, len(order) - 1)
        scratch = backend_scratch_bytes(c.kind, c.nbytes, gloo, c.key[2])
        if scratch:
            held = () if c.part.arg_index == GRAD_EDGE else ((c.part, scratch),)
            out.spans.append(Span(at, at, scratch, COLLECTIVE, held))
        if c.part.arg_index == GRAD_EDGE:
            out.held_until[c.part.producer] = max(out.held_until.get(c.part.producer, 0), at)
    return out


def planned_collectives(
    order: list[fx.Node],
    position: dict[fx.Node, int],
    chosen: Mapping[fx.Node, Strategy],
    edge_parts: list[list[EdgeInfo]],
    mesh_sizes: tuple[int, ...],
    weights: set[fx.Node],
) -> tuple[list[PlannedCollective], list[PlannedCollective]]:
    """(bucket candidates in issue order, collectives that stay alone)."""
    candidates, alone = [], []
    param_order = {p: i for i, p in enumerate(n for n in order if n.op == "placeholder")}
    moved = list(_redistributions(chosen, edge_parts))
    mutations = sorted({position[p.consumer] for p, _, _ in moved if _relaid(p)})
    graph = order[0].graph
    grads = [p.producer for p, _, _ in moved if p.arg_index == GRAD_EDGE]
    reduced_at = {g: position[t] for t, gs in gradient_triggers(graph, grads).items() for g in gs}
    for part, src, dst in moved:
        grad = part.arg_index == GRAD_EDGE
        steps = redistribute_steps(part.shape, part.dtype.itemsize, src, dst, mesh_sizes)
        # A gradient is reduced right after its trigger runs, before the next op's inputs
        # move, and its result read at the very end.
        at = reduced_at[part.producer] + 1 if grad else position[part.consumer]
        end = len(order) + 1 if grad else _first_use(part.consumer, position, len(order))
        # No collective is merged across a mutation (bucketing.py): its window stops there.
        before = bisect.bisect_left(mutations, at)
        start = max(position[part.producer], mutations[before - 1] if before else -1)
        end = min(end, mutations[before]) if before < len(mutations) else end
        for k, step in enumerate(steps):
            merged = step.kind in BUCKETED_KINDS
            if not merged and step.kind != "all_to_all":
                continue
            # an all-to-all's step bytes are its local shard: its full tensor is n of them
            full = step.bytes * (1 if merged else step.group_size)
            # Along another dim than the first, DTensor gathers into a new buffer and cuts it
            # back into place (a cat: a use at once), and splits a reduce-scatter's input
            # and concatenates it (a cat: an input made right there).
            # A redistribution of several steps (a tensor sharded over two mesh dims) is
            # DTensor's own sequence: it reshapes its input there and reads each result at once.
            inner = _shard_dim(src if step.kind == "all_gather" else dst, step.mesh_dim) not in (0, None)
            chained = len(steps) > 1
            c = PlannedCollective(
                kind=step.kind,
                # the last: a reduced gradient, read by the step's output alone (bucketing.py)
                key=(step.kind, step.mesh_dim, step.group_size, part.dtype, grad and not chained),
                start=at - 1 if chained or (inner and step.kind == "reduce_scatter") else start,
                end=at if chained or (inner and step.kind == "all_gather") else end,
                nbytes=float(full),
                local_bytes=float(full) / step.group_size,
                order=(at, -1, param_order[part.consumer], k) if grad else (at, part.arg_index, k),
                at=at,
                part=part,
                weight=part.producer in weights,
            )
            (candidates if k == 0 and merged else alone).append(c)
    candidates.sort(key=lambda c: c.order)
    return candidates, alone


def _redistributions(
    chosen: Mapping[fx.Node, Strategy], edge_parts: list[list[EdgeInfo]]
) -> Iterator[tuple[EdgeInfo, tuple, tuple]]:
    """Each tensor the plan moves: (its edge, source placements, target placements)."""
    for parts in edge_parts:
        for part in parts:
            if part.consumer not in chosen or part.producer not in chosen:
                continue
            src = chosen[part.producer].outputs[part.output_index]
            grad = part.arg_index == GRAD_EDGE
            dst = chosen[part.consumer].outputs[0] if grad else chosen[part.consumer].inputs[part.arg_index]
            if dst is not None and src != dst:
                yield part, src, dst


def _shard_dim(placements: tuple, mesh_dim: int) -> int | None:
    p = placements[mesh_dim]
    return p.dim if isinstance(p, Shard) else None


def _relaid(part: EdgeInfo) -> bool:
    """Whether the executor copies this moved tensor back into its traced memory layout
    (``execute/layout.py``: an ``empty_permuted`` and a ``copy_``, a mutation): a
    redistribution returns a contiguous tensor, and the traced one is laid out otherwise."""
    if part.arg_index == GRAD_EDGE:
        return False
    val = part.producer.meta.get("val")
    if isinstance(val, (tuple, list)):
        val = val[part.output_index]
    if not isinstance(val, torch.Tensor) or val.ndim < 2 or val.numel() == 0:
        return False
    perm, _ = compute_elementwise_output_logical_to_physical_perm(val)
    return tuple(perm) != tuple(range(val.ndim))


def _first_use(consumer: fx.Node, position: dict[fx.Node, int], end_of_step: int) -> int:
    """Where a redistributed input is first needed: at its consumer, or past a view
    consumer at that view's first real use (the executor moves views after the wait)."""
    if not _is_alias(consumer):
        return position[consumer]
    uses = [_first_use(u, position, end_of_step) for u in consumer.users if u.op != "output"]
    return min(uses, default=end_of_step)


def _is_alias(node: fx.Node) -> bool:
    return node.op == "call_function" and (node.target in VIEW_OPS or node.target is operator.getitem)


def _gather_spans(bucket: list[PlannedCollective], position: dict[fx.Node, int], gloo: bool) -> list[Span]:
    wait = min(c.end for c in bucket)
    full = sum(c.nbytes for c in bucket)
    packed = sum(c.local_bytes for c in bucket)
    holds = tuple((c.part, c.local_bytes + c.nbytes) for c in bucket)
    spans = [Span(wait, wait, packed + full + backend_scratch_bytes("all_gather", full, gloo), COLLECTIVE, holds)]
    for c in bucket:  # its own copy, from the merged wait to the op that reads it
        kind = WEIGHT if c.weight else ACTIVATION
        spans.append(Span(wait + 1, position[c.part.consumer] - 1, c.nbytes, kind, ((c.part, c.nbytes),)))
    return [s for s in spans if s.first <= s.last]


def _issue(bucket: list[PlannedCollective], last: int) -> int:
    """Where a merged collective is issued: a gather right before its wait, a reduce-scatter
    once its last member's input exists."""
    if bucket[0].kind == "all_gather":
        return min(c.end for c in bucket)
    return min(max(c.start for c in bucket), last)


def _scatter(
    bucket: list[PlannedCollective],
    out: ExecutedCollectives,
    gloo: bool,
    last: int,
    position: dict[fx.Node, int],
    issues: list[int],
) -> None:
    issue = _issue(bucket, last)
    # Waited for before its first result's use, and before the next collective is issued.
    later = bisect.bisect_right(issues, issue)
    wait = min(min(c.end for c in bucket), issues[later] if later < len(issues) else last, last)
    full = sum(c.nbytes for c in bucket)
    out.spans.append(Span(issue, wait, full, COLLECTIVE, tuple((c.part, c.nbytes) for c in bucket), "producer"))
    # Packing frees the members' inputs before the backend copies the packed buffer:
    # its scratch comes one position later. At the step's last position the inputs,
    # as large as that scratch, stand for it.
    scratch = backend_scratch_bytes("reduce_scatter", full, gloo)
    if scratch and issue < last:
        out.spans.append(Span(issue + 1, issue + 1, scratch, COLLECTIVE))
    for c in bucket:
        out.held_until[c.part.producer] = max(out.held_until.get(c.part.producer, 0), issue)
    # The members' results are views of one output buffer: it lives as long as the
    # longest-lived of them (a parameter gradient's: to the step's end).
    used = [last if c.part.arg_index == GRAD_EDGE else _last_use(c.part.consumer, position, last) for c in bucket]
    for c, until in zip(bucket, used):
        if until < max(used):
            out.spans.append(Span(until + 1, max(used), c.local_bytes, COLLECTIVE))


def _last_use(consumer: fx.Node, position: dict[fx.Node, int], last: int) -> int:
    """Where a redistributed input is last read: at its consumer, or through a view
    consumer by that view's last user."""
    if not _is_alias(consumer):
        return position[consumer]
    users = [u for u in consumer.users if u.op != "output"]
    return max((_last_use(u, position, last) for u in users), default=last)


def bucket_bytes(buckets: list[list[PlannedCollective]]) -> list[tuple[str, float, float]]:
    """Each merged collective's (kind, full-size bytes, packed-shard bytes)."""
    return [(b[0].kind, math.fsum(c.nbytes for c in b), math.fsum(c.local_bytes for c in b)) for b in buckets]
