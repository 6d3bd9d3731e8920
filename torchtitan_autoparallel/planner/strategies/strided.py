"""Strided-shard variants of the matmul family's rules (``[autoparallel] strided_sharding``).

A view that flattens a sharded dim into an earlier one cannot keep a plain
``Shard``: flattening a [B, S, D] activation sharded ``Shard(0)`` on dp and
``Shard(1)`` on tp into [B*S, D] leaves every tp rank a slice of each of its
B/dp samples. torch's view rule says so with ``_StridedShard(0, sf=B/dp)`` on
tp. Semantics (checked against torch 2.14's ``_split_tensor``): mesh dims cut
the local tensor left to right; ``_StridedShard(d, k)`` on a mesh dim of n
ranks splits the local dim into k equal chunks, each into n pieces, and rank
i keeps piece i of every chunk (in chunk order). So k is the number of
leading-dim groups (samples) the local tensor has when that mesh dim cuts it.

torch's matmul rules only ever fill their sharding placeholders with plain
``Shard``, so such an activation had to be gathered before every matmul. A
matmul shards one einsum dim per mesh dim (rows, columns, contraction or
batch) on every tensor that carries it, and rows, columns and batch entries
are independent while contraction terms may be summed in any order. So any
fixed permutation of that einsum dim, applied to every tensor carrying it,
gives the same local kernel: replacing every placeholder of a rule by
``_StridedShard(dim, k)`` is as valid as replacing it by ``Shard(dim)``.

We add those variants for the split factors the inputs can actually carry
(read off their candidate placements) on the mesh dim they carry them on,
and keep a full-mesh variant only when one input's placement is one of its
candidates: a strided shard nothing produces would only be priced and dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch.distributed.tensor._dtensor_spec import TensorMeta
from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from torchtitan_autoparallel.planner.strategies.placement import Placements

aten = torch.ops.aten

MATMUL_FAMILY = frozenset(
    {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten._scaled_mm.default,
    }
)
# torch rules ``t`` as a single-dim op (placeholders, plain Shard only), unlike
# the other views; the weight-gradient matmul reads the flattened activation
# through it, so it gets the same variants (a transpose moves every index
# along, which is all the argument above needs).
STRIDED_OPS = MATMUL_FAMILY | {aten.t.default}

# (input index, tensor dim, split factor) of a strided shard an input may carry.
Offer = tuple[int, int, int]


def has_strided(placements: Placements | None) -> bool:
    return placements is not None and any(isinstance(p, _StridedShard) for p in placements)


def offers(candidates: Sequence[Sequence[Placements]], in_metas: Sequence[TensorMeta], ndim: int) -> list[set[Offer]]:
    """Per mesh dim: the strided shards the inputs' producers can emit there."""
    out: list[set[Offer]] = [set() for _ in range(ndim)]
    for j, (cands, meta) in enumerate(zip(candidates, in_metas)):
        rank = len(meta.shape)
        for cand in cands:
            for i, p in enumerate(cand):
                if isinstance(p, _StridedShard):
                    out[i].add((j, p.dim % rank, int(p.split_factor)))
    return out


def memo_key(candidates: Sequence[Sequence[Placements]]) -> tuple:
    """What of the candidates the strided variants depend on (for the strategy memo)."""
    return tuple(frozenset(c for c in cands if has_strided(c)) for cands in candidates)


def strided_rules(
    rules: Iterable[list],
    per_dim_offers: list[set[Offer]],
    metas: Sequence[TensorMeta | None],
    n_out: int,
) -> list[list[list]]:
    """Per mesh dim: each rule whose placeholder meets an offer, strided with its factor.

    ``metas`` are the outputs' then the inputs' (the rule's positions).
    """
    rules = list(rules)
    per_dim: list[list[list]] = []
    for dim_offers in per_dim_offers:
        variants: dict[tuple, list] = {}
        for j, dim, k in sorted(dim_offers):
            for rule in rules:
                p = rule[n_out + j] if n_out + j < len(rule) else None
                if not isinstance(p, _ShardingPlaceholder) or _norm(p.dim, metas[n_out + j]) != dim:
                    continue
                variant = _strided(rule, k, metas)
                if variant is not None:
                    variants.setdefault(tuple(map(repr, variant)), variant)
        per_dim.append(list(variants.values()))
    return per_dim


def _strided(rule: list, k: int, metas: Sequence[TensorMeta | None]) -> list | None:
    """``rule`` with every placeholder a ``_StridedShard(dim, k)``; None unless they
    all cut one einsum dim (equal sizes), which the permutation argument needs."""
    sizes = {
        metas[pos].shape[p.dim]
        for pos, p in enumerate(rule)
        if isinstance(p, _ShardingPlaceholder) and metas[pos] is not None
    }
    if len(sizes) != 1:
        return None
    out: list[Placement | None] = []
    for pos, p in enumerate(rule):
        if isinstance(p, _ShardingPlaceholder):
            out.append(_StridedShard(_norm(p.dim, metas[pos]), split_factor=k))
        else:
            out.append(p)
    return out


def _norm(dim: int, meta: TensorMeta | None) -> int:
    return dim % len(meta.shape) if meta is not None and len(meta.shape) else dim


def keep_offered(strategies: list, candidates: Sequence[Sequence[Placements]]) -> list:
    """Plain strategies, and strided ones where some input's strided placement is
    one of its candidates (``strategies`` are ``strategy.Strategy``)."""
    sets = [set(c) for c in candidates]
    return [
        s
        for s in strategies
        if not any(map(has_strided, s.inputs)) or any(has_strided(p) and p in c for p, c in zip(s.inputs, sets))
    ]
