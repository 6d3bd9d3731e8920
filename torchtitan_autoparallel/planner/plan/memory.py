"""Predicted peak activation memory per device of a planned training step.

An estimate from the traced graph alone, walked once in graph order with the
chosen placements:

* each op's outputs are allocated when it runs, at their local (per-device)
  size, and freed after their last consumer; views and ``getitem`` alias
  what they look into, and keep it alive;
* an input the op needs in another placement than its producer gave is a
  transient buffer, alive only while that op runs, unless the op is a view:
  then the view shows the redistributed buffer and keeps it alive as long as
  its own users (FSDP's gathered ``w.t()``, used by the forward matmul and
  again by the backward's, lives from one to the other);
* each parameter gradient, once produced, is kept until the end of the step
  at its parameter's placement (the reduced gradient the optimizer reads);
  the unreduced gradient dies after its last use like any activation;
* parameters, buffers, the input batch and the optimizer state are not
  part of the walk: ``whole_peak`` adds the parameters and the optimizer's
  state, which live through the whole step; nor are the allocator's
  fragmentation or kernel workspaces counted.

So the walk's figure is what the planned program itself keeps live at its
worst moment, which is what changes between two plans of one model. ``predicted_peak``
also says what is live then, grouped (op, dtype, shape, placements), largest
first, so a plan that does not fit says why.
"""

from __future__ import annotations

import math
import operator
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
from torch import fx

from torchtitan_autoparallel.planner.plan.collective_memory import (
    COLLECTIVE,
    WEIGHT,
    ExecutedCollectives,
    Span,
    bucket_bytes,
    executed_collectives,
)
from torchtitan_autoparallel.planner.problem.build import GRAD_EDGE, EdgeInfo
from torchtitan_autoparallel.planner.strategies.placement import label, local_shape
from torchtitan_autoparallel.planner.strategies.rules import VIEW_OPS
from torchtitan_autoparallel.planner.strategies.strategy import Strategy
from torchtitan_autoparallel.planner.trace.trace import TracedStep


def local_bytes(val, placements, mesh_sizes: tuple[int, ...]) -> float:
    shape = tuple(val.shape) if placements is None else local_shape(val.shape, placements, mesh_sizes)
    return float(math.prod(shape) * val.dtype.itemsize)


def output_bytes(node: fx.Node, strategy: Strategy | None, mesh_sizes: tuple[int, ...]) -> float:
    val = node.meta.get("val")
    vals = list(val) if isinstance(val, (tuple, list)) else [val]
    outs = strategy.outputs if strategy is not None else (None,) * len(vals)
    return sum(
        local_bytes(v, p, mesh_sizes) for v, p in zip(vals, outs) if v is not None and hasattr(v, "dtype")
    )


def part_bytes(part: EdgeInfo, placements, mesh_sizes: tuple[int, ...]) -> float:  # noqa: ANN001
    """Per-device bytes of the tensor ``part`` carries, in ``placements`` (None: none)."""
    if placements is None:
        return 0.0
    return float(math.prod(local_shape(part.shape, placements, mesh_sizes)) * part.dtype.itemsize)


def is_alias(node: fx.Node) -> bool:
    return node.op == "call_function" and (node.target in VIEW_OPS or node.target is operator.getitem)


TOP_PARTS = 8  # groups of live tensors a peak lists; the rest are summed as one
# Both optimizers a job can name (AdamW, Adam) keep two moments per parameter
# (exp_avg and exp_avg_sq), each the size and placement of the parameter.
OPTIMIZER_STATE_COPIES = 2


@dataclass
class PeakPart:
    """Tensors live at the peak that look alike, or a kind of bytes counted apart."""

    what: str  # op, dtype, global shape, placements: "mm bfloat16 [524288, 14336] S(0)S(0)"
    count: int
    bytes: float  # all of them together


@dataclass
class Peak:
    bytes: float
    at: str  # the graph node running at the peak
    parts: list[PeakPart]  # largest first; they add up to ``bytes``
    # of ``bytes``: values computed from the parameters alone (cast or gathered weights
    # kept for the backward), which a smaller batch does not shrink
    weight_copy_bytes: float = 0.0
    gradient_bytes: float = 0.0  # of ``bytes``: reduced gradients kept to the step's end
    buffer_bytes: float = 0.0  # of ``bytes``: inputs redistributed for the op at the peak
    # of ``bytes``: the executed collectives' own buffers (``collective_memory.py``): bucket
    # inputs packed and outputs gathered, the backend's scratch
    collective_bytes: float = 0.0
    # each merged collective's (kind, full-size bytes, packed-shard bytes), in issue order
    buckets: list[tuple[str, float, float]] = field(default_factory=list)


