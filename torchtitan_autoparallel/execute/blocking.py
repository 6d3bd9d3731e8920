"""On gloo, a backend-built step runs its collectives one at a time.

Inductor (``backend.py``) issues each functional collective as soon as its
input is ready and waits for it only where its result is first read,
whatever order ``overlap.py`` gave the graph: the Qwen3 debug model's
FSDP 2 x TP 2 step keeps up to 5 collectives in flight at once, on both
process groups. On gloo (torch 2.14.1) that corrupts a rank's heap now and
then (``malloc(): unaligned tcache chunk detected``, SIGABRT): 3 of 4
sixty-step runs of ``experiments/gloo_inflight`` lost a rank, and none of 4
whose collectives each finish before the next op. The interpreted step never
has two in flight (``overlap.py`` allows one). NCCL is built for many in
flight, so only gloo builds are rewritten.

``make_blocking`` replaces each collective and its ``wait_tensor`` with one
call of ``autoparallel::collective_now``, an opaque op that runs the
collective and waits before it returns: the backend can neither hoist it
nor sink its wait. The values are the same; the overlap is lost (13% slower
steps in that experiment).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import fx

from torchtitan_autoparallel.execute.overlap import is_collective, is_wait

_c10d = torch.ops._c10d_functional

# functional collective -> the names of its arguments after the input
_ARGS = {
    "all_gather_into_tensor": ("group_size", "group_name"),
    "reduce_scatter_tensor": ("reduce_op", "group_size", "group_name"),
    "all_reduce": ("reduce_op", "group_name"),
}


@torch.library.custom_op("autoparallel::collective_now", mutates_args=())
def collective_now(x: torch.Tensor, kind: str, reduce_op: str, group_size: int, group_name: str) -> torch.Tensor:
    """The functional collective ``kind`` on ``x``, finished."""
    if kind == "all_gather_into_tensor":
        out = _c10d.all_gather_into_tensor.default(x, group_size, group_name)
    elif kind == "reduce_scatter_tensor":
        out = _c10d.reduce_scatter_tensor.default(x, reduce_op, group_size, group_name)
    elif kind == "all_reduce":
        out = _c10d.all_reduce.default(x, reduce_op, group_name)
    else:
        raise ValueError(f"collective_now: no collective {kind!r}; known: {', '.join(_ARGS)}")
    return _c10d.wait_tensor.default(out)


@collective_now.register_fake
def _(x: torch.Tensor, kind: str, reduce_op: str, group_size: int, group_name: str) -> torch.Tensor:
    if kind == "all_gather_into_tensor":
        return x.new_empty((x.shape[0] * group_size, *x.shape[1:]))
    if kind == "reduce_scatter_tensor":
        return x.new_empty((x.shape[0] // group_size, *x.shape[1:]))
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# Set to 1 to let the backend keep gloo collectives in flight again (to check a newer
# torch; experiments/gloo_inflight measures both ways).
ASYNC_ENV = "AUTOPARALLEL_GLOO_ASYNC"


def needs_blocking() -> bool:
    """Whether a backend build here needs blocking collectives: this process's collectives
    run on gloo (our runtime uses one backend for all groups) and ``ASYNC_ENV`` is not 1."""
    if os.environ.get(ASYNC_ENV, "0") == "1":
        return False
    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo"


def make_blocking(gm: fx.GraphModule) -> int:
    """Replace each collective of ``gm`` that only its waits read by one ``collective_now``
    call, in place; return how many were replaced. Others (a kind not listed in
    ``_ARGS``, or a buffer read before its wait) stay as they are."""
    replaced = 0
    for node in list(gm.graph.nodes):
        kind = _kind(node)
        if kind is None or node.kwargs or len(node.args) != 1 + len(_ARGS[kind]):
            continue
        if not node.users or not all(map(is_wait, node.users)):
            continue
        named = dict(zip(_ARGS[kind], node.args[1:]))
        args = (node.args[0], kind, named.get("reduce_op", ""), named.get("group_size", 0), named["group_name"])
        with gm.graph.inserting_after(node):
            now = gm.graph.call_function(torch.ops.autoparallel.collective_now.default, args)
        now.meta.update(node.meta)
        for wait in list(node.users):
            wait.replace_all_uses_with(now)
            gm.graph.erase_node(wait)
        gm.graph.erase_node(node)
        replaced += 1
    gm.graph.lint()
    gm.recompile()
    return replaced


def _kind(node: fx.Node) -> str | None:
    if not is_collective(node):
        return None
    kind = node.target._schema.name.split("::")[-1]
    return kind if kind in _ARGS else None
