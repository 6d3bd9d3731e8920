"""Redistributions from or to ``_StridedShard``, done explicitly.

torch 2.14's ``DTensor.redistribute`` handles a strided shard alone on its
tensor dim, but with another mesh dim sharding the same tensor dim it raises
or, worse, returns wrong values (e.g. ``(R, _S(0,8)) -> (S(0), _S(0,4))`` and
``(_S(0,8), _S(0,4)) -> (R, R)`` on a 2x2 mesh). So every redistribution with
a strided shard on either side runs here, and DTensor only ever sees plain
placements:

1. per tensor dim, the mesh dims from its first change on are all-gathered,
   innermost first, when that change is at or before a strided shard (a
   change after the last one is plain inside every chunk); then, when the
   target's first change is a strided shard over a replicated mesh dim, it
   is cut locally right away, so later collectives move the chunk only;
2. the rest is DTensor's plain redistribution, strided dims read as ``Shard``
   of a permuted tensor (valid because their chunks do not change);
3. the strided shards still missing are cut locally (free).

A rank's global indices along a dim follow from the placements (``held``),
and every reorder is checked against them, so a wrong step fails loudly
instead of training on scrambled rows. The collectives are the ones
``cost_model.redistribute_steps`` prices: tests/planner/test_strided.py checks the
counts pair by pair on a 2x2 mesh. (On 2x2x2, a sample of 365 pairs was
exact in values, but 14 with several mesh dims on one tensor dim ran a
different number of gathers than the model's cheapest path.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard, _StridedShard

from torchtitan_autoparallel.execute.placements import normalise
from torchtitan_autoparallel.planner.strategies.placement import Placements, is_shard
from torchtitan_autoparallel.planner.strategies.strided import has_strided

__all__ = ["StridedRedistributeError", "has_strided", "held", "redistribute_strided"]


class StridedRedistributeError(RuntimeError):
    """A strided redistribution step would not produce the planned rows."""


def held(
    size: int, placements: Sequence[Placement], sizes: Sequence[int], coord: Sequence[int], d: int
) -> torch.Tensor:
    """Global indices along tensor dim ``d`` the rank at ``coord`` holds, in local order.

    Mesh dims cut the local tensor left to right; ``_StridedShard(d, k)`` on n
    ranks splits it into k chunks of n pieces and keeps piece ``coord`` of each.
    """
    return torch.from_numpy(_rows(size, placements, sizes, coord, d))


def _rows(
    size: int, placements: Sequence[Placement], sizes: Sequence[int], coord: Sequence[int], d: int
) -> np.ndarray:
    # numpy, not torch: these are static indices, and torch ops on them would be traced
    # (and need concrete values) when the step is re-traced into a graph (compiled.py)
    idx = np.arange(size)
    for p, n, c in zip(placements, sizes, coord):
        if not is_shard(p) or p.dim != d:
            continue
        k = int(p.split_factor) if isinstance(p, _StridedShard) else 1
        idx = idx.reshape(k, n, -1)[:, c, :].reshape(-1)
    return idx


def redistribute_strided(value: DTensor, mesh: DeviceMesh, target: Placements, plain) -> DTensor:
    """``value`` moved to ``target``; ``plain(value, mesh, target)`` does plain placements."""
    shape, sizes = tuple(value.shape), tuple(mesh.mesh.shape)
    coord = tuple(mesh.get_coordinate() or ())
    cur, local = list(normalise(value.placements, value.ndim)), value.to_local()
    for d in range(len(shape)):
        local, cur = _unstride(local, mesh, cur, target, d, shape, coord)
    pre = _before_cut(cur, target, sizes)
    if tuple(cur) != tuple(pre):
        mid = DTensor.from_local(local, mesh, _plain(cur), run_check=False, shape=value.shape, stride=value.stride())
        local = plain(mid, mesh, _plain(pre)).to_local()
    for d in range(len(shape)):
        if _part(pre, d) != _part(target, d):
            local = _cut(local, d, shape[d], pre, target, sizes, coord)
    return DTensor.from_local(local, mesh, tuple(target), run_check=False, shape=value.shape, stride=value.stride())


# ---------------------------------------------------------------- phases
#
# Mesh dims before the first change of a tensor dim's sharding keep their
# chunks, strided or not; what comes after is nested inside them. So only a
# change at or before a strided shard needs this module: a change after the
# last one is plain within every chunk, and phase 2 leaves it to DTensor.


def _gather_dims(cur: Sequence[Placement], target: Sequence[Placement], d: int, m: int, sizes) -> list[int]:
    """Mesh dims to all-gather, in order, so tensor dim ``d`` holds no strided shard from ``m`` on.

    Innermost first always works. When ``m`` is a strided shard the target
    drops, it may go alone once the innermost few are gathered and what is
    left after it is FSDP2+TP's order (``cost_model._nesting_blocked``);
    phase 2 cuts those few again for free.
    """
    mine = [i for i in range(len(cur) - 1, m - 1, -1) if _on(cur[i], d)]
    if isinstance(cur[m], _StridedShard) and not _on(target[m], d):
        for k in range(len(mine) - 1):
            rest = [Replicate() if i in mine[:k] else p for i, p in enumerate(cur)]
            if _tp_first(rest, m, sizes):
                return mine[:k] + [m]
    return mine


def _unstride(local, mesh, cur, target, d, shape, coord) -> tuple[torch.Tensor, list[Placement]]:
    """Phase 1 for tensor dim ``d``: the gathers it needs, then a cut when it can come first."""
    sizes = tuple(mesh.mesh.shape)
    m = _first_change(cur, target, d)
    if m is None:
        return local, cur
    if m <= _last_strided(cur, d) or _strided_over_shard(cur, target, m, d):
        for g in _gather_dims(cur, target, d, m, sizes):
            local, cur = _gather(local, mesh, g, d, cur, shape, coord)
    e = _cut_blocker(cur, target, d, m)
    if e is not None:
        local, cur = _gather(local, mesh, m, e, cur, shape, coord)
    if _strided_on(target[m], d) and isinstance(cur[m], Replicate) and not _nested(cur, m, d):
        # Cut before the plain collectives, so they move (or reduce-scatter) the chunk only.
        new = [target[i] if i == m else p for i, p in enumerate(cur)]
        local, cur = _cut(local, d, shape[d], cur, new, sizes, coord), new
    return local, cur


def _cut_blocker(cur: Sequence[Placement], target: Sequence[Placement], d: int, m: int) -> int | None:
    """The other tensor dim sharded at mesh dim ``m``, where ``target`` cuts ``d``
    strided: gathered first when nothing is nested inside it."""
    p = cur[m]
    if not (_strided_on(target[m], d) and is_shard(p)) or p.dim == d:
        return None
    return None if _nested(cur, m, d) or _nested(cur, m, p.dim) else p.dim


def _nested(placements: Sequence[Placement], m: int, d: int) -> bool:
    return any(_on(placements[i], d) for i in range(m + 1, len(placements)))


def _before_cut(cur: Sequence[Placement], target: Sequence[Placement], sizes: Sequence[int]) -> list[Placement]:
    """``target`` with each strided shard it adds left gathered (phase 3 cuts it)."""
    pre = list(target)
    for d in {p.dim for p in target if isinstance(p, _StridedShard)}:
        m = _first_change(cur, target, d)
        if m is None:
            continue
        first = next((i for i in range(m, len(target)) if _strided_on(target[i], d)), None)
        if first is None:
            continue
        # FSDP2+TP's order: the later plain shards stay, the strided one is cut alone.
        keep_later = _tp_first(target, first, sizes)
        for i in range(first, len(target)):
            if _on(target[i], d) and (i == first or not keep_later):
                pre[i] = Replicate()
    return pre


def _gather(local, mesh, g, d, cur, shape, coord) -> tuple[torch.Tensor, list[Placement]]:
    new = list(cur)
    new[g] = Replicate()
    sizes = tuple(mesh.mesh.shape)
    gathered = funcol.all_gather_single(local.contiguous(), d, (mesh, g))
    if isinstance(gathered, funcol.AsyncCollectiveTensor):
        gathered = gathered.wait()
    got = np.concatenate([_rows(shape[d], cur, sizes, _at(coord, g, r), d) for r in range(sizes[g])])
    want = _rows(shape[d], new, sizes, coord, d)
    return _reorder(gathered, d, got, want, shape[d], exact=True), new


def _cut(local, d, size, pre, target, sizes, coord) -> torch.Tensor:
    got, want = _rows(size, pre, sizes, coord, d), _rows(size, target, sizes, coord, d)
    return _reorder(local, d, got, want, size, exact=False)


def _reorder(t: torch.Tensor, d: int, got: np.ndarray, want: np.ndarray, size: int, exact: bool) -> torch.Tensor:
    """``t`` (rows ``got`` along ``d``) as rows ``want``; with ``exact`` the two are one set."""
    pos = np.full(size, -1, dtype=np.int64)
    pos[got] = np.arange(len(got))
    sel = pos[want]
    if (sel < 0).any() or (exact and len(got) != len(want)):
        raise StridedRedistributeError(
            f"strided step cannot produce rows {want.tolist()[:8]}... from {got.tolist()[:8]}..."
        )
    if len(sel) == t.shape[d] and np.array_equal(sel, np.arange(len(sel))):
        return t
    # runs of consecutive rows as slices: views and one cat, no index tensor to trace
    breaks = np.flatnonzero(np.diff(sel) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(sel)]])
    pieces = [t.narrow(d, int(sel[a]), int(b - a)) for a, b in zip(starts, ends)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=d)


# ---------------------------------------------------------------- helpers


def _on(p: Placement, d: int) -> bool:
    return is_shard(p) and p.dim == d


def _strided_on(p: Placement, d: int) -> bool:
    return isinstance(p, _StridedShard) and p.dim == d


def _part(placements: Sequence[Placement], d: int) -> tuple:
    """The sharding of tensor dim ``d``: what each mesh dim does to it."""
    return tuple(p if _on(p, d) else None for p in placements)


def _first_change(cur: Sequence[Placement], target: Sequence[Placement], d: int) -> int | None:
    """The first mesh dim whose sharding of tensor dim ``d`` differs, if any."""
    a, b = _part(cur, d), _part(target, d)
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def _strided_over_shard(cur: Sequence[Placement], target: Sequence[Placement], m: int, d: int) -> bool:
    """``target`` puts a strided shard where ``cur`` shards ``d`` plainly: gather, then cut."""
    return _strided_on(target[m], d) and _on(cur[m], d)


def _last_strided(placements: Sequence[Placement], d: int) -> int:
    return max((i for i, p in enumerate(placements) if _strided_on(p, d)), default=-1)


def _tp_first(placements: Sequence[Placement], i: int, sizes: Sequence[int]) -> bool:
    """``placements[i]`` strided with later plain shards of its dim whose sizes multiply to its factor."""
    p = placements[i]
    if not isinstance(p, _StridedShard):
        return False
    later = [j for j in range(i + 1, len(placements)) if _on(placements[j], p.dim)]
    return (
        bool(later)
        and not any(isinstance(placements[j], _StridedShard) for j in later)
        and math.prod(sizes[j] for j in later) == int(p.split_factor)
    )


def _plain(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    return tuple(Shard(p.dim) if isinstance(p, _StridedShard) else p for p in placements)


def _at(coord: Sequence[int], g: int, r: int) -> tuple[int, ...]:
    return tuple(r if i == g else c for i, c in enumerate(coord))
