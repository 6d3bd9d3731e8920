"""Shared by the compile tests: what a recorded step graph computes, node by node."""

from __future__ import annotations

import copy

import torch
from torch import fx


def live_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` without the nodes nothing reads (fx's dead-code pass; waits stay)."""
    gm = copy.deepcopy(gm)
    gm.graph.eliminate_dead_code()
    return gm


def node_signatures(gm: fx.GraphModule) -> list[tuple[str, str, str]]:
    """(target, arguments by position, shape) of each node: equal lists, the same computation."""
    index: dict = {}
    out = []
    for i, n in enumerate(gm.graph.nodes):
        index[n] = i
        args = fx.node.map_arg((n.args, dict(n.kwargs)), lambda m: f"%{index[m]}")
        val = n.meta.get("val")
        out.append((str(n.target), repr(args), str(tuple(val.shape)) if isinstance(val, torch.Tensor) else ""))
    return out
