"""Merge a local step graph's all-gathers and reduce-scatters into buckets (``compiled.py``).

The traced step calls one collective per tensor: an FSDP plan all-gathers
each parameter and reduce-scatters each gradient on its own. Where each call
costs a fixed latency (gloo on CPU, small NCCL messages) that latency
dominates; FSDP and DDP coalesce tensors into buckets, and so does this pass.

A merged all-gather flattens each member's input, concatenates them, gathers
the buffer once and cuts each member's ``[group_size, n_i]`` columns back out
(``all_gather_into_tensor`` stacks the ranks' inputs along dim 0, so this is
exact). A merged reduce-scatter views each input ``[group_size * d0, ...]`` as
``[group_size, n_i]``, concatenates along dim 1 and reduce-scatters once; each
member's result is a view of its slice of the output (the sum may run in
another order inside the backend: equal up to rounding).

Which collectives merge (a function of the graph alone: every rank must make
the same merges, since gloo and NCCL match collectives by issue order):

- Candidates are ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` calls
  whose only user is their ``wait_tensor``, with a tensor input that is not
  itself a wait (the merged nodes would have to move past its unpacking).
  Others stay as they are.
- Each member has a window: it may be issued after its input exists and
  after the last mutating node before it, and must be waited for before the
  first use of its result and before the next mutating node (a collective
  must not cross a mutation: it could read or write that memory in flight).
  Views of the result (``t``, ``view``, ``split``...) do not count as uses:
  they compute nothing, and move along to after the merged wait.
- Walking the graph in order, a candidate joins the open bucket of its key
  (kind, group, group size, dtype, reduce op, and whether its result is read
  by the step's output alone) when the windows of all members still overlap
  and the bucket's full-size buffer stays within ``bucket_bytes``; otherwise
  that bucket closes and the candidate opens the next. So a bucket is a run,
  in issue order, of collectives of one key. The merged result is one
  buffer, alive while any member's slice is: a parameter's reduced gradient,
  kept to the step's end, would keep an activation's (or the first step of a
  two-step reduction) as long, hence the key's last part.
  The rule and the cap live in ``planner/plan/buckets.py``: the planner's memory
  prediction groups the planned collectives with them.
- The merged wait and unpacking go right before the earliest window end. A
  merged reduce-scatter (and its concatenation) is issued right after the
  latest window start; a merged all-gather right before its wait, since its
  output buffer exists from its issue on. A merged reduce-scatter's wait
  also comes before the next other collective: a gradient's result is read
  only by the output, and waited for there every bucket's packed input
  (full size) would live to the step's end. ``schedule_overlap`` then moves
  issues earlier and waits later within its in-flight bound.

Parameter all-gathers, whose inputs exist from the start, thus fill buckets
up to the cap, each gathered shortly before its first use; gradient reduce-scatters, whose results only feed the outputs,
merge as DDP's buckets do, in the order the backward produces them. The cap
bounds what one bucket holds gathered at once (FSDP's memory saving), and
``check_same_buckets`` makes the ranks compare their merges once, at compile.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import operator
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import fx

from torchtitan_autoparallel.execute.overlap import is_collective, is_mutating, is_wait
from torchtitan_autoparallel.planner.plan.buckets import BUCKET_BYTES, group_buckets

_aten = torch.ops.aten
_functional = torch.ops._c10d_functional
_AG = _functional.all_gather_into_tensor.default
_RS = _functional.reduce_scatter_tensor.default
_WAIT = _functional.wait_tensor.default
_KIND = {_AG: "all_gather", _RS: "reduce_scatter"}
# Ops that only alias their input: moving one later computes nothing earlier or later.
_VIEWS = frozenset({
    _aten.t.default, _aten.permute.default, _aten.transpose.int, _aten.view.default, _aten._unsafe_view.default,
    _aten.alias.default, _aten.detach.default, _aten.squeeze.dim, _aten.unsqueeze.default, _aten.expand.default,
    _aten.select.int, _aten.slice.Tensor, _aten.split.Tensor, _aten.split_with_sizes.default, _aten.unbind.int,
    operator.getitem,
})  # fmt: skip


@dataclass(frozen=True)
class BucketStats:
    before: dict[str, int]  # kind -> collective calls in the traced graph
    after: dict[str, int]  # the same once merged
    buckets: tuple[int, ...]  # members of each merged collective, in graph order

    def summary(self) -> str:
        return ", ".join(f"{n} {kind} -> {self.after.get(kind, 0)}" for kind, n in sorted(self.before.items()))


@dataclass
class _Member:
    coll: fx.Node
    wait: fx.Node
    key: tuple
    val: torch.Tensor  # its input's traced value (shape, dtype)
    start: int  # index of the latest node it must be issued after
    end: int  # index of the earliest node that needs it finished
    nbytes: int  # its full-size buffer (the gathered output, the unreduced input)
    tail: list[fx.Node]  # views of its result, moved to after the merged wait


@dataclass
class _Bucket:
    members: list[_Member] = field(default_factory=list)

    @property
    def start(self) -> int:
        return max(m.start for m in self.members)

    @property
    def end(self) -> int:
        return min(m.end for m in self.members)


def bucket_collectives(gm: fx.GraphModule, bucket_bytes: int = BUCKET_BYTES) -> BucketStats:
    """Merge ``gm``'s collectives in place as the module docstring says; return the counts."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    before = _count(gm.graph)
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    merged = [b for b in _plan(nodes, index, bucket_bytes) if len(b.members) > 1]
    merged.sort(key=lambda b: index[b.members[0].coll])
    erased = {n for b in merged for m in b.members for n in (m.coll, m.wait)}
    waits_at = [_rewrite(gm.graph, nodes, bucket, erased) for bucket in merged]
    # Moved and erased last: each rewrite anchors its new nodes on the original positions.
    for bucket, wait_at in zip(merged, waits_at):
        for view in (v for m in bucket.members for v in m.tail):
            wait_at.prepend(view)  # after the merged wait and unpacking, in traced order
        for m in bucket.members:
            gm.graph.erase_node(m.wait)
            gm.graph.erase_node(m.coll)
    gm.graph.lint()
    gm.recompile()
    return BucketStats(before, _count(gm.graph), tuple(len(b.members) for b in merged))


