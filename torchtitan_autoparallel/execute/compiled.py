"""The interpreted step re-traced into one graph over local tensors (design.md section 5).

``make_fx`` in real mode runs ``PlannedStep.interpret`` once with every input
unwrapped to its local shard and wrapped again inside the traced function, so
the recording holds the local kernels and the functional collectives DTensor
issued (``_c10d_functional.all_gather_into_tensor`` etc.), nothing of DTensor
itself. Every rank records its own graph: rank-dependent choices (which rank
keeps a Replicate -> Partial(sum) value) are baked in as they should be.

Running that graph skips DTensor's per-op dispatch and our per-node checks,
which is most of the interpreter's time on small shapes; the values are
bitwise those of the interpreter (checked by the tests through the losses).
"""

from __future__ import annotations

import copy
import logging
import time
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import fx
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, make_fx

from torchtitan_autoparallel.execute.interpreter import StepOutput

if TYPE_CHECKING:
    from torchtitan_autoparallel.execute.step import PlannedStep

_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d")
PROGRESS_EVERY_S = 30.0
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
log = logging.getLogger("torchtitan_autoparallel.execute")


class CompileProgress:
    """Logs how far the compile's interpreted step has got, every ``every_s`` seconds: on a
    large model or a crowded host it runs for minutes with nothing else to show."""

    def __init__(self, total: int, every_s: float) -> None:
        self.total = total
        self.every_s = every_s
        self.done = 0
        self.start = self.last = time.perf_counter()

    def __call__(self) -> None:
        self.done += 1
        now = time.perf_counter()
        if now - self.last >= self.every_s:
            self.last = now
            log.info("compiling the step: node %d of %d interpreted (%.0f s)", self.done, self.total, now - self.start)


def trace_local_graph(planned: PlannedStep, tokens: DTensor, labels: DTensor) -> fx.GraphModule:
    """Record one interpreted step as (local inputs) -> (local loss, local grads)."""
    templates = planned.inputs(tokens, labels)
    fqns = list(planned.traced.params)
    total = len(planned.traced.graph.graph.nodes)
    log.info("compiling the step: one step interpreted over DTensors (%d graph nodes) and traced "
             "into a local-tensor graph; the first step waits for it", total)
    progress = CompileProgress(total, PROGRESS_EVERY_S)

    def local_step(*locals_: torch.Tensor):
        wrapped = [_like(t, local) for t, local in zip(templates, locals_)]
        out = planned.interpret(wrapped, progress)
        return (out.loss.to_local(), *(out.grads[f].to_local() for f in fqns))

    # make_fx records every value's metadata through a fake mode, and DTensor's sharding
    # propagation runs in one; with none ambient each call makes its own, and a new
    # FakeTensorMode captures the Python stack: half the trace's time on the debug
    # model. One shared mode gives the same graph and metadata.
    shared = TracingContext(FakeTensorMode(allow_fallback_kernels=True))
    with torch.no_grad(), tracing(shared), sharding_propagation_for_trace():
        return make_fx(local_step, tracing_mode="real")(*(t.to_local() for t in templates))


@contextmanager
def sharding_propagation_for_trace():
    """DTensor's sharding propagation while we trace: cached, and kept out of the recording.

    Under any tracer DTensor skips its sharding-propagation cache (its keys are
    unsafe with symbolic shapes) and re-derives every op's sharding, scoring
    each full-mesh strategy: about a third of the compile on the debug model,
    repeated for ops the interpreter has just asked the cached propagator
    about. This trace runs in real mode, every shape a concrete int, so a
    cached answer is the answer.

    A propagation's own tensor work is bookkeeping, not the step: pricing a
    ``_StridedShard`` sizes its local shards with ``arange``/``split`` index
    tensors, and make_fx recorded those dead ops into the graph (11,159 nodes
    instead of 956 on a 2-block strided plan, a 3x longer compile, and every
    step ran them: experiments/startup/compile_trace.md). With proxy tracing
    off during propagation they run eagerly and are not recorded.
    """
    prop = DTensor._op_dispatcher.sharding_propagator
    cached = getattr(prop, "propagate_op_sharding", None)
    if not callable(cached) or "propagate_op_sharding_non_cached" in vars(prop):
        yield  # another torch layout, or already patched: trace as torch does
        return

    def untraced(*args, **kwargs):
        with disable_proxy_modes_tracing():
            return cached(*args, **kwargs)

    # instance attributes shadow the method and replace the cache object; the cache
    # itself keeps the method it bound when it was made, so no call loops back here
    prop.propagate_op_sharding_non_cached = untraced
    prop.propagate_op_sharding = untraced
    try:
        yield
    finally:
        del prop.propagate_op_sharding_non_cached
        prop.propagate_op_sharding = cached


