"""An ``fx.GraphModule`` as plain picklable data, and back, node for node.

Pickling a ``GraphModule`` directly keeps only its generated code and
re-traces that code on load: node names change, ``meta`` is lost, and calls
without tensor inputs (``full``, ``arange``) are run at load time and turn
into constants. The passes and the cost read-back after ``compile`` need the
graph as it was, so this writes every node (op, target, arguments, name) and
the shape of its value, and rebuilds exactly that graph.

Targets are stored by name: ``torch.ops`` overloads as ``ns.op.overload``,
other callables (``operator.getitem``) by module and qualified name.
``meta["val"]`` comes back on the meta device: shapes, strides and dtypes only.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch._ops import OpOverload

_ATOMS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)


@dataclass(frozen=True)
class _Ref:
    """An argument that is the value of the node at this position."""

    index: int


@dataclass(frozen=True)
class _Target:
    kind: str  # "op" (torch.ops overload), "callable" (module + qualname) or "name" (a string target)
    path: str


@dataclass
class PackedGraph:
    nodes: list[dict[str, Any]]
    attributes: dict[str, torch.Tensor]  # get_attr targets: constants the trace recorded


def pack(gm: fx.GraphModule) -> PackedGraph:
    index: dict[fx.Node, int] = {}
    nodes = []
    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        nodes.append(
            {
                "op": node.op,
                "name": node.name,
                "target": _target_ref(node.target),
                "args": _encode(node.args, index),
                "kwargs": _encode(node.kwargs, index),
                "val": _shape_only(node.meta.get("val")),
            }
        )
    attributes = {n.target: getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    return PackedGraph(nodes, attributes)


def unpack(packed: PackedGraph) -> fx.GraphModule:
    graph = fx.Graph()
    made: list[fx.Node] = []
    for entry in packed.nodes:
        node = graph.create_node(
            entry["op"],
            _resolve_target(entry["target"]),
            _decode(entry["args"], made),
            _decode(entry["kwargs"], made),
            name=entry["name"],
        )
        if entry["val"] is not None:
            node.meta["val"] = entry["val"]
        made.append(node)
    root = nn.Module()
    for name, value in packed.attributes.items():
        setattr(root, name, value)
    return fx.GraphModule(root, graph)


def _target_ref(target: Any) -> _Target:
    if isinstance(target, str):
        return _Target("name", target)
    if isinstance(target, OpOverload):
        return _Target("op", str(target))  # "aten.mm.default"
    module, qualname = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    if not module or not qualname or "<" in qualname:
        raise TypeError(f"graph target {target!r} cannot be stored by name")
    return _Target("callable", f"{module}:{qualname}")


def _resolve_target(ref: _Target) -> Any:
    if ref.kind == "name":
        return ref.path
    if ref.kind == "op":
        obj: Any = torch.ops
        for part in ref.path.split("."):
            obj = getattr(obj, part)
        return obj
    module, qualname = ref.path.split(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _encode(value: Any, index: dict[fx.Node, int]) -> Any:
    def leaf(v: Any) -> Any:
        if isinstance(v, fx.Node):
            return _Ref(index[v])
        if isinstance(v, _ATOMS):
            return v
        raise TypeError(f"graph argument {v!r} of type {type(v).__name__} cannot be stored")

    return _map(value, leaf)


def _decode(value: Any, made: list[fx.Node]) -> Any:
    return _map(value, lambda v: made[v.index] if isinstance(v, _Ref) else v)


def _map(value: Any, leaf) -> Any:
    """``leaf`` applied inside the containers an fx argument can be built of."""
    if isinstance(value, (list, tuple)):
        items = [_map(v, leaf) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return {k: _map(v, leaf) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(_map(value.start, leaf), _map(value.stop, leaf), _map(value.step, leaf))
    return leaf(value)


def _shape_only(val: Any) -> Any:
    """Values as meta tensors (shape, stride, dtype); what is not a tensor is dropped."""
    if isinstance(val, torch.Tensor):
        return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
    if isinstance(val, (list, tuple)):
        return type(val)(_shape_only(v) for v in val) if isinstance(val, tuple) else [_shape_only(v) for v in val]
    return None
