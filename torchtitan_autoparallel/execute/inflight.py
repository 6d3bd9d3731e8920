"""On gloo, a backend-built step runs one collective of a group at a time.

Inductor (``backend.py``) issues each functional collective as soon as its
input is ready and waits for it only where its result is first read,
whatever order ``overlap.py`` gave the graph: the Qwen3 debug model's
FSDP 2 x TP 2 step keeps up to 5 collectives in flight at once, on both
process groups. A gloo group (torch 2.14.1) runs its collectives on two
worker threads, and two of one group running at once corrupt a rank's heap
now and then (``malloc(): unaligned tcache chunk detected``, SIGABRT, or
SIGSEGV; a core dump caught both threads of one group inside
``gloo::allgather``; measured by ``experiments/gloo_inflight``). NCCL is
built for many in flight, so only gloo builds are handled, in one of three
ways (``MODE_ENV``):

* ``chained`` (the default): each collective becomes an opaque
  ``autoparallel::collective_after`` that takes the previous collective's
  waited result as an extra input, so the backend cannot issue it before
  that wait; its own ``wait_tensor`` stays where the graph has it, and the
  compute between the two overlaps it, as in the interpreted step. The op
  issues on a private copy of its input, held until the next collective:
  the backend, which sees an op that has returned, may reuse the input's
  buffer before the wait, while gloo still reads it.
* ``blocking``: each collective and its wait become one
  ``autoparallel::collective_now``, which returns finished: no overlap.
* ``queued``: nothing is rewritten. The trainer creates the gloo groups of
  a planned model with one worker thread each
  (``cpu_compat.one_gloo_worker_thread``), so a group runs its collectives
  one at a time in issue order, still overlapping compute and each other
  across groups, as Inductor scheduled them. Where a gloo group has more
  than one thread (made elsewhere, or a torch without the hook), a build
  falls back to ``chained``. Safe, but not measured faster than
  ``chained`` (``experiments/gloo_inflight``).

In ``chained`` and ``blocking``, a collective that is the step's last, or whose wait comes
after the next collective in the graph, is always made blocking, so one
stays the most in flight: ``planner/buckets.IN_FLIGHT``, the bound the
memory prediction assumes (checked at import). ``async`` leaves Inductor's own schedule on
torch's two-thread groups (to check a newer torch).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import fx

from torchtitan_autoparallel.errors import ConfigError
from torchtitan_autoparallel.execute.overlap import is_collective, is_wait
from torchtitan_autoparallel.planner.plan.buckets import IN_FLIGHT

_c10d = torch.ops._c10d_functional

# functional collective -> the names of its arguments after the input
_ARGS = {
    "all_gather_into_tensor": ("group_size", "group_name"),
    "reduce_scatter_tensor": ("reduce_op", "group_size", "group_name"),
    "all_reduce": ("reduce_op", "group_name"),
}

# The rewrite below keeps exactly one collective in flight; the planner's policy must agree.
if IN_FLIGHT != 1:
    raise ImportError(f"execute/inflight.py keeps one collective in flight, planner/buckets.IN_FLIGHT is {IN_FLIGHT}")

MODE_ENV = "AUTOPARALLEL_GLOO_COLLECTIVES"
MODES = ("chained", "queued", "blocking", "async")

# the private input copy of the chained collective in flight (see the module docstring)
_IN_FLIGHT: list[torch.Tensor] = []


@torch.library.custom_op("autoparallel::collective_after", mutates_args=())
def collective_after(
    x: torch.Tensor, after: list[torch.Tensor], kind: str, reduce_op: str, group_size: int, group_name: str
) -> torch.Tensor:
    """Issue the functional collective ``kind`` on a copy of ``x``; its ``wait_tensor``
    comes later. ``after`` only orders the call."""
    copy = x.clone()  # all_reduce copies its input itself, but one rule is simpler
    _IN_FLIGHT[:] = [copy]
    return _issue(copy, kind, reduce_op, group_size, group_name)


@torch.library.custom_op("autoparallel::collective_now", mutates_args=())
def collective_now(
    x: torch.Tensor, after: list[torch.Tensor], kind: str, reduce_op: str, group_size: int, group_name: str
) -> torch.Tensor:
    """The functional collective ``kind`` on ``x``, finished."""
    _IN_FLIGHT.clear()  # ``after`` holds the previous one's waited result: it is done
    return _c10d.wait_tensor.default(_issue(x, kind, reduce_op, group_size, group_name))


def _issue(x: torch.Tensor, kind: str, reduce_op: str, group_size: int, group_name: str) -> torch.Tensor:
    if kind == "all_gather_into_tensor":
        return _c10d.all_gather_into_tensor.default(x, group_size, group_name)
    if kind == "reduce_scatter_tensor":
        return _c10d.reduce_scatter_tensor.default(x, reduce_op, group_size, group_name)
    if kind == "all_reduce":
        return _c10d.all_reduce.default(x, reduce_op, group_name)
    raise ValueError(f"no collective {kind!r}; known: {', '.join(_ARGS)}")


@collective_after.register_fake
@collective_now.register_fake
def _(x: torch.Tensor, after, kind: str, reduce_op: str, group_size: int, group_name: str) -> torch.Tensor:
    if kind == "all_gather_into_tensor":
        return x.new_empty((x.shape[0] * group_size, *x.shape[1:]))
    if kind == "reduce_scatter_tensor":
        return x.new_empty((x.shape[0] // group_size, *x.shape[1:]))
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def mode_from_env() -> str:
    """``MODE_ENV``'s value, ``chained`` where unset; the launcher checks it up front."""
    mode = os.environ.get(MODE_ENV, "chained")
    if mode not in MODES:
        raise ConfigError(f"{MODE_ENV}={mode!r} is not a mode; use one of {', '.join(MODES)}")
    return mode


