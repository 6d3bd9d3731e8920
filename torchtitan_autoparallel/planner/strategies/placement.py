"""Placements on a named mesh: enumeration, shardability, local shapes, labels.

A placement tuple has one DTensor placement per mesh dim, mesh dim 0 first.
The mesh knobs (which dims are data-parallel, which are tensor-parallel) are
turned into allowed placements here, so strategy enumeration and problem
building stay unaware of them.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard, _StridedShard

Placements = tuple[Placement, ...]

DP_REPLICATE = "dp_replicate"
DP_SHARD = "dp_shard"
TP = "tp"
MESH_DIM_NAMES = (DP_REPLICATE, DP_SHARD, TP)
DATA_PARALLEL = (DP_REPLICATE, DP_SHARD)


@dataclass(frozen=True)
class MeshSpec:
    """The planner's view of a mesh: names and sizes, nothing distributed."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        unknown = [n for n in self.names if n not in MESH_DIM_NAMES]
        if unknown or len(set(self.names)) != len(self.names):
            raise ValueError(
                f"mesh dim names {self.names}: each must be one of {MESH_DIM_NAMES}, once"
            )
        if len(self.names) != len(self.sizes):
            raise ValueError(f"mesh names {self.names} and sizes {self.sizes} differ in length")

    @classmethod
    def from_device_mesh(cls, mesh: DeviceMesh) -> MeshSpec:
        if mesh.mesh_dim_names is None:
            raise ValueError(f"the mesh needs dim names among {MESH_DIM_NAMES}")
        return cls(tuple(mesh.mesh_dim_names), tuple(int(s) for s in mesh.mesh.shape))

    @property
    def ndim(self) -> int:
        return len(self.names)

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    def dims_named(self, names: Sequence[str]) -> list[int]:
        return [i for i, n in enumerate(self.names) if n in names]


def label(placements: Sequence[Placement]) -> str:
    return placements_str(placements)


def is_shard(p: Placement) -> bool:
    """Shard or _StridedShard: torch 2.14's _StridedShard is no Shard subclass."""
    return isinstance(p, (Shard, _StridedShard))


def shard_factor(shape: Sequence[int], placements: Sequence[Placement], mesh: MeshSpec) -> int:
    """How many pieces a tensor is cut into (the divisor of its per-device bytes)."""
    del shape  # kept in the signature: uneven sharding would need it
    return math.prod(n for p, n in zip(placements, mesh.sizes) if is_shard(p))


def local_shape(shape: Sequence[int], placements: Sequence[Placement], sizes: Sequence[int]) -> tuple[int, ...]:
    """Per-device shape (ceil division; Partial and Replicate keep the full size).

    A strided shard holds as many elements as a plain one, only not contiguous.
    """
    dims = list(shape)
    for p, n in zip(placements, sizes):
        if is_shard(p):
            dims[p.dim] = -(-dims[p.dim] // n)
    return tuple(dims)


def is_evenly_shardable(shape: Sequence[int], placements: Sequence[Placement], sizes: Sequence[int]) -> bool:
    """Every sharded tensor dim splits evenly over the mesh dims sharding it.

    We only plan even shards: the executor and the cost model then agree on
    every local shape, and no rank idles on padding. Mesh dims cut the local
    tensor left to right; a _StridedShard(d, k) cuts each of its k chunks, so
    the local size must split into k * n.
    """
    dims = list(shape)
    for p, n in zip(placements, sizes):
        if not is_shard(p):
            continue
        d = p.dim if p.dim >= 0 else p.dim + len(shape)
        if not 0 <= d < len(shape):
            return False
        # On a size-1 mesh dim a strided shard is the whole tensor, whatever k.
        pieces = n * int(p.split_factor) if isinstance(p, _StridedShard) and n > 1 else n
        if dims[d] % pieces or dims[d] < pieces:
            return False
        dims[d] //= n
    return True


def tensor_placements(shape: Sequence[int], mesh: MeshSpec) -> list[Placements]:
    """Every Replicate/Shard combination that splits ``shape`` evenly (no Partial)."""
    per_mesh_dim = [Replicate()] + [Shard(d) for d in range(len(shape))]
    return [
        combo
        for combo in itertools.product(per_mesh_dim, repeat=mesh.ndim)
        if is_evenly_shardable(shape, combo, mesh.sizes)
    ]


def parameter_placements(shape: Sequence[int], mesh: MeshSpec) -> list[Placements]:
    """Placements a parameter may take: Replicate on dp_replicate (DDP), free elsewhere."""
    pinned = mesh.dims_named([DP_REPLICATE])
    return [c for c in tensor_placements(shape, mesh) if all(isinstance(c[i], Replicate) for i in pinned)]


def batch_placement(shape: Sequence[int], mesh: MeshSpec) -> Placements:
    """The input batch: Shard(0) on every data-parallel dim, Replicate on tp."""
    combo = tuple(Shard(0) if n in DATA_PARALLEL else Replicate() for n in mesh.names)
    if not is_evenly_shardable(shape, combo, mesh.sizes):
        dp = math.prod(s for n, s in zip(mesh.names, mesh.sizes) if n in DATA_PARALLEL)
        raise ValueError(
            f"global batch {shape[0]} does not split over {dp} data-parallel ranks; "
            f"use a multiple of {dp}"
        )
    return combo


def replicated(mesh: MeshSpec) -> Placements:
    return tuple(Replicate() for _ in range(mesh.ndim))


def has_partial(placements: Sequence[Placement] | None) -> bool:
    return placements is not None and any(isinstance(p, Partial) for p in placements)


_TOKEN = re.compile(r"SS\((-?\d+),(\d+)\)|S\((-?\d+)\)|P(?:\((\w+)\))?|R")


def placement_str(p: Placement) -> str:
    """Short label: S(0), SS(0,k) (strided, split factor k), R, P or P(op) for non-sum."""
    if isinstance(p, _StridedShard):
        return f"SS({p.dim},{p.split_factor})"
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        return "P" if p.reduce_op == "sum" else f"P({p.reduce_op})"
    raise ValueError(f"unsupported placement {p!r}")


def placements_str(ps: Sequence[Placement]) -> str:
    """Labels joined without separator, mesh dim 0 first: e.g. ``S(0)R``."""
    return "".join(placement_str(p) for p in ps)


def _from_match(m: re.Match[str]) -> Placement:
    if m.group(1) is not None:
        return _StridedShard(int(m.group(1)), split_factor=int(m.group(2)))
    if m.group(3) is not None:
        return Shard(int(m.group(3)))
    if m.group(0).startswith("P"):
        return Partial(m.group(4) or "sum")
    return Replicate()


def parse_placement(s: str) -> Placement:
    """Inverse of ``placement_str``."""
    m = _TOKEN.fullmatch(s.strip())
    if m is None:
        raise ValueError(f"cannot parse placement {s!r}; expected S(d), SS(d,k), R, P or P(op)")
    return _from_match(m)


def parse_placements(s: str) -> tuple[Placement, ...]:
    """Inverse of ``placements_str``; spaces, brackets and separating commas are ignored."""
    text = re.sub(r"[\s\[\]]", "", s)
    out, pos = [], 0
    while pos < len(text):
        if text[pos] == ",":  # separator between labels (SS(d,k) consumes its own comma)
            pos += 1
            continue
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ValueError(f"cannot parse placements {s!r} at {text[pos:]!r}")
        out.append(_from_match(m))
        pos = m.end()
    return tuple(out)
