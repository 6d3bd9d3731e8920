"""Run the joint graph over DTensors, performing exactly the planned redistributions.

For every op node, in graph order:

1. each tensor argument is redistributed to the placement the node's chosen
   strategy requires (these are the plan's collectives, one per planned edge);
2. the op runs in one of two ways, decided once per node on the first step:

   * ``dtensor``: DTensor's own sharding propagation, asked with the
     redistributed arguments, needs no further redistribution and yields the
     planned output placements. Then the op runs as an ordinary DTensor op
     (DTensor knows how to rewrite shape arguments of views, expands, etc.).
   * ``local``: DTensor would pick another strategy (or has none: CPU flash
     attention, the batch-sharded mean loss of ``planner/strategies/rules.py``). Then the
     op runs on the local shards and its outputs are wrapped with the planned
     output placements. This is sound exactly when the planned strategy is a
     "local kernel" rule, which every rule source except torch's full-mesh
     view functions is; those views always take the ``dtensor`` path. The
     local output shapes are checked against the planned global shapes, so a
     local run of an op with global-shape arguments fails loudly.

3. outputs are checked against the planned placements;
4. a parameter's gradient is moved to its parameter's placement (FSDP's
   reduce-scatter, DDP's all-reduce) as soon as the backward has no further
   use of it, so the unreduced gradients do not pile up until the step's end.

Nodes outside the problem (none carry tensors today) run as plain FX nodes.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Partial
from torch.fx.node import map_arg
from torch.utils._pytree import tree_flatten, tree_map

from torchtitan_autoparallel.execute.kernels import retarget_device, substitute
from torchtitan_autoparallel.execute.layout import match_layout
from torchtitan_autoparallel.execute.placements import placements_text, same_placements
from torchtitan_autoparallel.execute.redistribute import redistribute_to
from torchtitan_autoparallel.planner.plan.buckets import gradient_triggers
from torchtitan_autoparallel.planner.strategies.placement import Placements, local_shape
from torchtitan_autoparallel.planner.strategies.strategy import Strategy

DTENSOR = "dtensor"
LOCAL = "local"
FACTORY = "factory"  # no tensor input: computed whole on every rank, then sliced


class PlanExecutionError(RuntimeError):
    """The graph cannot run as planned (a placement DTensor cannot honour, a bad local shape)."""


@dataclass
class StepOutput:
    """What one interpretation of the graph yields, before the loss is reduced for reporting."""

    loss: DTensor  # placed as planned (e.g. Partial(avg) over the data-parallel axes)
    grads: dict[str, DTensor]  # each in its parameter's planned placement


@dataclass
class ExecutionModes:
    """How each node ran; decided on the first step and reused afterwards."""

    by_node: dict[fx.Node, str] = field(default_factory=dict)
    # Why a node runs locally: DTensor's choice, or the error it raised.
    reasons: dict[fx.Node, str] = field(default_factory=dict)

    def local_ops(self) -> dict[str, int]:
        """Op name -> how many nodes of it run on local shards."""
        counts: dict[str, int] = {}
        for node, mode in self.by_node.items():
            if mode == LOCAL:
                counts[str(node.target)] = counts.get(str(node.target), 0) + 1
        return dict(sorted(counts.items()))


class PlannedInterpreter(fx.Interpreter):
    """An ``fx.Interpreter`` whose values are DTensors placed as the plan says."""

    def __init__(
        self,
        gm: fx.GraphModule,
        chosen: dict[fx.Node, Strategy],
        mesh: DeviceMesh,
        modes: ExecutionModes,
        portable_kernels: bool = False,
        progress: Callable[[], None] | None = None,
        gradients: Mapping[fx.Node, Placements] | None = None,
    ) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.chosen = chosen
        self.mesh = mesh
        self.modes = modes
        # Run CPU-only kernels through their portable stand-ins even on CPU (for tests).
        self.portable_kernels = portable_kernels
        self.progress = progress  # called once per node (the compile's progress log)
        # gradient node -> its parameter's placement; reduced after the node that triggers it
        self.gradients = dict(gradients or {})
        self.reduce_after = gradient_triggers(gm.graph, self.gradients)

    def run_node(self, n: fx.Node) -> Any:
        out = self._run_node(n)
        for grad in self.reduce_after.get(n, ()):
            value = out if grad is n else self.env[grad]
            reduced = redistribute_to(value, self.mesh, self.gradients[grad])
            if grad is n:
                out = reduced
            else:
                self.env[grad] = reduced  # the unreduced value is freed here
        return out

    def _run_node(self, n: fx.Node) -> Any:
        if self.progress is not None:
            self.progress()
        if n.op != "call_function" or n.target is operator.getitem or n not in self.chosen:
            return super().run_node(n)
        strategy = self.chosen[n]
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        kwargs = retarget_device(kwargs, _shard_device(args))
        args, kwargs = self._redistribute_inputs(n, args, kwargs, strategy.inputs)
        mode = self.modes.by_node.get(n)
        if mode is None:
            mode = self._decide(n, args, kwargs, strategy)
            self.modes.by_node[n] = mode
        if mode == DTENSOR:
            out = n.target(*args, **kwargs)
        elif mode == LOCAL:
            out = self._run_local(n, args, kwargs, strategy)
        else:
            out = self._run_factory(n, args, kwargs, strategy)
        _check_outputs(n, out, strategy.outputs)
        return out

    # ------------------------------------------------------------ inputs

    def _redistribute_inputs(
        self, n: fx.Node, args: tuple, kwargs: dict, wanted: tuple[Placements | None, ...]
    ) -> tuple[tuple, dict]:
        """Move each tensor argument to the placement the chosen strategy requires.

        Tensor arguments are counted in the order ``strategy.py`` lists them
        (flattened args, then kwargs), so position j gets ``wanted[j]``.
        """
        positions = _tensor_positions(n)
        flat, spec = tree_flatten((args, kwargs))
        if len(positions) != len(wanted):
            raise PlanExecutionError(
                f"{n.name} ({n.target}): {len(positions)} tensor arguments, strategy has {len(wanted)}"
            )
        for (pos, producer), target in zip(positions, wanted):
            value = flat[pos]
            if target is None or not isinstance(value, DTensor):
                continue
            if not same_placements(value.placements, target, value.ndim):
                moved = redistribute_to(value, self.mesh, target)
                flat[pos] = match_layout(moved, producer.meta["val"])
        args, kwargs = spec.unflatten(flat)
        return tuple(args), dict(kwargs)

    # ------------------------------------------------------------ modes

    def _decide(self, n: fx.Node, args: tuple, kwargs: dict, strategy: Strategy) -> str:
        if not any(isinstance(a, DTensor) for a in tree_flatten((args, kwargs))[0]):
            return FACTORY
        if self._substitute(n) is not None:
            self.modes.reasons[n] = "CPU-only kernel: runs its portable stand-in on local shards"
            return LOCAL
        agrees, reason = _dtensor_agrees(n.target, args, kwargs, strategy.outputs)
        if not agrees:
            self.modes.reasons[n] = reason
        return DTENSOR if agrees else LOCAL

    def _run_local(self, n: fx.Node, args: tuple, kwargs: dict, strategy: Strategy) -> Any:
        largs, lkwargs = tree_map(_to_local, (args, kwargs))
        out = (self._substitute(n) or n.target)(*largs, **lkwargs)
        return _wrap_outputs(n, out, strategy.outputs, self.mesh)

    def _substitute(self, n: fx.Node):
        return substitute(n.target, self.mesh.device_type, force=self.portable_kernels)

    def _run_factory(self, n: fx.Node, args: tuple, kwargs: dict, strategy: Strategy) -> Any:
        out = n.target(*args, **kwargs)
        return _distribute_outputs(n, out, strategy.outputs, self.mesh)


# ---------------------------------------------------------------- helpers


def _tensor_positions(n: fx.Node) -> list[tuple[int, fx.Node]]:
    """(flat position in ``tree_flatten((args, kwargs))``, node) of each tensor-valued argument."""
    marked = map_arg((n.args, dict(n.kwargs)), _Mark)
    flat, _ = tree_flatten(marked)
    return [
        (i, v.node)
        for i, v in enumerate(flat)
        if isinstance(v, _Mark) and isinstance(v.node.meta.get("val"), torch.Tensor)
    ]


class _Mark:
    """A pytree leaf standing for a node argument while counting positions."""

    def __init__(self, node: fx.Node) -> None:
        self.node = node


def _shard_device(args: tuple) -> torch.device | None:
    for a in tree_flatten(args)[0]:
        if isinstance(a, DTensor):
            return a._local_tensor.device
    return None


def _to_local(x: Any) -> Any:
    return x.to_local() if isinstance(x, DTensor) else x


def _dtensor_agrees(op, args: tuple, kwargs: dict, planned: tuple[Placements | None, ...]) -> tuple[bool, str]:
    """Would DTensor run ``op`` on these placements without redistributing, into ``planned``?"""
    dispatcher = DTensor._op_dispatcher
    try:
        info = dispatcher.unwrap_to_op_info(op, args, kwargs)
        result = dispatcher.sharding_propagator.propagate_op_sharding(info.schema)
    except Exception as e:  # no rule at all (e.g. CPU flash attention), or a rule that raises
        return False, f"DTensor has no strategy: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if result.needs_redistribute and _moves_tensors(info.schema, result.redistribute_schema):
        return False, "DTensor would redistribute its inputs"
    specs = result.output_spec if isinstance(result.output_spec, (tuple, list)) else (result.output_spec,)
    if len(specs) != len(planned):
        return False, f"DTensor gives {len(specs)} outputs, plan {len(planned)}"
    for spec, want in zip(specs, planned):
        if want is None or spec is None:
            continue
        if not same_placements(spec.placements, want, len(spec.shape)):
            return False, f"DTensor picks {placements_text(spec.placements)}, plan {placements_text(want)}"
    return True, ""


def _moves_tensors(schema, redistribute_schema) -> bool:
    """True when DTensor's reshard schema changes a tensor's placement.

    ``needs_redistribute`` is also set when DTensor only rewrites non-tensor
    arguments (a view's global shape becomes the local one); that is no
    collective, and the op may run as a DTensor op.
    """
    if redistribute_schema is None:
        return True
    before, after = _specs(schema), _specs(redistribute_schema)
    if len(before) != len(after):
        return True
    return any(b.placements != a.placements for b, a in zip(before, after))


def _specs(schema) -> list:
    flat, _ = tree_flatten((schema.args_schema, schema.kwargs_schema))
    return [s for s in flat if isinstance(s, DTensorSpec)]


def _output_vals(n: fx.Node) -> list:
    val = n.meta["val"]
    return [val] if isinstance(val, torch.Tensor) else list(val)


def _wrap_outputs(n: fx.Node, out: Any, planned: tuple[Placements | None, ...], mesh: DeviceMesh) -> Any:
    """Local results -> DTensors with the planned placements and the traced global shapes."""
    vals = _output_vals(n)
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    wrapped = []
    for local, val, placements in zip(outs, vals, planned):
        if not isinstance(local, torch.Tensor) or placements is None:
            wrapped.append(local)
            continue
        # The planner only plans even shards, so every rank's shard has this shape.
        expected = local_shape(tuple(val.shape), placements, tuple(mesh.mesh.shape))
        if tuple(local.shape) != tuple(expected):
            raise PlanExecutionError(
                f"{n.name} ({n.target}) ran on local shards into shape {tuple(local.shape)}, "
                f"but {placements_text(placements)} of {tuple(val.shape)} needs {tuple(expected)}"
            )
        wrapped.append(
            DTensor.from_local(local, mesh, placements, run_check=False, shape=val.shape, stride=val.stride())
        )
    return wrapped[0] if isinstance(out, torch.Tensor) else type(out)(wrapped)


def _distribute_outputs(n: fx.Node, out: Any, planned: tuple[Placements | None, ...], mesh: DeviceMesh) -> Any:
    """Whole results every rank computed alike -> this rank's slice of the planned placement."""

    def place(t: Any, placements: Placements | None) -> Any:
        if not isinstance(t, torch.Tensor) or placements is None:
            return t
        if any(isinstance(p, Partial) for p in placements):
            raise PlanExecutionError(f"{n.name} ({n.target}): a factory op cannot start Partial")
        return distribute_tensor(t, mesh, placements, src_data_rank=None)

    if isinstance(out, torch.Tensor):
        return place(out, planned[0])
    return type(out)(place(t, p) for t, p in zip(out, planned))


def _check_outputs(n: fx.Node, out: Any, planned: tuple[Placements | None, ...]) -> None:
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    for value, want in zip(outs, planned):
        if want is None or not isinstance(value, torch.Tensor):
            continue
        if not isinstance(value, DTensor):
            raise PlanExecutionError(f"{n.name} ({n.target}) produced a plain tensor, plan {placements_text(want)}")
        if not same_placements(value.placements, want, value.ndim):
            raise PlanExecutionError(
                f"{n.name} ({n.target}) produced {placements_text(value.placements)}, "
                f"plan {placements_text(want)}"
            )
