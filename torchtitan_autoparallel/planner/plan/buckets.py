"""How the executor batches and runs collectives, for the planner's memory prediction.

``execute/bucketing.py`` merges a step's all-gathers and reduce-scatters into
buckets, and ``execute/overlap.py`` / ``execute/inflight.py`` bound how many
run at once. Their buffers are part of the step's peak, so the planner
predicts them (``memory.py``) with the same rule and the same numbers, read
from here by both sides: the prediction cannot drift from what runs.

* ``BUCKET_BYTES``: the most one merged collective holds at full size (the
  gathered output of an all-gather, the unreduced input of a reduce-scatter).
* ``IN_FLIGHT``: collectives issued and not yet waited for, at most.
* ``group_buckets``: walking candidates in issue order, one joins the open
  bucket of its key (kind, group, dtype, reduce op) when all members' windows
  (issue no earlier than ``start``, wait before ``end``) still overlap and
  the bucket stays within the cap; otherwise that bucket closes and the
  candidate opens the next.
* ``gradient_triggers``: where each parameter gradient is reduced (after
  the last node that reads it, the step's output aside).
* ``backend_scratch_bytes``: what the process group's backend allocates
  besides the collective's own input and output while it runs. Measured on
  gloo (torch 2.14.1, ``experiments/memory``): an all-gather gathers into a
  temporary of its output's size on the group's worker thread, then copies
  it out; a reduce-scatter reduces a copy of its input. NCCL writes in place.
  A shard-to-shard move (all-to-all, never merged) is, on gloo, DTensor's
  fallback: an all-gather of the whole tensor (its output and gloo's
  temporary, each full size) cut down to the local chunk (measured, torch
  2.14.1). On NCCL it copies the chunks it sends and receives (two local
  shards; torch's ``shard_dim_alltoall``, not yet measured on a GPU).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Protocol, TypeVar

import torch.distributed as dist
from torch import fx

BUCKET_BYTES = 32 * 2**20
IN_FLIGHT = 1
BUCKETED_KINDS = ("all_gather", "reduce_scatter")


class Window(Protocol):
    """A collective that may join a bucket: which ones it may merge with, where it may
    be issued and waited for (positions in one graph order), its full-size bytes."""

    key: Hashable
    start: int  # the latest position it must be issued after
    end: int  # the earliest position that needs it finished
    nbytes: int | float


M = TypeVar("M", bound=Window)


def group_buckets(members: Iterable[M], cap: int | float = BUCKET_BYTES) -> list[list[M]]:
    """``members`` (in issue order) grouped as the module docstring says: the closed buckets
    in the order they closed, then the ones still open."""
    open_: dict[Hashable, list[M]] = {}
    closed: list[list[M]] = []
    for m in members:
        bucket = open_.get(m.key)
        if bucket is not None and _admits(bucket, m, cap):
            bucket.append(m)
            continue
        if bucket is not None:
            closed.append(bucket)
        open_[m.key] = [m]
    return closed + list(open_.values())


def _admits(bucket: list[Window], m: Window, cap: int | float) -> bool:
    nbytes = sum(x.nbytes for x in bucket) + m.nbytes
    start = max(max(x.start for x in bucket), m.start)
    end = min(min(x.end for x in bucket), m.end)
    return nbytes <= cap and start < end


def gradient_triggers(graph: fx.Graph, gradients: Iterable[fx.Node]) -> dict[fx.Node, list[fx.Node]]:
    """node -> the gradients reduced right after it: each gradient's last reader other than
    the step's output (the gradient's own node, unless the backward reads it again)."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    out: dict[fx.Node, list[fx.Node]] = {}
    for grad in sorted(gradients, key=position.__getitem__):
        uses = [u for u in grad.users if u.op != "output"]
        out.setdefault(max([grad, *uses], key=position.__getitem__), []).append(grad)
    return out


def backend_scratch_bytes(kind: str, full_bytes: float, gloo: bool, group_size: int = 1) -> float:
    """Bytes the backend allocates for one collective while it runs, besides its output
    (the module docstring). ``full_bytes``: the whole tensor over the group."""
    if kind == "all_to_all":
        return 2 * full_bytes if gloo else 2 * full_bytes / group_size
    return full_bytes if gloo and kind in BUCKETED_KINDS else 0.0


def runs_on_gloo(profile_name: str) -> bool:
    """Whether the planned step's collectives run on gloo: this process's group says so
    where one is open (a fake one plans for the GPUs it stands in for), else the cost
    profile does (the built-in CPU one)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_backend() == "gloo"
    return profile_name == "cpu_gloo"
