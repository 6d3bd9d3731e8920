"""Shared by the compile and bucketing tests: a small step of raw functional collectives to trace,
and what a recorded step graph computes, node by node."""

from __future__ import annotations

import copy

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx


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


_ag = torch.ops._c10d_functional.all_gather_into_tensor
_rs = torch.ops._c10d_functional.reduce_scatter_tensor
_wait = torch.ops._c10d_functional.wait_tensor


def _step(group: str):
    """A forward gathering weights and an activation, then a "backward" scattering four gradients.

    w0 and w1 exist from the start and are gathered where used; ``sin(h)``
    only exists after both were used, so its gather cannot join theirs; w2
    and b exist early and are needed after it, so they can join it. ``ids``
    is int64: another bucket key. The gradients only feed the outputs, through views.
    """

    def step(x, w0, w1, w2, b, ids):
        h = torch.tanh(x @ _wait(_ag(w0, 1, group)))
        h = torch.tanh(h @ _wait(_ag(w1, 1, group)))
        act = _wait(_ag(torch.sin(h), 1, group))
        out = torch.tanh(act @ _wait(_ag(w2, 1, group)))
        tok = _wait(_ag(ids, 1, group))
        y = out + _wait(_ag(b, 1, group)) + tok.float().sum()
        grads = []
        for make in (lambda: x * y.sum(), lambda: w0 * 2, lambda: (y * 3).t().contiguous(), lambda: w2 + 1):
            # Each result is transposed at once, before the next gradient exists (as DTensor's
            # dim-1 reduce-scatters are): a view, which moves with the merged wait.
            grads.append(_wait(_rs(make(), "sum", 1, group)).t())
        return (y, *grads)

    return step


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(4, 8), (8, 8), (8, 6), (6, 3), (3,)]
    return [*(torch.randn(s, generator=g) for s in shapes), torch.randint(0, 9, (5, 2), generator=g)]


def _trace(group: str, fn=_step) -> fx.GraphModule:
    return make_fx(fn(group), tracing_mode="real")(*_inputs())
