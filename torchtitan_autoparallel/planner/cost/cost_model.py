"""Analytic cost model: compute roofline, ring collectives, DTensor redistribution.

Every function is pure (no process group, no device) and returns microseconds
or bytes.  The formulas and assumptions are written up in docs/cost_model.md.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard, _StridedShard

from torchtitan_autoparallel.planner.cost.profiles import HardwareProfile, Link

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")

_BYTES_PER_US_PER_GBPS = 1e3  # 1 GB/s = 1e9 B / 1e6 us
_FLOPS_PER_US_PER_TFLOPS = 1e6


class ImpossibleRedistribute(ValueError):
    """No sequence of DTensor collectives turns ``src`` into ``dst``."""


@dataclass(frozen=True)
class CommStep:
    """One collective of a redistribution.

    ``bytes`` follows ``collective_time_us``: the full (gathered) buffer on one
    device for all_gather / reduce_scatter / all_reduce, the local shard for
    all_to_all.
    """

    kind: str
    mesh_dim: int
    bytes: float
    group_size: int


def mesh_dim_links(mesh_shape: tuple[int, ...], profile: HardwareProfile) -> list[Link]:
    """The link each mesh dim communicates over.

    Ranks are laid out row-major, so the last mesh dims vary fastest and land
    inside one node first: a dim stays intra-node while the product of its size
    and every size to its right fits in ``devices_per_node``.
    """
    links: list[Link] = []
    inner = 1
    for size in reversed(mesh_shape):
        inner *= size
        links.append(profile.intra_node if inner <= profile.devices_per_node else profile.inter_node)
    return links[::-1]


def _peak_key(dtype: torch.dtype) -> str:
    # float64, integer and fp8 kernels are rare in the planned graph; pricing
    # them at fp32 peak keeps them from looking free.
    return {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32")


def compute_time_us(flops: float, bytes_moved: float, dtype: torch.dtype, profile: HardwareProfile) -> float:
    """Roofline time of one kernel: the slower of math and memory traffic, plus launch."""
    if flops <= 0 and bytes_moved <= 0:
        return 0.0  # views and metadata ops launch nothing
    flops_per_us = profile.peak_tflops[_peak_key(dtype)] * profile.compute_efficiency * _FLOPS_PER_US_PER_TFLOPS
    bytes_per_us = profile.mem_bandwidth_GBps * _BYTES_PER_US_PER_GBPS
    return max(flops / flops_per_us, bytes_moved / bytes_per_us) + profile.kernel_overhead_us


def collective_time_us(kind: str, bytes_full: float, group_size: int, link: Link) -> float:
    """Ring-algorithm time of one collective over ``group_size`` ranks.

    all_gather / reduce_scatter: (n-1)*latency + (n-1)/n * bytes_full / bw
    all_reduce:                  reduce_scatter + all_gather (2x the above)
    all_to_all:                  (n-1)*latency + (n-1)/n * bytes_full / bw
    where bytes_full is the full (gathered / unreduced) buffer on one device for
    the first three and the local shard each rank holds for all_to_all; plus
    the link's fixed ``call_overhead_us`` per call.
    """
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}; expected one of {COLLECTIVES}")
    n = int(group_size)
    if n <= 1 or bytes_full <= 0:
        return 0.0
    bytes_per_us = link.bandwidth_GBps * _BYTES_PER_US_PER_GBPS
    one_pass = (n - 1) * link.latency_us + (n - 1) / n * bytes_full / bytes_per_us
    return (2.0 * one_pass if kind == "all_reduce" else one_pass) + link.call_overhead_us


# ---------------------------------------------------------------- placements
#
# The search runs on small tuple codes instead of torch Placement objects:
# isinstance and __eq__ on those pybind classes dominated planning time.
#   ("S", d)  Shard(d)      ("T", d, k)  _StridedShard(d, split_factor=k)
#   ("R",)    Replicate()   ("P", op)    Partial(op)

Code = tuple
_R: Code = ("R",)
_SHARDS = frozenset(("S", "T"))


def _code(p: Placement, ndim: int) -> Code:
    # _StridedShard is neither a Shard subclass nor is_shard() in torch 2.14,
    # so it is tested first and on its own.
    if isinstance(p, _StridedShard):
        return ("T", _tensor_dim(p.dim, ndim, p), int(p.split_factor))
    if isinstance(p, Shard):
        return ("S", _tensor_dim(p.dim, ndim, p))
    if isinstance(p, Replicate):
        return _R
    if isinstance(p, Partial):  # subclasses such as mask partials price as their op
        return ("P", str(p.reduce_op))
    raise ValueError(f"unsupported placement {p!r}")


def _tensor_dim(d: int, ndim: int, p: Placement) -> int:
    if not -ndim <= d < ndim:
        raise ValueError(f"{p} is out of range for a {ndim}-d tensor")
    return d % ndim


def _label(c: Code) -> str:
    return {"S": "S({1})", "T": "SS({1},{2})", "R": "R", "P": "P" if c[-1] == "sum" else "P({1})"}[c[0]].format(*c)


def _labels(codes: tuple[Code, ...]) -> str:
    return "".join(_label(c) for c in codes)


def _local_dims(shape: tuple[int, ...], state: tuple[Code, ...], mesh_shape: tuple[int, ...], skip: int) -> list[int]:
    """Local (padded) tensor dims for ``state``, ignoring mesh dim ``skip``.

    Uneven shards are padded to the ceil size, as DTensor's collectives do;
    nested ceil divisions equal one ceil division by the product.
    """
    dims = list(shape)
    for j, c in enumerate(state):
        if c[0] in _SHARDS and j != skip:
            dims[c[1]] = -(-dims[c[1]] // mesh_shape[j])
    return dims


def _bytes(dims: list[int], dtype_bytes: int) -> float:
    return float(math.prod(dims) * dtype_bytes)


def _padded(dims: list[int], d: int, n: int) -> list[int]:
    return [-(-x // n) * n if k == d else x for k, x in enumerate(dims)]


def _nesting_blocked(
    state: tuple[Code, ...], i: int, old: Code, new: Code, mesh_shape: tuple[int, ...]
) -> bool:
    """Whether changing mesh dim ``i`` would break DTensor's default shard order.

    Plain placements mean mesh dims shard a tensor dim left to right, so only
    the innermost (right-most) mesh dim sharding a tensor dim may shard or
    unshard it; the others have to be replicated first (DTensor's "nested
    sharding" detour).  A _StridedShard's chunks live in the local tensor the
    later mesh dims cut, so it nests the same way, except in FSDP2+TP's order:
    _StridedShard(d, k) followed only by plain shards of d whose mesh sizes
    multiply to k (the tp-first layout spelled left to right), which may turn
    into or out of a non-shard alone (the executor gathers or cuts just that
    mesh dim; execute/strided.py).
    """
    touched = {c[1] for c in (old, new) if c[0] in _SHARDS}
    later = [j for j in range(i + 1, len(state)) if state[j][0] in _SHARDS and state[j][1] in touched]
    if not later:
        return False
    strided = old if old[0] == "T" else new
    other = new if strided is old else old
    tp_first = (
        strided[0] == "T"
        and other[0] not in _SHARDS
        and all(state[j][0] == "S" for j in later)
        and math.prod(mesh_shape[j] for j in later) == strided[2]
    )
    return not tp_first


def _transition(
    shape: tuple[int, ...], dtype_bytes: int, state: tuple[Code, ...], i: int, new: Code, mesh_shape: tuple[int, ...]
) -> tuple[str, float] | None:
    """(collective kind or "free", bytes) of one mesh-dim change; None if DTensor cannot do it."""
    old, n = state[i], mesh_shape[i]
    if _nesting_blocked(state, i, old, new, mesh_shape):
        return None
    if old[0] == "R":
        return ("free", 0.0)  # local chunk, or keep / zero for Partial
    dims = _local_dims(shape, state, mesh_shape, skip=i)
    if old[0] == "P":
        if new[0] in ("R", "T"):  # DTensor reduces to Replicate first for a strided target
            return ("all_reduce", _bytes(dims, dtype_bytes))
        if new[0] == "S":
            return ("reduce_scatter", _bytes(_padded(dims, new[1], n), dtype_bytes))
        return None  # Partial(a) -> Partial(b): unsupported by DTensor
    if new[0] == "P":  # zero-filled embed of the local shard
        return ("free", 0.0) if old[0] == "S" and new[1] == "sum" else None
    if old[0] == "S" and new[0] == "S" and old[1] != new[1]:
        local = _padded(dims, new[1], n)
        local[old[1]] = -(-local[old[1]] // n)
        return ("all_to_all", _bytes(local, dtype_bytes))
    # S -> R, and a shard -> another kind of shard of the same dim (via Replicate).
    return ("all_gather", _bytes(_padded(dims, old[1], n), dtype_bytes))


def _step_cost(kind: str, nbytes: float, n: int, link: Link | None) -> float:
    """Search weight of a step: ring time on ``link``, else bytes each rank sends."""
    if link is not None:
        return collective_time_us(kind, nbytes, n, link)
    wire = (n - 1) / n * nbytes
    return 2.0 * wire if kind == "all_reduce" else wire


def _supported(s: Code, t: Code) -> bool:
    """Whether DTensor's redistribute turns one mesh dim's ``s`` into ``t``: not
    Partial(a) -> Partial(b) for a != b, nor a shard -> any Partial but plain
    Shard -> Partial(sum).  A detour through Replicate exists, but no sound
    strategy needs one."""
    return not (t[0] == "P" and s != t and s[0] != "R" and not (s[0] == "S" and t[1] == "sum"))


def _check_supported(src: tuple[Code, ...], dst: tuple[Code, ...]) -> None:
    """Raise on what DTensor's redistribute raises on (``_supported``)."""
    if not all(map(_supported, src, dst)):
        raise ImpossibleRedistribute(f"cannot redistribute {_labels(src)} -> {_labels(dst)}")


def _options(src: Code, dst: Code, ndim: int) -> tuple[Code, ...]:
    """Placements a mesh dim may pass through: its ends, and Replicate.

    A dim ending in Partial(sum) may also pass through any Shard: sharding a
    replicated dim is free and Shard -> Partial(sum) is free, so this shrinks
    the buffer the other dims' collectives move (as torch's min-cost planner does).
    """
    extra = tuple(("S", d) for d in range(ndim)) if dst == ("P", "sum") else ()
    return tuple(dict.fromkeys((src, dst, _R, *extra)))


@lru_cache(maxsize=1 << 16)
def _plan(
    shape: tuple[int, ...],
    dtype_bytes: int,
    src: tuple[Code, ...],
    dst: tuple[Code, ...],
    mesh_shape: tuple[int, ...],
    profile: HardwareProfile | None,
) -> tuple[CommStep, ...]:
    """Cheapest valid path from src to dst: Dijkstra over the ``_options`` states.

    Costs are ring times when a profile is given, else bytes on the wire;
    ties prefer fewer collectives.
    """
    _check_supported(src, dst)
    links = mesh_dim_links(mesh_shape, profile) if profile is not None else [None] * len(mesh_shape)
    options = [_options(s, t, len(shape)) for s, t in zip(src, dst)]
    tie = itertools.count()  # keeps the heap from comparing states
    frontier: list = [(0.0, 0, next(tie), src, ())]
    settled: set[tuple[Code, ...]] = set()
    while frontier:
        cost, nsteps, _, state, steps = heapq.heappop(frontier)
        if state == dst:
            return tuple(CommStep(kind, i, nbytes, mesh_shape[i]) for kind, i, nbytes in steps)
        if state in settled:
            continue
        settled.add(state)
        for i, opts in enumerate(options):
            for new in opts:
                nxt = state[:i] + (new,) + state[i + 1 :]
                if new == state[i] or nxt in settled:
                    continue
                move = _transition(shape, dtype_bytes, state, i, new, mesh_shape)
                if move is None:
                    continue
                kind, nbytes = move
                if kind == "free":
                    heapq.heappush(frontier, (cost, nsteps, next(tie), nxt, steps))
                    continue
                extra = _step_cost(kind, nbytes, mesh_shape[i], links[i])
                heapq.heappush(frontier, (cost + extra, nsteps + 1, next(tie), nxt, steps + ((kind, i, nbytes),)))
    raise ImpossibleRedistribute(f"cannot redistribute {_labels(src)} -> {_labels(dst)}")


def _codes(ps: Sequence[Placement], shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> tuple[Code, ...]:
    if len(ps) != len(mesh_shape):
        raise ValueError(f"need one placement per mesh dim of {mesh_shape}, got {list(ps)}")
    # Size-1 mesh dims never communicate (DTensor short-cuts them), so they
    # become Replicate on both sides; this also raises cache hits.
    return tuple(_R if n == 1 else _code(p, len(shape)) for p, n in zip(ps, mesh_shape))


def redistribute_steps(
    shape: tuple[int, ...],
    dtype_bytes: int,
    src: Sequence[Placement],
    dst: Sequence[Placement],
    mesh_shape: tuple[int, ...],
    profile: HardwareProfile | None = None,
) -> list[CommStep]:
    """Collectives that turn a ``shape`` tensor placed as ``src`` into ``dst``.

    Free local steps (Replicate -> Shard/Partial, Shard -> Partial(sum)) are
    not listed.  With ``profile`` the path minimises time, else wire bytes.
    Raises ImpossibleRedistribute for Partial(a) -> Partial(b), a != b, and for
    a strided shard or a non-sum Partial target reached from a shard.
    """
    shape_t, mesh_t = tuple(map(int, shape)), tuple(map(int, mesh_shape))
    src_c, dst_c = _codes(src, shape_t, mesh_t), _codes(dst, shape_t, mesh_t)
    return list(_plan(shape_t, int(dtype_bytes), src_c, dst_c, mesh_t, profile))


@lru_cache(maxsize=1 << 18)
def _time_cached(shape, dtype_bytes, src, dst, mesh_shape, profile) -> float:
    if src == dst:
        return 0.0
    try:
        steps = _plan(shape, dtype_bytes, src, dst, mesh_shape, profile)
    except ImpossibleRedistribute:
        return math.inf
    links = mesh_dim_links(mesh_shape, profile)
    return sum(collective_time_us(s.kind, s.bytes, s.group_size, links[s.mesh_dim]) for s in steps)


def redistribute_time_us(
    shape: tuple[int, ...],
    dtype_bytes: int,
    src: Sequence[Placement],
    dst: Sequence[Placement],
    mesh_shape: tuple[int, ...],
    profile: HardwareProfile,
) -> float:
    """Time of ``redistribute_steps(..., profile=profile)``; ``inf`` when impossible."""
    shape_t, mesh_t = tuple(map(int, shape)), tuple(map(int, mesh_shape))
    src_c, dst_c = _codes(src, shape_t, mesh_t), _codes(dst, shape_t, mesh_t)
    return _time_cached(shape_t, int(dtype_bytes), src_c, dst_c, mesh_t, profile)


def clear_caches() -> None:
    """Forget memoised plans (tests, or after monkeypatching a profile)."""
    _plan.cache_clear()
    _time_cached.cache_clear()