def check_same_buckets(stats: BucketStats, group: dist.ProcessGroup | None = None) -> None:
    """Raise on every rank if the ranks merged differently: their collectives would not match."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1 or dist.get_backend(group) == "fake":
        return
    everyone: list[BucketStats | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, stats, group)
    differing = [rank for rank, theirs in enumerate(everyone) if theirs != stats]
    if differing:
        raise RuntimeError(f"collective bucketing differs across ranks (ranks {differing} vs this one: {stats})")


# ---------------------------------------------------------------- choosing the buckets


def _plan(nodes: list[fx.Node], index: dict[fx.Node, int], cap: int) -> list[_Bucket]:
    """The buckets, by the planner's rule (``planner/plan/buckets.py``), which its memory
    prediction walks too."""
    mutations = [i for i, n in enumerate(nodes) if is_mutating(n)]
    members = (m for m in (_member(node, index, mutations) for node in nodes) if m is not None)
    return [_Bucket(b) for b in group_buckets(members, cap)]


def _member(node: fx.Node, index: dict[fx.Node, int], mutations: list[int]) -> _Member | None:
    """``node`` as a bucket member, or None when it must stay as it is."""
    kind = _KIND.get(node.target) if node.op == "call_function" else None
    if kind is None or node.kwargs or len(node.users) != 1:
        return None
    wait = next(iter(node.users))
    inp = node.args[0]
    if not is_wait(wait) or not isinstance(inp, fx.Node) or is_wait(inp):
        return None
    val = inp.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() == 0:
        return None
    size = node.args[-2]
    if kind == "reduce_scatter" and val.shape[0] % size:
        return None
    before = bisect.bisect_left(mutations, index[node])  # mutations before the collective
    if bisect.bisect_left(mutations, index[wait]) != before:  # one between issue and wait
        return None
    start = max(index[inp], mutations[before - 1] if before else -1)
    tail, end = _view_tail(wait, index, mutations[before] if before < len(mutations) else len(index) - 1)
    nbytes = val.numel() * val.element_size() * (size if kind == "all_gather" else 1)
    key = (kind, *node.args[1:], val.dtype, _read_by_output_only(wait))
    return _Member(node, wait, key, val, start, end, nbytes, tail)


def _read_by_output_only(wait: fx.Node) -> bool:
    """Whether ``wait``'s result reaches nothing but the step's output, through views: a
    parameter's reduced gradient, alive to the step's end."""
    pending = list(wait.users)
    while pending:
        user = pending.pop()
        if user.op == "call_function" and user.target in _VIEWS:
            pending.extend(user.users)
        elif user.op != "output":
            return False
    return True


def _view_tail(wait: fx.Node, index: dict[fx.Node, int], limit: int) -> tuple[list[fx.Node], int]:
    """The views of ``wait``'s result that may move with it, and the index of its first real use.

    The traced step transposes or splits a result right after its wait (DTensor
    reduce-scatters a weight's gradient along dim 1 as the transposed matrix),
    which would end the window at once. Views compute nothing, so the rewrite
    moves them after the merged wait and the window ends at the first other
    use, or at ``limit`` (the next mutation, the output). A view feeding a
    collective stays: that collective's input must not move.
    """
    inside, tail, end = {wait}, [], limit
    pending = [(index[u], u) for u in wait.users]
    heapq.heapify(pending)
    while pending:  # in graph order: a view's inputs are decided before it
        at, user = heapq.heappop(pending)
        if user in inside:
            continue
        if _movable_view(user, inside) and at < limit:
            inside.add(user)
            tail.append(user)
            for u in user.users:
                heapq.heappush(pending, (index[u], u))
        else:
            end = min(end, at)
    return tail, end


def _movable_view(node: fx.Node, inside: set[fx.Node]) -> bool:
    return (
        node.op == "call_function"
        and node.target in _VIEWS
        and all(a in inside for a in node.all_input_nodes)
        and not any(is_collective(u) for u in node.users)
    )


# ---------------------------------------------------------------- rewriting


def _rewrite(graph: fx.Graph, nodes: list[fx.Node], bucket: _Bucket, erased: set[fx.Node]) -> fx.Node:
    """Insert the merged collective of ``bucket``, point each member's users at its slice.

    Returns the node the merged wait was inserted before (never one of ``erased``).
    """
    gather = bucket.members[0].coll.target is _AG
    wait_at = nodes[bucket.end if gather else min(bucket.end, _next_collective(nodes, bucket, erased))]
    # A gather's output is allocated when it is issued: issued at its window's start
    # (the step's start, for parameters) every bucket would hold its gathered weights
    # at once, the whole model. Issued just before its wait, ``schedule_overlap``
    # hoists it only as far as its in-flight bound allows (FSDP's prefetch).
    # A reduce-scatter goes as early as its inputs allow, which frees them sooner.
    first_op = next(i for i, n in enumerate(nodes) if n.op != "placeholder")
    issue_at = wait_at if gather else nodes[max(bucket.start + 1, first_op)]
    build = _gather if gather else _scatter
    for m, result in zip(bucket.members, build(graph, bucket.members, issue_at, wait_at)):
        m.wait.replace_all_uses_with(result)
    return wait_at


def _next_collective(nodes: list[fx.Node], bucket: _Bucket, erased: set[fx.Node]) -> int:
    """Index of the first node, after the bucket's issue, that stays and is at or past
    another collective (a member of another bucket is erased: the next node that stays)."""
    members = {m.coll for m in bucket.members}
    after = range(bucket.start + 1, len(nodes))
    first = next((i for i in after if is_collective(nodes[i]) and nodes[i] not in members), len(nodes) - 1)
    return next(i for i in range(first, len(nodes)) if nodes[i] not in erased)


def _gather(graph: fx.Graph, members: list[_Member], issue_at: fx.Node, wait_at: fx.Node) -> list[fx.Node]:
    _, size, group = members[0].coll.args
    shapes, dtype = [m.val.shape for m in members], members[0].val.dtype
    numels = [math.prod(s) for s in shapes]
    total = sum(numels)
    with graph.inserting_before(issue_at):
        flat = [
            _call(graph, _aten.reshape.default, (m.coll.args[0], [-1]), [n], dtype) for m, n in zip(members, numels)
        ]
        buffer = _call(graph, _aten.cat.default, (flat,), [total], dtype)
        coll = _call(graph, _AG, (buffer, size, group), [size * total], dtype)
    results = []
    with graph.inserting_before(wait_at):
        gathered = _call(graph, _WAIT, (coll,), [size * total], dtype)
        rows = _call(graph, _aten.view.default, (gathered, [size, total]), [size, total], dtype)
        for offset, n, shape in zip(_offsets(numels), numels, shapes):
            # Rank r's part of this member is row r, columns [offset, offset + n); stacked
            # (made dense, viewed back) they are what the member's own gather returned.
            cols = _call(graph, _aten.slice.Tensor, (rows, 1, offset, offset + n), [size, n], dtype)
            dense = _call(graph, _aten.clone.default, (cols,), [size, n], dtype, memory_format=torch.contiguous_format)
            out_shape = [size * shape[0], *shape[1:]]
            results.append(_call(graph, _aten.view.default, (dense, out_shape), out_shape, dtype))
    return results


def _scatter(graph: fx.Graph, members: list[_Member], issue_at: fx.Node, wait_at: fx.Node) -> list[fx.Node]:
    _, op, size, group = members[0].coll.args
    shapes, dtype = [m.val.shape for m in members], members[0].val.dtype
    numels = [math.prod(s) // size for s in shapes]
    total = sum(numels)
    with graph.inserting_before(issue_at):
        # Row r of each member is what rank r receives of it; side by side, row r of the buffer.
        rows = [
            _call(graph, _aten.reshape.default, (m.coll.args[0], [size, n]), [size, n], dtype)
            for m, n in zip(members, numels)
        ]
        buffer = _call(graph, _aten.cat.default, (rows, 1), [size, total], dtype)
        flat = _call(graph, _aten.view.default, (buffer, [-1]), [size * total], dtype)
        coll = _call(graph, _RS, (flat, op, size, group), [total], dtype)
    results = []
    with graph.inserting_before(wait_at):
        reduced = _call(graph, _WAIT, (coll,), [total], dtype)
        for offset, n, shape in zip(_offsets(numels), numels, shapes):
            piece = _call(graph, _aten.slice.Tensor, (reduced, 0, offset, offset + n), [n], dtype)
            out_shape = [shape[0] // size, *shape[1:]]
            results.append(_call(graph, _aten.view.default, (piece, out_shape), out_shape, dtype))
    return results


def _call(graph: fx.Graph, target, args: tuple, shape: list[int], dtype: torch.dtype, **kwargs) -> fx.Node:
    """A new node, with a meta-device ``val`` so later passes (this one again) see its shape."""
    node = graph.call_function(target, args, kwargs)
    node.meta["val"] = torch.empty(shape, dtype=dtype, device="meta")
    return node


def _offsets(numels: list[int]) -> list[int]:
    return [0, *itertools.accumulate(numels)][:-1]


def _count(graph: fx.Graph) -> dict[str, int]:
    return dict(Counter(_KIND[n.target] for n in graph.nodes if n.op == "call_function" and n.target in _KIND))


__all__ = ["BucketStats", "bucket_collectives", "check_same_buckets"]
