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

from collections import Counter

import torch
from torch import fx
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.fx.experimental.proxy_tensor import make_fx

from torchtitan_autoparallel.execute.step import PlannedStep, StepOutput

_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d")


def trace_local_graph(planned: PlannedStep, tokens: DTensor, labels: DTensor) -> fx.GraphModule:
    """Record one interpreted step as (local inputs) -> (local loss, local grads)."""
    templates = planned.inputs(tokens, labels)
    fqns = list(planned.traced.params)

    def local_step(*locals_: torch.Tensor):
        wrapped = [_like(t, local) for t, local in zip(templates, locals_)]
        out = planned.interpret(wrapped)
        return (out.loss.to_local(), *(out.grads[f].to_local() for f in fqns))

    # make_fx records every value's metadata through a fake mode, and DTensor's sharding
    # propagation runs in one; with none ambient each call makes its own, and a new
    # FakeTensorMode captures the Python stack: half the trace's time on the debug
    # model. One shared mode gives the same graph and metadata.
    shared = TracingContext(FakeTensorMode(allow_fallback_kernels=True))
    with torch.no_grad(), tracing(shared):
        return make_fx(local_step, tracing_mode="real")(*(t.to_local() for t in templates))


def run_local_graph(planned: PlannedStep, tokens: DTensor, labels: DTensor) -> StepOutput:
    """Run ``planned.local_graph`` and wrap its results with the planned placements."""
    assert planned.local_graph is not None
    inputs = planned.inputs(tokens, labels)
    with torch.no_grad():
        outs = planned.local_graph(*(t.to_local() for t in inputs))
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
    grads = {
        fqn: DTensor.from_local(local, planned.mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
        for (fqn, p), local in zip(planned.params.items(), outs[1:])
    }
    return StepOutput(loss, grads)


def graph_collectives(gm: fx.GraphModule) -> Counter:
    """Kind -> count of the collective calls a local graph makes (waits are not collectives)."""
    from torchtitan_autoparallel.execute.audit import KINDS

    counts: Counter = Counter()
    for node in gm.graph.nodes:
        name = str(node.target)
        if node.op != "call_function" or not name.startswith(_COLLECTIVE_NAMESPACES) or "wait" in name:
            continue
        counts[next((k for k in KINDS if k in name), name)] += 1
    return counts


def _like(template: DTensor, local: torch.Tensor) -> DTensor:
    return DTensor.from_local(
        local, template.device_mesh, template.placements, run_check=False, shape=template.shape, stride=template.stride()
    )
