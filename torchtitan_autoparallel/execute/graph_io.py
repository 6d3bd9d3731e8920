"""An ``fx.GraphModule`` as plain JSON-able data, and back, node for node.

Pickling a ``GraphModule`` directly keeps only its generated code and
re-traces that code on load: node names change, ``meta`` is lost, and calls
without tensor inputs (``full``, ``arange``) are run at load time and turn
into constants. The passes and the cost read-back after ``compile`` need the
graph as it was, so this writes every node (op, target, arguments, name) and
the shape of its value, and rebuilds exactly that graph.

Everything but the recorded constants is JSON (``PackedGraph.nodes``), so a
stored graph loads without unpickling anything: a cache folder someone else
can write must not be able to run code. For the same reason targets are
names from a closed set: ``torch.ops`` overloads (``aten.mm.default``) and
the few Python callables a traced step calls (``operator.getitem``); a name
outside it is refused. ``meta["val"]`` comes back on the meta device: shapes,
strides and dtypes only.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch._ops import OpOverload

# Python callables a traced step may call, by the name pack() writes.
_CALLABLES = {"_operator:getitem": operator.getitem}
# torch objects stored by name: tag -> their type
_TORCH_ATOMS = {"dtype": torch.dtype, "memory_format": torch.memory_format, "layout": torch.layout}


@dataclass
class PackedGraph:
    nodes: list[dict[str, Any]]  # JSON-able: op, name, target, args, kwargs, val
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
    """The graph ``pack`` wrote; raises ValueError (or TypeError) for anything it did not write."""
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
            node.meta["val"] = _meta_value(entry["val"])
        made.append(node)
    root = nn.Module()
    for name, value in packed.attributes.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"graph constant {name!r} is a {type(value).__name__}, not a tensor")
        setattr(root, name, value)
    return fx.GraphModule(root, graph)


def _target_ref(target: Any) -> dict[str, str]:
    if isinstance(target, str):
        return {"name": target}
    if isinstance(target, OpOverload):
        return {"op": str(target)}  # "aten.mm.default"
    module, qualname = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    path = f"{module}:{qualname}"
    if _CALLABLES.get(path) is not target:
        raise TypeError(f"graph target {target!r} cannot be stored by name")
    return {"callable": path}


def _resolve_target(ref: dict[str, str]) -> Any:
    (kind, path), = ref.items()
    if kind == "name":
        return path
    if kind == "callable":
        if path not in _CALLABLES:
            raise ValueError(f"graph target {path!r} is not one a traced step calls")
        return _CALLABLES[path]
    if kind != "op" or any(part.startswith("__") for part in path.split(".")):
        raise ValueError(f"graph target {kind} {path!r} is not a torch op")
    obj: Any = torch.ops
    for part in path.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, OpOverload):
        raise ValueError(f"graph target {path!r} is not a torch op overload")
    return obj


def _encode(value: Any, index: dict[fx.Node, int]) -> Any:
    """fx arguments as JSON: containers and torch atoms tagged, nodes by position."""
    if isinstance(value, fx.Node):
        return {"ref": index[value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_encode(v, index) for v in value]
    if isinstance(value, tuple):
        return {"tuple": [_encode(v, index) for v in value]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: _encode(v, index) for k, v in value.items()}}
    if isinstance(value, slice):
        return {"slice": [_encode(v, index) for v in (value.start, value.stop, value.step)]}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    for tag, kind in _TORCH_ATOMS.items():
        if isinstance(value, kind):
            return {tag: str(value).removeprefix("torch.")}
    raise TypeError(f"graph argument {value!r} of type {type(value).__name__} cannot be stored")


def _decode(value: Any, made: list[fx.Node]) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_decode(v, made) for v in value]
    if not isinstance(value, dict) or len(value) != 1:
        raise ValueError(f"graph argument {value!r} is not one pack() writes")
    (tag, inner), = value.items()
    if tag == "ref":
        return made[inner]
    if tag == "tuple":
        return tuple(_decode(v, made) for v in inner)
    if tag == "dict":
        return {k: _decode(v, made) for k, v in inner.items()}
    if tag == "slice":
        return slice(*(_decode(v, made) for v in inner))
    if tag == "device":
        return torch.device(inner)
    if tag in _TORCH_ATOMS:
        return _torch_atom(tag, inner)
    raise ValueError(f"graph argument tag {tag!r} is not one pack() writes")


def _torch_atom(tag: str, name: str) -> Any:
    atom = getattr(torch, name, None)
    if not isinstance(atom, _TORCH_ATOMS[tag]):
        raise ValueError(f"{name!r} is not a torch {tag}")
    return atom


def _shape_only(val: Any) -> Any:
    """Values as their shape, stride and dtype; what is not a tensor is dropped."""
    if isinstance(val, torch.Tensor):
        return {"shape": list(val.shape), "stride": list(val.stride()), "dtype": str(val.dtype).removeprefix("torch.")}
    if isinstance(val, list):
        return [_shape_only(v) for v in val]
    if isinstance(val, tuple):
        return {"tuple": [_shape_only(v) for v in val]}
    return None


def _meta_value(val: Any) -> Any:
    """What ``_shape_only`` wrote, as meta tensors."""
    if val is None:
        return None
    if isinstance(val, list):
        return [_meta_value(v) for v in val]
    if "tuple" in val:
        return tuple(_meta_value(v) for v in val["tuple"])
    return torch.empty_strided(val["shape"], val["stride"], dtype=_torch_atom("dtype", val["dtype"]), device="meta")
