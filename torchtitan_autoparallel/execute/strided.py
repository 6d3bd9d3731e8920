"""Redistributions from or to ``_StridedShard``, done explicitly.

torch 2.14's ``DTensor.redistribute`` handles a strided shard that is alone on
its tensor dim, but with another mesh dim sharding the same tensor dim it
raises or, worse, returns wrong values (e.g. ``(R, _S(0,8)) -> (S(0),
_S(0,4))`` and ``(_S(0,8), _S(0,4)) -> (R, R)`` on a 2x2 mesh; see
tests/test_strided.py). So any redistribution with a strided shard on either
side runs here, in three phases that only ever hand DTensor plain placements:

1. every tensor dim whose strided sharding changes is gathered: an all-gather
   per mesh dim, innermost first (or the strided mesh dim alone when it is
   FSDP2+TP's order, see ``cost_model._nesting_blocked``), each followed by a
   local reorder;
2. the rest is a plain redistribution: a strided dim left unchanged is read
   as ``Shard`` of a permuted tensor, which DTensor moves like any other
   (it never touches that dim's sharding);
3. every target strided dim is cut from the gathered one locally (free).

Which global indices a rank holds is computed from the placements
(``held``), and each reorder is checked against it, so a wrong step fails
loudly instead of training on scrambled rows. The collectives are those the
cost model prices: an all-gather for each mesh dim a strided shard leaves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard, _StridedShard

from torchtitan_autoparallel.execute.placements import normalise
from torchtitan_autoparallel.planner.placement import Placements, is_shard


class StridedRedistributeError(RuntimeError):
    """A strided redistribution step would not produce the planned rows."""


def has_strided(placements: Sequence[Placement]) -> bool:
    return any(isinstance(p, _StridedShard) for p in placements)


def held(size: int, placements: Sequence[Placement], sizes: Sequence[int], coord: Sequence[int], d: int) -> torch.Tensor:
    """Global indices along tensor dim ``d`` the rank at ``coord`` holds, in local order.

    Mesh dims cut the local tensor left to right; ``_StridedShard(d, k)`` on n
    ranks splits it into k chunks of n pieces and keeps piece ``coord`` of each.
    """
    idx = torch.arange(size)
    for p, n, c in zip(placements, sizes, coord):
        if not is_shard(p) or p.dim != d:
            continue
        k = int(p.split_factor) if isinstance(p, _StridedShard) else 1
        idx = idx.view(k, n, -1)[:, c, :].reshape(-1)
    return idx


def redistribute_strided(value: DTensor, mesh: DeviceMesh, target: Placements, plain) -> DTensor:
    """``value`` moved to ``target``; ``plain(value, mesh, target)`` does plain placements."""
    shape, sizes = tuple(value.shape), tuple(mesh.mesh.shape)
    coord = tuple(mesh.get_coordinate() or ())
    cur, local = list(normalise(value.placements, value.ndim)), value.to_local()
    for d in range(len(shape)):
        if _has_strided_on(cur, d) and _part(cur, d) != _part(target, d):
            for g in _gather_dims(cur, target, d, sizes):
                local, cur = _gather(local, mesh, g, d, cur, shape, coord)
    pre = _before_cut(cur, target, sizes)
    if tuple(cur) != tuple(pre):
        mid = DTensor.from_local(local, mesh, _plain(cur), run_check=False, shape=value.shape, stride=value.stride())
        local = plain(mid, mesh, _plain(pre)).to_local()
    for d in range(len(shape)):
        if _part(pre, d) != _part(target, d):
            local = _cut(local, d, shape[d], pre, target, sizes, coord)
    return DTensor.from_local(local, mesh, tuple(target), run_check=False, shape=value.shape, stride=value.stride())


# ---------------------------------------------------------------- phases


def _gather_dims(cur: Sequence[Placement], target: Sequence[Placement], d: int, sizes: Sequence[int]) -> list[int]:
    """Mesh dims to all-gather so that tensor dim ``d`` holds no strided shard, innermost first."""
    mine = [i for i, p in enumerate(cur) if _on(p, d)]
    start = next(i for i in mine if isinstance(cur[i], _StridedShard) or cur[i] != target[i])
    diff = [i for i in range(len(cur)) if (_on(cur[i], d) or _on(target[i], d)) and cur[i] != target[i]]
    if diff == [start] and not _on(target[start], d) and _tp_first(cur, start, sizes):
        return [start]
    return [i for i in reversed(mine) if i >= start]


def _before_cut(cur: Sequence[Placement], target: Sequence[Placement], sizes: Sequence[int]) -> list[Placement]:
    """``target`` with each changing strided tensor dim left gathered (phase 3 cuts it)."""
    pre = list(target)
    for d in {p.dim for p in target if isinstance(p, _StridedShard)}:
        if _part(cur, d) == _part(target, d):
            continue
        first = next(i for i, p in enumerate(target) if _on(p, d) and isinstance(p, _StridedShard))
        # FSDP2+TP's order: the later plain shards stay, the strided one is cut alone.
        keep_later = _tp_first(target, first, sizes)
        for i, p in enumerate(target):
            if _on(p, d) and (i == first or (i > first and not keep_later)):
                pre[i] = Replicate()
    return pre


def _gather(local, mesh, g, d, cur, shape, coord) -> tuple[torch.Tensor, list[Placement]]:
    new = list(cur)
    new[g] = Replicate()
    sizes = tuple(mesh.mesh.shape)
    gathered = funcol.all_gather_single(local.contiguous(), d, (mesh, g))
    if isinstance(gathered, funcol.AsyncCollectiveTensor):
        gathered = gathered.wait()
    got = torch.cat([held(shape[d], cur, sizes, _at(coord, g, r), d) for r in range(sizes[g])])
    want = held(shape[d], new, sizes, coord, d)
    return _reorder(gathered, d, got, want, shape[d], exact=True), new


def _cut(local, d, size, pre, target, sizes, coord) -> torch.Tensor:
    got, want = held(size, pre, sizes, coord, d), held(size, target, sizes, coord, d)
    return _reorder(local, d, got, want, size, exact=False)


def _reorder(t: torch.Tensor, d: int, got: torch.Tensor, want: torch.Tensor, size: int, exact: bool) -> torch.Tensor:
    """``t`` (rows ``got`` along ``d``) as rows ``want``; with ``exact`` the two are one set."""
    pos = torch.full((size,), -1, dtype=torch.long)
    pos[got] = torch.arange(len(got))
    sel = pos[want]
    if bool((sel < 0).any()) or (exact and len(got) != len(want)):
        raise StridedRedistributeError(f"strided step cannot produce rows {want.tolist()[:8]}... from {got.tolist()[:8]}...")
    if torch.equal(sel, torch.arange(len(got))):
        return t
    return t.index_select(d, sel.to(t.device))


# ---------------------------------------------------------------- helpers


def _on(p: Placement, d: int) -> bool:
    return is_shard(p) and p.dim == d


def _part(placements: Sequence[Placement], d: int) -> tuple:
    """The sharding of tensor dim ``d``: what each mesh dim does to it."""
    return tuple(p if _on(p, d) else None for p in placements)


def _has_strided_on(placements: Sequence[Placement], d: int) -> bool:
    return any(isinstance(p, _StridedShard) and p.dim == d for p in placements)


def _tp_first(placements: Sequence[Placement], i: int, sizes: Sequence[int]) -> bool:
    """``placements[i]`` strided with later plain shards of its dim whose sizes multiply to its factor."""
    p = placements[i]
    later = [j for j in range(i + 1, len(placements)) if _on(placements[j], p.dim)]
    return (
        isinstance(p, _StridedShard)
        and bool(later)
        and all(not isinstance(placements[j], _StridedShard) for j in later)
        and math.prod(sizes[j] for j in later) == int(p.split_factor)
    )


def _plain(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    return tuple(Shard(p.dim) if isinstance(p, _StridedShard) else p for p in placements)


def _at(coord: Sequence[int], g: int, r: int) -> tuple[int, ...]:
    return tuple(r if i == g else c for i, c in enumerate(coord))
