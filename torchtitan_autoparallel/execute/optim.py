"""AdamW over the planned DTensor parameters, and clipping by the global gradient norm.

AdamW's state is created with ``zeros_like(param)``, so it is sharded exactly
like its parameter. ``foreach=False`` keeps each DTensor on the per-parameter
path, which gives the same update as an unsharded run (and matches
``train/optim.py``).

The global norm is computed with ONE all-reduce: each rank sums the squares of
its local gradient shards, divided by the number of ranks holding a copy of
that shard (the sizes of the mesh dims the gradient is replicated on), so
every element counts exactly once. Gradients are in their parameters'
placements (Shard or Replicate, never Partial) when this runs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate

from torchtitan_autoparallel.execute.step import PlannedStep


def build_adamw(
    planned: PlannedStep,
    lr: float,
    *,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    weight_decay: float = 0.1,
) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        list(planned.parameters()), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False
    )


def set_gradients(planned: PlannedStep, grads: dict[str, DTensor]) -> None:
    """Attach ``step``'s gradients to the parameters, checking they are placed alike."""
    for fqn, param in planned.params.items():
        grad = grads[fqn]
        if tuple(grad.placements) != tuple(param.placements):
            raise ValueError(f"{fqn}: gradient {grad.placements} vs parameter {param.placements}")
        param.grad = grad


def global_grad_norm(params: Iterable[nn.Parameter], mesh: DeviceMesh, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all gradients viewed as one vector, equal on every rank."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), device=mesh.device_type)
    inf = math.isinf(norm_type)
    parts = []
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        if inf:
            parts.append(local.detach().abs().max().float())
        else:
            copies = _copies(g, mesh)
            parts.append(torch.linalg.vector_norm(local.detach().float(), norm_type) ** norm_type / copies)
    total = torch.stack(parts).max() if inf else torch.stack(parts).sum()
    _all_reduce(total, mesh, dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
    return total if inf else total ** (1.0 / norm_type)


def clip_grad_norm(
    params: Iterable[nn.Parameter], mesh: DeviceMesh, max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Scale gradients in place so their global norm is at most ``max_norm``; return the norm.

    Same formula as ``torch.nn.utils.clip_grad_norm_`` (coefficient
    ``max_norm / (norm + 1e-6)`` clamped to 1), so it matches an unsharded run.
    """
    params = list(params)
    total = global_grad_norm(params, mesh, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            local = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
            local.mul_(coef.to(local.dtype))
    return total


def optimizer_step(
    planned: PlannedStep,
    optimizer: torch.optim.Optimizer,
    grads: dict[str, DTensor],
    max_norm: float | None,
) -> torch.Tensor | None:
    """Attach gradients, clip (when ``max_norm``), step, and free the gradients."""
    set_gradients(planned, grads)
    norm = clip_grad_norm(planned.parameters(), planned.mesh, max_norm) if max_norm else None
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def _copies(g: torch.Tensor, mesh: DeviceMesh) -> int:
    """How many ranks hold each element of ``g``'s local shard."""
    if not isinstance(g, DTensor):
        return mesh.size()
    if any(isinstance(p, Partial) for p in g.placements):
        raise ValueError("a Partial gradient reached clipping; move it to its parameter's placement first")
    return math.prod(mesh.size(i) for i, p in enumerate(g.placements) if isinstance(p, Replicate))


def _all_reduce(t: torch.Tensor, mesh: DeviceMesh, op: dist.ReduceOp) -> None:
    if not dist.is_initialized() or mesh.size() == 1:
        return
    if mesh.size() == dist.get_world_size():
        dist.all_reduce(t, op=op)
        return
    for i in range(mesh.ndim):  # the mesh is a sub-world: reduce dim by dim
        dist.all_reduce(t, op=op, group=mesh.get_group(i))