def gloo_mode() -> str | None:
    """How a backend build here orders its collectives on gloo (our runtime uses one
    backend for all groups): ``queued`` (no rewrite), ``chained`` or ``blocking``; None
    where nothing is done (another backend, or ``async`` asked for)."""
    mode = mode_from_env()
    on_gloo = dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo"
    if not on_gloo or mode == "async":
        return None
    if mode == "queued" and not gloo_groups_one_thread():
        return "chained"
    return mode


def gloo_groups_one_thread() -> bool:
    """Whether every gloo group of this process runs on one worker thread."""
    cpu = torch.device("cpu")
    try:
        threads = [
            group._get_backend(cpu).options._threads
            for group in dist.distributed_c10d._world.pg_map
            if dist.get_backend(group) == "gloo"
        ]
    except (AttributeError, RuntimeError):  # private API: a torch without it gets chained
        return False
    return bool(threads) and all(t == 1 for t in threads)


def one_in_flight(gm: fx.GraphModule, chained: bool) -> tuple[int, int]:
    """Rewrite ``gm`` in place as the module docstring says; return how many collectives
    were chained and how many made blocking. Collectives of a kind not in ``_ARGS``, or
    whose buffer is read other than by its waits, stay as they are."""
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    nodes = [n for n in gm.graph.nodes if _replaceable(n)]
    prev: list[fx.Node] = []  # the first wait of the chained collective in flight
    n_chained = 0
    for node, then in zip(nodes, [*nodes[1:], None]):
        first_wait = min(node.users, key=pos.__getitem__)
        chain = chained and then is not None and pos[first_wait] < pos[then]
        op = torch.ops.autoparallel.collective_after if chain else torch.ops.autoparallel.collective_now
        kind = _kind(node)
        named = dict(zip(_ARGS[kind], node.args[1:]))
        args = (node.args[0], prev, kind, named.get("reduce_op", ""), named.get("group_size", 0), named["group_name"])
        with gm.graph.inserting_after(node):
            new = gm.graph.call_function(op.default, args)
        new.meta.update(node.meta)
        if chain:
            node.replace_all_uses_with(new)
            prev, n_chained = [first_wait], n_chained + 1
        else:
            for wait in list(node.users):
                wait.replace_all_uses_with(new)
                gm.graph.erase_node(wait)
            prev = []
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return n_chained, len(nodes) - n_chained


def _replaceable(node: fx.Node) -> bool:
    kind = _kind(node)
    if kind is None or node.kwargs or len(node.args) != 1 + len(_ARGS[kind]):
        return False
    return bool(node.users) and all(map(is_wait, node.users))


def _kind(node: fx.Node) -> str | None:
    if not is_collective(node):
        return None
    kind = node.target._schema.name.split("::")[-1]
    return kind if kind in _ARGS else None
