"""Placement changes as the plan prices them.

``DTensor.redistribute`` refuses Replicate -> Partial, which the planner's cost
model counts as free (and which strategies such as ``mean`` over a sharded
dim ask for on another mesh dim). It is a local step: a replicated value is a
valid Partial(avg/max/min) value as is, and a valid Partial(sum) value when
one rank of the mesh dim keeps it and the others hold zeros (exact, unlike
DTensor's internal ``v / n`` split). We do that step on the local tensor and
leave every collective to ``DTensor.redistribute``.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate

from torchtitan_autoparallel.execute.placements import normalise
from torchtitan_autoparallel.execute.strided import has_strided, redistribute_strided
from torchtitan_autoparallel.planner.strategies.placement import Placements


def redistribute_to(value: DTensor, mesh: DeviceMesh, target: Placements) -> DTensor:
    """``value`` moved to ``target``: local Replicate -> Partial steps, then DTensor's collectives."""
    target = normalise(target, value.ndim)
    if normalise(value.placements, value.ndim) == target:
        return value
    if has_strided(value.placements) or has_strided(target):
        # DTensor gets some of these wrong; strided.py does them explicitly.
        return redistribute_strided(value, mesh, target, _redistribute_plain)
    return _redistribute_plain(value, mesh, target)


def _redistribute_plain(value: DTensor, mesh: DeviceMesh, target: Placements) -> DTensor:
    value = _replicate_to_partial(value, mesh, target)
    if tuple(value.placements) == target:
        return value
    return value.redistribute(mesh, target)


def _replicate_to_partial(value: DTensor, mesh: DeviceMesh, target: Placements) -> DTensor:
    dims = [
        i
        for i, (src, dst) in enumerate(zip(value.placements, target))
        if isinstance(src, Replicate) and isinstance(dst, Partial)
    ]
    if not dims:
        return value
    local = value.to_local()
    placements: list[Placement] = list(value.placements)
    for i in dims:
        partial = target[i]
        assert isinstance(partial, Partial)
        if partial.reduce_op == "sum" and mesh.get_local_rank(i) != 0:
            local = torch.zeros_like(local)
        elif partial.reduce_op not in ("sum", "avg", "max", "min"):
            raise ValueError(f"cannot turn Replicate into {partial}")
        placements[i] = partial
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=value.shape, stride=value.stride()
    )
