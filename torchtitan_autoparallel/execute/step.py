"""``build_executable``: a solved plan + real process groups -> a runnable training step.

The parameters are DTensors placed as planned, created from the full unsharded
tensors (``FullValues``): either every rank holds the same full init and keeps
its own slice (nothing is sent), or one rank holds it and scatters each tensor
in turn; either way their values equal an unsharded init.
``PlannedStep.step`` runs the joint forward+backward graph through
``PlannedInterpreter`` and returns the loss and the gradients, each gradient
moved to its parameter's placement as the backward produces it (the plan's gradient edges: this is
where FSDP's reduce-scatter or DDP's all-reduce happen).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from torchtitan_autoparallel.execute import bucketing
from torchtitan_autoparallel.execute.backend import BackendGraph
from torchtitan_autoparallel.execute.bucketing import BucketStats
from torchtitan_autoparallel.execute.compiled import loss_only_graph, run_local_graph, trace_local_graph, union_over_ranks
from torchtitan_autoparallel.execute.interpreter import ExecutionModes, PlanExecutionError, PlannedInterpreter, StepOutput
from torchtitan_autoparallel.execute.kernels import check_logsumexp_users
from torchtitan_autoparallel.execute.overlap import OverlapStats, schedule_overlap
from torchtitan_autoparallel.execute.placements import placements_text
from torchtitan_autoparallel.planner.plan.api import ExecutablePlan
from torchtitan_autoparallel.planner.strategies.placement import Placements
from torchtitan_autoparallel.planner.strategies.strategy import Strategy
from torchtitan_autoparallel.planner.trace.trace import TracedStep


@dataclass
class PlannedStep:
    traced: TracedStep
    mesh: DeviceMesh
    chosen: dict[fx.Node, Strategy]
    params: dict[str, nn.Parameter]  # each wraps a DTensor placed as planned
    buffers: dict[str, DTensor]
    tokens_placements: Placements
    labels_placements: Placements
    modes: ExecutionModes = field(default_factory=ExecutionModes)
    # CPU-only kernels through their portable stand-ins even on CPU (tests; see kernels.py).
    portable_kernels: bool = False
    # Set by ``compile``: the step as a graph over local tensors and functional collectives.
    local_graph: fx.GraphModule | None = None
    # ``compile`` then reorders that graph so collectives overlap compute (overlap.py).
    overlap_execution: bool = False
    overlap_stats: OverlapStats | None = None  # what that reordering moved
    # ``compile`` first merges the graph's all-gathers and reduce-scatters into buckets (bucketing.py).
    bucket_collectives: bool = False
    bucket_stats: BucketStats | None = None  # calls before and after merging
    # (local_graph, its loss-only copy), made by ``loss_graph``
    _loss_graph: tuple[fx.GraphModule, fx.GraphModule] | None = field(default=None, repr=False)
    # ``[compile]``: the torch.compile backend that builds those graphs (backend.py); None runs them as fx
    backend: str | None = None
    _built: dict[fx.GraphModule, BackendGraph] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.mesh.device_type != "cpu" or self.portable_kernels:
            check_logsumexp_users(self.traced.graph.graph)

    # ------------------------------------------------------------ running

    def step(self, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict[str, DTensor]]:
        """One forward+backward on the GLOBAL batch (the same tensors on every rank).

        Returns the loss as a plain tensor equal on every rank and the
        gradients as DTensors placed like their parameters.
        """
        out = self.run_graph(*self.distribute_batch(tokens, labels))
        return _report_loss(out.loss), out.grads

    def step_local(
        self, local_tokens: torch.Tensor, local_labels: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, DTensor]]:
        """As ``step``, from this rank's slice of the batch (what a sharded dataloader yields)."""
        out = self.run_graph(*self._batch_from_local(local_tokens, local_labels))
        return _report_loss(out.loss), out.grads

    def loss_local(self, local_tokens: torch.Tensor, local_labels: torch.Tensor) -> torch.Tensor:
        """The loss alone, as ``step_local`` reports it (validation). Compiled, the graph
        runs without its backward (``compiled.loss_only_graph``); interpreted, the
        whole step runs and its gradients are dropped."""
        if self.local_graph is None:
            return self.step_local(local_tokens, local_labels)[0]

        tokens, labels = self._batch_from_local(local_tokens, local_labels)
        return _report_loss(run_local_graph(self, tokens, labels, loss_only=True).loss)

    def loss_graph(self) -> fx.GraphModule:
        """``local_graph`` without the backward; derived once, on first use, by every rank
        together (they agree on the collectives it keeps)."""

        if self._loss_graph is None or self._loss_graph[0] is not self.local_graph:
            self._loss_graph = (self.local_graph, loss_only_graph(self.local_graph, union_over_ranks))
        return self._loss_graph[1]

    def runner(self, graph: fx.GraphModule, what: str) -> Callable:
        """What runs ``graph`` (``local_graph`` or its loss-only copy): ``backend``'s build
        of it, made on its first run, or the graph itself."""
        if self.backend is None:
            return graph
        if graph not in self._built:
            self._built[graph] = BackendGraph(graph, self.backend, what)
        return self._built[graph]

    def run_graph(self, tokens: DTensor, labels: DTensor) -> StepOutput:
        """One forward+backward; every collective it runs is one the plan priced.

        Runs the local graph of ``compile`` when there is one, else interprets
        the joint graph over DTensors.
        """
        if self.local_graph is not None:

            return run_local_graph(self, tokens, labels)
        return self.interpret(self.inputs(tokens, labels))

    def inputs(self, tokens: DTensor, labels: DTensor) -> list[DTensor]:
        """The joint graph's placeholders in order: parameters, buffers, tokens, labels."""
        t = self.traced
        return [*(self.params[f] for f in t.params), *(self.buffers[b] for b in t.buffers), tokens, labels]

    def interpret(self, inputs: list[DTensor], progress: Callable[[], None] | None = None) -> StepOutput:
        """Interpret the joint graph over DTensors placed as planned (``inputs`` as ``self.inputs``);
        ``progress`` is called once per graph node."""
        t = self.traced
        # Each gradient is reduced to its parameter's placement as the backward produces it.
        gradients = {t.grads[fqn]: self.chosen[param].outputs[0] for fqn, param in t.params.items() if fqn in t.grads}
        interpreter = PlannedInterpreter(
            t.graph, self.chosen, self.mesh, self.modes, self.portable_kernels, progress=progress, gradients=gradients
        )
        with torch.no_grad():
            flat = _flatten(interpreter.run(*inputs, enable_io_processing=False))
        return StepOutput(flat[0], dict(zip(t.params, flat[1:])))

    def compile(self, tokens: torch.Tensor, labels: torch.Tensor) -> None:
        """Re-trace the interpretation into a graph over local tensors; later steps run it.

        Costs one extra step (the trace runs it, collectives included, on the
        given GLOBAL batch; parameters are not changed). See ``compiled.py``;
        with ``bucket_collectives`` its collectives are then merged by
        ``bucketing.py``, and with ``overlap_execution`` the graph is then
        scheduled by ``overlap.py``.
        """
        self._compile(*self.distribute_batch(tokens, labels))

    def compile_local(self, local_tokens: torch.Tensor, local_labels: torch.Tensor) -> None:
        """As ``compile``, from this rank's slice of the batch (the trainer's dataloader)."""
        self._compile(*self._batch_from_local(local_tokens, local_labels))

    def _compile(self, tokens: DTensor, labels: DTensor) -> None:

        graph = trace_local_graph(self, tokens, labels)
        # Every rank runs the same deterministic passes. Bucketing goes first, so that the
        # scheduler overlaps the merged collectives; the ranks check they merged alike.
        self.bucket_stats = bucketing.bucket_collectives(graph) if self.bucket_collectives else None
        if self.bucket_stats is not None:
            bucketing.check_same_buckets(self.bucket_stats)
        self.overlap_stats = schedule_overlap(graph) if self.overlap_execution else None
        self.local_graph = graph

    def distribute_batch(self, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[DTensor, DTensor]:
        """Global batch -> DTensors in the pinned input placements (each rank keeps its slice)."""
        _check_shape("tokens", tokens, self.traced.tokens)
        _check_shape("labels", labels, self.traced.labels)
        return (
            distribute_tensor(tokens, self.mesh, self.tokens_placements, src_data_rank=None),
            distribute_tensor(labels, self.mesh, self.labels_placements, src_data_rank=None),
        )

    # ------------------------------------------------------------ module-like access

    def parameters(self) -> Iterator[nn.Parameter]:
        return iter(self.params.values())

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return iter(self.params.items())

    def bind_to(self, model: nn.Module) -> nn.Module:
        """Make ``model`` (same architecture, e.g. on the meta device) hold the planned tensors.

        Its parameters become these DTensor Parameters (the same objects the
        step reads and the optimizer updates), its buffers these DTensors,
        so the model serves ``build_optimizer``, checkpointing
        (``get_state_dict`` and the model's own state-dict hooks) and
        summaries. Run the training step with ``step``/``step_local``, never
        ``model(tokens)``: that would run DTensor's own choices, not the plan.
        """
        for fqn in self.params:
            parent, name = _parent(model, fqn)
            if not isinstance(getattr(parent, name, None), nn.Parameter):
                raise KeyError(f"{fqn}: not a parameter of {type(model).__name__}")
        # A tied weight (Qwen3's embedding and lm_head) is traced under its first
        # name only; every alias must get the planned tensor too, or the model
        # would keep a stale meta tensor there (in its state dict, its optimizer).
        first_name = {id(p): fqn for fqn, p in model.named_parameters()}
        for fqn, param in list(model.named_parameters(remove_duplicate=False)):
            planned = self.params.get(first_name[id(param)])
            if planned is not None:
                parent, name = _parent(model, fqn)
                parent.register_parameter(name, planned)
        for fqn, buf in self.buffers.items():
            parent, name = _parent(model, fqn)
            persistent = name not in parent._non_persistent_buffers_set
            parent.register_buffer(name, buf, persistent=persistent)
        return model

    def data_parallel_coords(self) -> tuple[int, int]:
        """(rank, degree) of this rank's slice of the batch, for a sharded dataloader.

        The batch is Shard(0) on the data-parallel mesh dims; DTensor orders
        nested shards of one tensor dim row-major over those mesh dims.
        """
        rank, degree = 0, 1
        for i, p in enumerate(self.tokens_placements):
            if isinstance(p, Shard) and p.dim == 0:
                size = self.mesh.size(i)
                rank, degree = rank * size + self.mesh.get_local_rank(i), degree * size
        return rank, degree

    def local_ops(self) -> dict[str, int]:
        """Ops that ran on local shards (DTensor would have chosen otherwise), by name."""
        return self.modes.local_ops()

    # ------------------------------------------------------------ helpers

    def _batch_from_local(self, local_tokens: torch.Tensor, local_labels: torch.Tensor) -> tuple[DTensor, DTensor]:
        """This rank's slice of the batch as the DTensors the step takes."""
        return (
            self._from_local(local_tokens, self.traced.tokens, self.tokens_placements),
            self._from_local(local_labels, self.traced.labels, self.labels_placements),
        )

    def _from_local(self, local: torch.Tensor, node: fx.Node, placements: Placements) -> DTensor:
        val = node.meta["val"]
        local = local.to(self.mesh.device_type)
        return DTensor.from_local(local, self.mesh, placements, run_check=False, shape=val.shape, stride=val.stride())


@dataclass(frozen=True)
class FullValues:
    """The unsharded values the placed parameters and buffers start from.

    ``src_rank`` None: every rank holds the same values and keeps its own slice,
    so nothing is sent. ``src_rank`` 0: only global rank 0 holds them, which must
    be the mesh's first rank (DTensor scatters from coordinate 0 of each mesh dim);
    the other ranks give same-shaped placeholders, and each tensor is scattered
    in turn.
    """

    params: Mapping[str, torch.Tensor]
    buffers: Mapping[str, torch.Tensor]
    src_rank: int | None = None

    @classmethod
    def of(cls, module: nn.Module) -> FullValues:
        """Every rank's own full module (the same on every rank)."""
        return cls(dict(module.named_parameters()), dict(module.named_buffers()))


def build_executable(
    executable: ExecutablePlan, mesh: DeviceMesh, full: FullValues, *, portable_kernels: bool = False
) -> PlannedStep:
    """Place the full parameters as planned and return the step that runs the plan."""
    if full.src_rank not in (None, 0) or (full.src_rank == 0 and int(mesh.mesh.flatten()[0]) != 0):
        raise ValueError(
            f"src_rank {full.src_rank} on mesh {mesh.mesh.tolist()}: values are scattered from global "
            "rank 0 only, which must be the mesh's first rank (DTensor scatters from coordinate 0)"
        )
    traced, chosen = executable.traced, executable.chosen
    params = {
        fqn: nn.Parameter(_place(fqn, full.params, node, chosen, mesh, full.src_rank))
        for fqn, node in traced.params.items()
    }
    buffers = {
        fqn: _place(fqn, full.buffers, node, chosen, mesh, full.src_rank) for fqn, node in traced.buffers.items()
    }
    return PlannedStep(
        traced=traced,
        mesh=mesh,
        chosen=chosen,
        params=params,
        buffers=buffers,
        tokens_placements=chosen[traced.tokens].outputs[0],
        labels_placements=chosen[traced.labels].outputs[0],
        portable_kernels=portable_kernels,
    )


def _place(
    fqn: str,
    full: Mapping[str, torch.Tensor],
    node: fx.Node,
    chosen: dict[fx.Node, Strategy],
    mesh: DeviceMesh,
    src_rank: int | None,
) -> DTensor:
    if fqn not in full:
        raise KeyError(f"no full value given for {fqn!r} (the trace has it; got {len(full)} tensors)")
    tensor = full[fqn].detach()
    val = node.meta["val"]
    if tuple(tensor.shape) != tuple(val.shape) or tensor.dtype != val.dtype:
        raise ValueError(
            f"{fqn}: given {tuple(tensor.shape)} {tensor.dtype}, traced {tuple(val.shape)} {val.dtype}"
        )
    placements = chosen[node].outputs[0]
    if placements is None:
        raise PlanExecutionError(f"{fqn}: the plan gives it no placement")
    # src_data_rank=None: every rank already holds the same full value and keeps
    # its slice. 0: DTensor scatters mesh dim by mesh dim from coordinate 0, so
    # the mesh's first rank (global rank 0, checked above) reaches every rank.
    return distribute_tensor(tensor, mesh, placements, src_data_rank=src_rank)


def _parent(model: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    prefix, _, name = fqn.rpartition(".")
    return (model.get_submodule(prefix) if prefix else model), name


def _report_loss(loss: DTensor) -> torch.Tensor:
    """The loss every rank can log: a Partial or sharded loss is reduced here.

    This reduction (one scalar all-reduce when the loss is Partial) is outside
    the planned graph: the plan has no edge from the loss to a consumer.
    """
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def _flatten(x) -> list:
    if isinstance(x, (list, tuple)):
        return [y for item in x for y in _flatten(item)]
    return [x]


def _check_shape(what: str, value: torch.Tensor, node: fx.Node) -> None:
    want = tuple(node.meta["val"].shape)
    if tuple(value.shape) != want:
        raise ValueError(f"{what}: got shape {tuple(value.shape)}, the plan was made for {want}")


__all__ = ["PlannedStep", "StepOutput", "build_executable", "placements_text"]