def whole_peak(peak: Peak, param_bytes: float) -> dict[str, float]:
    """The per-device peak of a training step by kind of bytes: ``peak`` (the walk's)
    plus the parameters (``param_bytes`` per device) and the optimizer's state."""
    activations = (
        peak.bytes - peak.weight_copy_bytes - peak.gradient_bytes - peak.buffer_bytes - peak.collective_bytes
    )
    return {
        "parameters": param_bytes,
        "optimizer_state": OPTIMIZER_STATE_COPIES * param_bytes,
        "gradients": peak.gradient_bytes,
        "activations": activations,
        "weight_copies": peak.weight_copy_bytes,
        "redistribution_buffers": peak.buffer_bytes,
        "collective_buffers": peak.collective_bytes,
    }


@dataclass
class Timeline:
    order: list[fx.Node]
    position: dict[fx.Node, int]
    size: dict[fx.Node, float]  # allocation -> bytes
    last_use: dict[fx.Node, int]
    transient: dict[int, float]
    kept: dict[int, float]
    root: dict[fx.Node, fx.Node] = field(default_factory=dict)  # alias -> the allocation it shows
    spans: list[Span] = field(default_factory=list)  # the executed collectives' (collective_memory.py)


def predicted_peak(
    traced: TracedStep,
    chosen: Mapping[fx.Node, Strategy],
    edge_parts: list[list[EdgeInfo]],
    mesh_sizes: tuple[int, ...],
    gloo: bool = False,
) -> Peak:
    """Largest per-device total of live step-produced tensors (see the module docstring),
    where in the step it is reached, and what is live there. ``gloo``: the collectives run
    on gloo, which adds its scratch buffers (``buckets.backend_scratch_bytes``)."""
    t, executed = walk(traced, chosen, edge_parts, mesh_sizes, gloo)
    totals = live_totals(t)
    at = int(np.argmax(totals)) if len(totals) else 0
    peak = float(totals[at]) if len(totals) else 0.0
    copies = _weight_copies(traced)
    weight_bytes = sum(nbytes for owner, nbytes in live_at(t, at) if owner in copies)
    weight_bytes += sum(s.bytes for s in _spans_at(t, at) if s.kind == WEIGHT)
    grads = sum(b for i, b in t.kept.items() if i <= at)
    collective = sum(s.bytes for s in _spans_at(t, at) if s.kind == COLLECTIVE)
    parts = _parts_at(t, at, chosen)
    return Peak(
        peak, t.order[at].name, parts, weight_bytes, grads, t.transient.get(at, 0.0), collective,
        bucket_bytes(executed.buckets),
    )  # fmt: skip


def walk(
    traced: TracedStep,
    chosen: Mapping[fx.Node, Strategy],
    edge_parts: list[list[EdgeInfo]],
    mesh_sizes: tuple[int, ...],
    gloo: bool = False,
) -> tuple[Timeline, ExecutedCollectives]:
    """The planned step's allocations and lifetimes, the executed collectives' holds and
    buffers included: what ``predicted_peak`` scans and ``peak_rows`` reads."""
    t = _timeline(traced, chosen, edge_parts, mesh_sizes)
    copies = _weight_copies(traced)
    executed = executed_collectives(t.order, chosen, edge_parts, mesh_sizes, copies | set(traced.params.values()), gloo)
    _hold(t, executed.held_until)
    t.spans = executed.spans
    return t, executed


def live_totals(t: Timeline) -> np.ndarray:
    """Bytes live at each graph position, the running op's redistributed inputs included."""
    frees: dict[int, float] = defaultdict(float)
    for owner, nbytes in t.size.items():
        frees[t.last_use[owner]] += nbytes
    opens: dict[int, float] = defaultdict(float)
    for span in t.spans:
        opens[span.first] += span.bytes
        frees[span.last] += span.bytes
    totals = np.zeros(len(t.order))
    live = 0.0
    for i, node in enumerate(t.order):
        live += t.size.get(node, 0.0) + t.kept.get(i, 0.0) + opens.get(i, 0.0)
        totals[i] = live + t.transient.get(i, 0.0)
        live -= frees.get(i, 0.0)
    return totals


def _hold(t: Timeline, held_until: dict[fx.Node, int]) -> None:
    """Keep the allocations behind ``held_until``'s tensors live to at least there."""
    for node, until in held_until.items():
        owner = t.root.get(node, node)
        if owner in t.last_use:
            t.last_use[owner] = max(t.last_use[owner], until)


def _spans_at(t: Timeline, at: int) -> list[Span]:
    return [s for s in t.spans if s.first <= at <= s.last]


def live_at(t: Timeline, at: int) -> Iterator[tuple[fx.Node, float]]:
    """The allocations live at graph position ``at``, with their bytes."""
    for owner, nbytes in t.size.items():
        if t.position[owner] <= at <= t.last_use[owner] and nbytes > 0:
            yield owner, nbytes


def _weight_copies(traced: TracedStep) -> set[fx.Node]:
    """Ops whose every input is a parameter or another such op: the casts, views and
    transposes of weights that a plan may gather and keep for the backward."""
    derived = set(traced.params.values())
    for node in traced.graph.graph.nodes:
        inputs = node.all_input_nodes
        if node.op == "call_function" and inputs and all(a in derived for a in inputs):
            derived.add(node)
    return derived - set(traced.params.values())


