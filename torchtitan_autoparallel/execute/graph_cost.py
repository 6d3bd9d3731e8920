"""The cost model applied to the graph the executor actually runs.

The plan prices one collective per tensor redistribution and the planned
graph's nodes. The compiled step (``compiled.py``) runs a different program:
bucketing merges the per-tensor all-gathers and reduce-scatters into a few
large calls, and DTensor's redistributions and decompositions add nodes. A
prediction compared with a measured step must price that program: here its
collectives go through the same ``collective_time_us`` with the profile's
links, its nodes are counted for the per-node host cost, and the bytes its
nodes allocate for their outputs for the first-touch cost of fresh memory
(views, in-place ops and waits allocate nothing).
"""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass

import torch
from torch import fx

from torchtitan_autoparallel.execute.overlap import group_name
from torchtitan_autoparallel.planner.cost.cost_model import collective_time_us, mesh_dim_links
from torchtitan_autoparallel.planner.cost.profiles import HardwareProfile

# Functional collective -> cost-model kind; waits are not collectives.
_KINDS = {
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_to_all_single": "all_to_all",
}


@dataclass(frozen=True)
class GraphCost:
    nodes: int  # ATen calls the executor makes per step (getitem of a tuple is no call)
    collectives: dict[str, int]  # kind -> calls per step
    comm_us: float
    fresh_bytes: float = 0.0  # output bytes the nodes allocate per step


def graph_cost(gm: fx.GraphModule, mesh, profile: HardwareProfile) -> GraphCost:
    links = mesh_dim_links(tuple(mesh.mesh.shape), profile)
    dims = {mesh.get_group(i).group_name: i for i in range(mesh.ndim)}
    nodes, calls, comm, fresh = 0, Counter(), 0.0, 0.0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        nodes += 1
        fresh += fresh_bytes(node)
        kind = collective_kind(node)
        if kind is None:
            continue
        group = group_name(node)
        if group not in dims:
            raise ValueError(f"{node.name}: {kind} over group {group!r}, which is no dim of the mesh")
        dim = dims[group]
        calls[kind] += 1
        comm += collective_time_us(kind, charged_bytes(node, kind), mesh.size(dim), links[dim])
    return GraphCost(nodes, dict(sorted(calls.items())), comm, fresh)


# Return no alias in their schemas, yet allocate nothing new.
_NO_ALLOC = {"_unsafe_view", "wait_tensor"}


def fresh_bytes(node: fx.Node) -> float:
    """Bytes of the new buffers a node's outputs need: 0 for views, in-place ops and waits."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return 0.0
    schema = target._schema
    if schema.name.split("::")[-1] in _NO_ALLOC or any(r.alias_info is not None for r in schema.returns):
        return 0.0
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return float(sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor)))


def collective_kind(node: fx.Node) -> str | None:
    """The cost model's kind of a functional collective node; None for anything else (waits too)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "_c10d_functional":
        return None
    return _KINDS.get(target._schema.name.split("::")[-1])


def charged_bytes(node: fx.Node, kind: str) -> float:
    """As ``collective_time_us`` counts them: the gathered output, else the input buffer."""
    source = node if kind == "all_gather" else node.args[0]
    val = source.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise ValueError(f"{node.name}: {kind} whose buffer has no recorded shape (meta['val'] of {source.name})")
    return float(val.numel() * val.element_size())
