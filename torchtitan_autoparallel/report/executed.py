"""The collectives the executor issues, read from the step graph it runs.

The plan lists one collective per tensor redistribution. The compiled step
runs fewer: ``execute/bucketing.py`` merges its per-tensor all-gathers and
reduce-scatters into buckets. This module lists the collectives of a local
step graph (``PlannedStep.local_graph``, bucketed by the executor itself, or
any traced graph through ``bucketed_collectives``, which applies the
executor's own ``bucket_collectives`` to a copy) by kind, mesh dim and size,
priced as ``execute/graph_cost.py`` prices them, so the report cannot list
other collectives than the executor runs.

A plan-only run (``COMM_MODE=fake_backend``) has no compiled step: there
``traced_step_collectives`` builds the executor's step on fake tensors (no
memory, no compute; the fake process group sends nothing), traces it as the
executor's compile does and buckets it with the executor's pass.
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_autoparallel.execute.bucketing import bucket_collectives
from torchtitan_autoparallel.execute.compiled import trace_local_graph
from torchtitan_autoparallel.execute.graph_cost import charged_bytes, collective_kind
from torchtitan_autoparallel.execute.overlap import group_name
from torchtitan_autoparallel.execute.step import FullValues, build_executable
from torchtitan_autoparallel.planner.cost.cost_model import collective_time_us, mesh_dim_links
from torchtitan_autoparallel.planner.cost.profiles import HardwareProfile
from torchtitan_autoparallel.planner.plan.api import ExecutablePlan


@dataclass(frozen=True)
class ExecutedCollective:
    """Collectives of one kind, mesh dim and size that one executed step issues."""

    kind: str
    mesh_dim: str
    bytes: float  # the full buffer, as the cost model counts it (gathered output, unreduced input)
    us: float  # predicted time of one
    count: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class MeshGroups:
    """Each mesh dim's process group name, name and size: what names a collective's dim."""

    groups: dict[str, int]  # process group name -> mesh dim index
    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @classmethod
    def of(cls, mesh) -> MeshGroups:
        """From a ``DeviceMesh`` with named dims."""
        groups = {mesh.get_group(i).group_name: i for i in range(mesh.ndim)}
        return cls(groups, tuple(mesh.mesh_dim_names), tuple(mesh.mesh.shape))


def executed_collectives(gm: fx.GraphModule, mesh: MeshGroups, profile: HardwareProfile) -> list[ExecutedCollective]:
    """The collective calls of ``gm`` as it stands, grouped by (kind, mesh dim, bytes), dearest first."""
    links = mesh_dim_links(mesh.sizes, profile)
    counts: Counter = Counter()
    for node in gm.graph.nodes:
        kind = collective_kind(node)
        if kind is None:
            continue
        dim = mesh.groups.get(group_name(node))
        if dim is None:
            raise ValueError(f"{node.name}: {kind} over group {group_name(node)!r}, which is no dim of the mesh")
        counts[(kind, dim, charged_bytes(node, kind))] += 1
    found = [
        ExecutedCollective(kind, mesh.names[dim], nbytes, collective_time_us(kind, nbytes, mesh.sizes[dim], links[dim]), n)
        for (kind, dim, nbytes), n in counts.items()
    ]
    return sorted(found, key=lambda c: (-c.us * c.count, c.kind, c.mesh_dim))


def bucketed_collectives(
    gm: fx.GraphModule, mesh: MeshGroups, profile: HardwareProfile, bucket_bytes: int | None = None
) -> list[ExecutedCollective]:
    """What ``gm`` issues once the executor's bucketing has merged it (on a copy: ``gm`` is left as it is)."""
    merged = copy.deepcopy(gm)
    if bucket_bytes is None:
        bucket_collectives(merged)
    else:
        bucket_collectives(merged, bucket_bytes)
    return executed_collectives(merged, mesh, profile)


def traced_step_collectives(
    executable: ExecutablePlan, mesh: DeviceMesh, profile: HardwareProfile, bucket: bool = True
) -> list[ExecutedCollective]:
    """What the executor's compiled step would issue (bucketed when ``bucket``, as
    ``autoparallel.bucket_collectives`` asks), traced on fake tensors."""
    gm = fake_step_graph(executable, mesh)
    if bucket:
        bucket_collectives(gm)
    return executed_collectives(gm, MeshGroups.of(mesh), profile)


def fake_step_graph(executable: ExecutablePlan, mesh: DeviceMesh) -> fx.GraphModule:
    """The executor's local step graph, its parameters and batch fake: the trace's shapes only."""
    traced = executable.traced
    with FakeTensorMode(allow_non_fake_inputs=True):
        full = FullValues(
            {fqn: _fake(node) for fqn, node in traced.params.items()},
            {fqn: _fake(node) for fqn, node in traced.buffers.items()},
        )
        step = build_executable(executable, mesh, full)
        tokens, labels = step.distribute_batch(_fake(traced.tokens), _fake(traced.labels))
        return trace_local_graph(step, tokens, labels)


def _fake(node: fx.Node) -> torch.Tensor:
    val = node.meta["val"]
    return torch.zeros(val.shape, dtype=val.dtype)


def from_dicts(rows: list[dict[str, Any]]) -> list[ExecutedCollective]:
    """plan.json's ``executed_collectives`` back as records."""
    return [ExecutedCollective(**row) for row in rows]