def _timeline(
    traced: TracedStep,
    chosen: Mapping[fx.Node, Strategy],
    edge_parts: list[list[EdgeInfo]],
    mesh_sizes: tuple[int, ...],
) -> Timeline:
    order = list(traced.graph.graph.nodes)
    position = {n: i for i, n in enumerate(order)}
    moved = _redistributed(chosen, edge_parts, mesh_sizes)
    root: dict[fx.Node, fx.Node] = {}  # alias -> the allocation it shows
    size: dict[fx.Node, float] = {}
    last_use: dict[fx.Node, int] = {}
    transient: dict[int, float] = defaultdict(float)
    for i, node in enumerate(order):
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        buffers = dict(moved.get(node, {}))
        if is_alias(node) and isinstance(node.args[0], fx.Node) and 0 not in buffers:
            root[node] = root.get(node.args[0], node.args[0])
        elif is_alias(node) and 0 in buffers:  # a view of its redistributed input: it owns that buffer
            root[node], size[node], last_use[node] = node, buffers.pop(0), i
        else:
            root[node] = node
            size[node] = output_bytes(node, chosen.get(node), mesh_sizes)
            last_use[node] = i
        transient[i] += sum(buffers.values())
        for arg in node.all_input_nodes:
            if arg in root:
                owner = root[arg]
                last_use[owner] = max(last_use.get(owner, i), i)
    kept = _gradient_bytes(traced, chosen, mesh_sizes, position)
    return Timeline(order, position, size, last_use, transient, kept, root)


def _parts_at(t: Timeline, at: int, chosen: Mapping[fx.Node, Strategy]) -> list[PeakPart]:
    groups: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for owner, nbytes in live_at(t, at):
        group = groups[_describe(owner, chosen.get(owner))]
        group[0] += 1
        group[1] += nbytes
    parts = sorted((PeakPart(w, int(c), b) for w, (c, b) in groups.items()), key=lambda p: -p.bytes)
    rest = parts[TOP_PARTS:]
    parts = parts[:TOP_PARTS]
    if rest:
        parts.append(PeakPart("other tensors", sum(p.count for p in rest), sum(p.bytes for p in rest)))
    grads = sum(b for i, b in t.kept.items() if i <= at)
    if grads:
        parts.append(PeakPart("reduced gradients, kept to the step's end", sum(1 for i in t.kept if i <= at), grads))
    if t.transient.get(at):
        parts.append(PeakPart("inputs redistributed for the op at the peak", 1, t.transient[at]))
    spans = _spans_at(t, at)
    collective = [s.bytes for s in spans if s.kind == COLLECTIVE]
    if collective:
        parts.append(PeakPart("collective buffers: buckets packed and gathered, backend scratch", len(collective), sum(collective)))
    early = [s.bytes for s in spans if s.kind != COLLECTIVE]
    if early:
        parts.append(PeakPart("copies gathered by a bucket before their op", len(early), sum(early)))
    return parts


def _describe(node: fx.Node, strategy: Strategy | None) -> str:
    val = node.meta.get("val")
    first = val[0] if isinstance(val, (tuple, list)) and val else val
    op = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    if not hasattr(first, "dtype"):
        return op
    dtype = str(first.dtype).removeprefix("torch.")
    where = label(strategy.outputs[0]) if strategy is not None and strategy.outputs[0] else ""
    return f"{op} {dtype} {list(first.shape)} {where}".rstrip()


def _redistributed(
    chosen: Mapping[fx.Node, Strategy],
    edge_parts: list[list[EdgeInfo]],
    mesh_sizes: tuple[int, ...],
) -> dict[fx.Node, dict[int, float]]:
    """consumer -> tensor-argument index -> bytes of that input after its redistribution,
    for the inputs the plan redistributes (gradient edges left out: ``_gradient_bytes``)."""
    out: dict[fx.Node, dict[int, float]] = defaultdict(dict)
    for parts in edge_parts:
        for part in parts:
            if part.arg_index == GRAD_EDGE or part.consumer not in chosen or part.producer not in chosen:
                continue
            src = chosen[part.producer].outputs[part.output_index]
            dst = chosen[part.consumer].inputs[part.arg_index]
            if dst is None or src == dst:
                continue
            nbytes = part_bytes(part, dst, mesh_sizes)
            args = out[part.consumer]
            args[part.arg_index] = args.get(part.arg_index, 0.0) + float(nbytes)
    return out


def _gradient_bytes(
    traced: TracedStep,
    chosen: Mapping[fx.Node, Strategy],
    mesh_sizes: tuple[int, ...],
    position: dict[fx.Node, int],
) -> dict[int, float]:
    """Graph position -> bytes of reduced gradients that start living there."""
    out: dict[int, float] = {}
    for fqn, grad in traced.grads.items():
        param = traced.params[fqn]
        placements = chosen[param].outputs[0] if param in chosen else None
        at = position[grad]
        out[at] = out.get(at, 0.0) + local_bytes(grad.meta["val"], placements, mesh_sizes)
    return out
