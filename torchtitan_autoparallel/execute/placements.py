"""Placement comparisons the executor relies on.

Placements are compared after normalising negative shard dims,
because torch's rules and ours may spell ``Shard(-1)`` and ``Shard(ndim-1)``
differently for the same layout.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.tensor.placement_types import Placement, Shard, _StridedShard

from torchtitan_autoparallel.planner.strategies.placement import Placements


def normalise(placements: Sequence[Placement], ndim: int) -> Placements:
    """Shard dims made non-negative (``_StridedShard`` keeps its split factor)."""
    out: list[Placement] = []
    for p in placements:
        if isinstance(p, _StridedShard) and p.dim < 0:
            out.append(_StridedShard(p.dim + ndim, split_factor=p.split_factor))
        elif isinstance(p, Shard) and not isinstance(p, _StridedShard) and p.dim < 0:
            out.append(Shard(p.dim + ndim))
        else:
            out.append(p)
    return tuple(out)


def same_placements(a: Sequence[Placement], b: Sequence[Placement], ndim: int) -> bool:
    return normalise(a, ndim) == normalise(b, ndim)


def placements_text(placements: Sequence[Placement] | None) -> str:
    if placements is None:
        return "-"
    return "(" + ", ".join(str(p) for p in placements) + ")"