def run_local_graph(planned: PlannedStep, tokens: DTensor, labels: DTensor, loss_only: bool = False) -> StepOutput:
    """Run ``planned.local_graph`` (``loss_graph`` with ``loss_only``: no gradients) and
    wrap its results with the planned placements."""
    assert planned.local_graph is not None
    inputs = planned.inputs(tokens, labels)
    if loss_only:
        run = planned.runner(planned.loss_graph(), "loss-only graph (validation)")
    else:
        run = planned.runner(planned.local_graph, "planned step")
    with torch.no_grad():
        outs = run(*(t.to_local() for t in inputs))
    loss_node = planned.traced.loss
    loss_val = loss_node.meta["val"]
    loss = DTensor.from_local(
        outs[0],
        planned.mesh,
        planned.chosen[loss_node].outputs[0],
        run_check=False,
        shape=loss_val.shape,
        stride=loss_val.stride(),
    )
    if loss_only:
        return StepOutput(loss, {})
    grads = {
        fqn: DTensor.from_local(local, planned.mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
        for (fqn, p), local in zip(planned.params.items(), outs[1:])
    }
    return StepOutput(loss, grads)


def loss_only_graph(
    gm: fx.GraphModule, agree: Callable[[frozenset[int]], frozenset[int]] | None = None
) -> fx.GraphModule:
    """A copy of a local step graph that returns the loss alone, without what only the
    gradients need: the forward, for validation.

    fx's own dead-code pass keeps every ``wait_tensor`` (it counts as a side
    effect), and with it the backward's collectives and everything they read; a
    wait whose result nothing reads is dropped here, and so its collective.

    The ranks' graphs differ in rank-dependent details (which rank keeps a
    value, which zeroes it), so a collective could be dead on one rank and live
    on another, and the ranks would then wait on each other forever. ``agree``
    (``union_over_ranks``) returns the union over the ranks of the collectives
    (by position) each keeps; those are kept everywhere, until no rank needs
    another.
    """
    agree = agree or (lambda kept: kept)
    union = agree(_prune(gm, frozenset())[1])
    while True:
        pruned, kept = _prune(gm, union)
        grown = agree(kept)
        if grown == union:  # the same on every rank: all stop in the same round
            return pruned
        union = grown


def union_over_ranks(kept: frozenset[int]) -> frozenset[int]:
    """The collectives (by position) any rank keeps."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return kept
    everyone: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(kept))
    return frozenset(i for theirs in everyone for i in theirs or ())


def _prune(gm: fx.GraphModule, keep: frozenset[int]) -> tuple[fx.GraphModule, frozenset[int]]:
    """``gm`` returning its loss alone, less every node that does not lead to it or to
    the collectives at positions ``keep``; also the positions of the collectives left."""
    loss_gm = copy.deepcopy(gm)
    graph = loss_gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    output.args = ((output.args[0][0],),)
    collectives = [n for n in graph.nodes if _is_collective(n)]
    kept = {collectives[i] for i in keep}
    erased: set[fx.Node] = set()
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function" or node.users or node in kept:
            continue
        if _is_wait(node):
            if node.args and node.args[0] in kept:
                continue
        elif node.is_impure():
            continue
        graph.erase_node(node)
        erased.add(node)
    graph.lint()
    loss_gm.recompile()
    return loss_gm, frozenset(i for i, n in enumerate(collectives) if n not in erased)


def _is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and "wait_tensor" in str(node.target)


def _is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and str(node.target).startswith(_COLLECTIVE_NAMESPACES) and not _is_wait(node)


def graph_collectives(gm: fx.GraphModule) -> Counter:
    """Kind -> count of the collective calls a local graph makes (waits are not collectives)."""

    counts: Counter = Counter()
    for node in gm.graph.nodes:
        if not _is_collective(node):
            continue
        name = str(node.target)
        counts[next((k for k in KINDS if k in name), name)] += 1
    return counts


def _like(template: DTensor, local: torch.Tensor) -> DTensor:
    return DTensor.from_local(
        local, template.device_mesh, template.placements, run_check=False, shape=template.shape, stride=template.stride()
    )
