"""Run a CPU-traced graph on another device (CUDA): the two things the trace pins to CPU.

The planner traces on fake CPU tensors (so attention shows up as the CPU
flash kernel its rules know). Two traces of that choice break on a GPU:

1. ``device=cpu`` keyword arguments: ``_to_copy`` nodes (the casts of mixed
   precision, the loss's ``.float()``) record the trace's device and would
   copy GPU shards to the host. ``retarget_device`` rewrites them to the
   mesh's device.
2. ``_scaled_dot_product_flash_attention_for_cpu`` and its backward have a
   CPU kernel only. On other devices the local shards run through
   ``F.scaled_dot_product_attention`` (any backend the device has); the
   backward recomputes the attention forward under autograd and
   differentiates it (exact gradients; one extra attention forward per
   layer). The forward's logsumexp output is only read by that backward,
   which no longer needs it, so zeros of the traced shape stand in for it.

Both are checked on CPU by forcing the substitutes (tests/execute/test_execute.py);
no GPU has run them yet.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from torchtitan_autoparallel.execute.layout import in_order_of

aten = torch.ops.aten
CPU_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
CPU_FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def retarget_device(kwargs: dict[str, Any], device: torch.device | None) -> dict[str, Any]:
    """``kwargs`` with every ``torch.device`` replaced by ``device`` (where the shards live).

    Returned unchanged on CPU, where the trace's devices are already right.
    """
    if device is None or device.type == "cpu":
        return kwargs
    if not any(isinstance(v, torch.device) for v in kwargs.values()):
        return kwargs
    return tree_map(lambda v: device if isinstance(v, torch.device) else v, kwargs)


def check_logsumexp_users(graph: torch.fx.Graph) -> None:
    """The stand-in forward returns no real logsumexp: only the attention backward may read it."""
    for node in graph.nodes:
        if node.target is not CPU_FLASH:
            continue
        for user in node.users:
            if user.args[1] == 1 and any(u.target is not CPU_FLASH_BACKWARD for u in user.users):
                raise NotImplementedError(f"{user.name}: the logsumexp of {node.name} is read outside its backward")


def substitute(op: object, device_type: str, force: bool = False) -> Callable | None:
    """A device-portable stand-in for a CPU-only kernel, or None when ``op`` runs as is."""
    if device_type == "cpu" and not force:
        return None
    return {CPU_FLASH: attention_forward, CPU_FLASH_BACKWARD: attention_backward}.get(op)


def _sdpa(q, k, v, dropout_p: float, is_causal: bool, attn_mask, scale) -> torch.Tensor:
    if dropout_p:
        raise NotImplementedError("the portable attention stand-in has no dropout")
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def attention_forward(
    q, k, v, dropout_p: float = 0.0, is_causal: bool = False, *, attn_mask=None, scale=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, logsumexp placeholder) like the CPU flash kernel."""
    out = _sdpa(q, k, v, dropout_p, is_causal, attn_mask, scale)
    # The CPU kernel lays its output out like the query (torchtitan's query is
    # a transposed (B, L, H, D) tensor); the graph's transpose + view after it
    # rely on that layout.
    out = in_order_of(out, q)
    lse = torch.zeros(q.shape[:3], dtype=torch.float32, device=q.device)
    return out, lse


def attention_backward(
    grad_out, q, k, v, out, logsumexp, dropout_p: float, is_causal: bool, *, attn_mask=None, scale=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_q, grad_k, grad_v) by differentiating a recomputed forward."""
    del out, logsumexp  # recomputed: the stand-in forward does not produce a usable logsumexp
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        recomputed = _sdpa(*leaves, dropout_p, is_causal, attn_mask, scale)
        grads = torch.autograd.grad(recomputed, leaves, grad_out)
    return tuple(grads)  # type: ignore[return-value]
