"""Keep local shards in the memory layout the trace saw.

A redistribution changes a tensor's memory layout: gathering the head dim of
attention's (batch, heads, seq, dim) output, which the kernel lays out as
(batch, seq, heads, dim), returns a plain contiguous tensor. The joint graph
was traced on the unsharded layout, and its ``view`` nodes are only valid for
that layout (``view(transpose(x), ...)`` needs the transpose to be
contiguous). So after every redistribution the local tensor is copied into
the traced dim order when it differs; kernels then also see the same layouts
as a single-device run.
"""

from __future__ import annotations

import torch
from torch._prims_common import compute_elementwise_output_logical_to_physical_perm
from torch.distributed.tensor import DTensor


def physical_order(t: torch.Tensor) -> tuple[int, ...]:
    """Dims from outermost to innermost in memory (size-1 dims do not matter)."""
    perm, _ = compute_elementwise_output_logical_to_physical_perm(t)
    return tuple(perm)


def in_order_of(t: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``t`` stored in ``reference``'s dim order (``t`` itself when it already is)."""
    if t.ndim < 2 or t.numel() == 0:
        return t
    want = physical_order(reference)
    # Dense in the wanted dim order (size-1 dims may sit anywhere): nothing to do.
    if t.permute(want).is_contiguous():
        return t
    fixed = torch.empty_permuted(t.shape, want, dtype=t.dtype, device=t.device)
    fixed.copy_(t)
    return fixed


def match_layout(value: DTensor, traced: torch.Tensor) -> DTensor:
    """``value`` with its local shard in ``traced``'s dim order (copied only when needed)."""
    local = value._local_tensor
    fixed = in_order_of(local, traced)
    if fixed is local:
        return value
    return DTensor.from_local(
        fixed, value.device_mesh, value.placements, run_check=False, shape=traced.shape, stride=traced.stride()
    )
