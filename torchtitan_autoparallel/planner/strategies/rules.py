"""Our own sharding rules, for ops where torch's DTensor has none or too few.

A rule has the shape of DTensor's single-dimension strategies: given the op
and its arguments (tensors replaced by ``TensorMeta``), it lists the valid
placement combinations over ONE mesh dim, outputs first, then every tensor
input in argument order. ``strategy.py`` expands a rule to the full mesh the
same way it expands torch's single-dim rules, so both are treated alike.

Why these rules exist: on CPU, SDPA runs ``_scaled_dot_product_flash_attention
_for_cpu`` (and its backward), which torch 2.14 only handles by decomposing
(forward) or not at all (backward); without a rule attention would be
replicated over the whole mesh.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.distributed.tensor._dtensor_spec import TensorMeta
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from torchtitan_autoparallel.compat import torch_single_dim_rule

aten = torch.ops.aten

Rule = list[Placement | None]
RuleFn = Callable[[torch._ops.OpOverload, tuple, dict], list[Rule]]

# Attention tensors are (batch, heads, seq, head_dim) and the logsumexp
# (batch, heads, seq): every head and every sample attends independently, so
# sharding batch (dim 0) or heads (dim 1) of all of them at once is exact.
_INDEPENDENT_DIMS = (0, 1)


def _mask_placement(mask: TensorMeta | None, dim: int, full: int) -> Placement | None:
    """A mask broadcasts over batch/heads when that dim is 1: keep it whole then."""
    if mask is None:
        return None
    return Shard(dim) if mask.shape[dim] == full else Replicate()


def _attention_rules(
    n_outputs: int, tensors: Sequence[TensorMeta], mask: TensorMeta | None
) -> list[Rule]:
    rules: list[Rule] = []
    for dim in _INDEPENDENT_DIMS:
        full = tensors[0].shape[dim]
        # GQA passes fewer key/value heads; they shard the same way when divisible.
        rule: Rule = [Shard(dim)] * (n_outputs + len(tensors))
        if mask is not None:
            rule.append(_mask_placement(mask, dim, full))
        rules.append(rule)
    rules.append([Replicate()] * (n_outputs + len(tensors) + (mask is not None)))
    return rules


def cpu_flash_attention_rule(op, args: tuple, kwargs: dict) -> list[Rule]:
    """(output, logsumexp) <- (query, key, value[, attn_mask])."""
    q, k, v = args[:3]
    return _attention_rules(2, [q, k, v], kwargs.get("attn_mask"))


def cpu_flash_attention_backward_rule(op, args: tuple, kwargs: dict) -> list[Rule]:
    """(grad_q, grad_k, grad_v) <- (grad_out, q, k, v, out, logsumexp[, attn_mask])."""
    return _attention_rules(3, list(args[:6]), kwargs.get("attn_mask"))


_NONE, _MEAN, _SUM = 0, 1, 2  # torch's Reduction


def _nll_loss_forward_base(args: tuple) -> list[Rule]:
    """A 2-D loss's rules where torch lists none over one mesh dim (torch 2.11): the
    batch dim sharded for reduction "none" (output sharded alike) and "sum" (partial
    sums); the class dim must stay whole. All-replicated is added by the expansion."""
    logits, weight, reduction = args[0], args[2], args[3]
    keep = [Replicate()] if weight is not None else []
    if len(logits.shape) != 2 or reduction not in (_NONE, _SUM):
        return []
    if reduction == _NONE:
        return [[Shard(0), Replicate(), Shard(0), Shard(0), *keep]]
    return [[Partial("sum"), Partial("sum"), Shard(0), Shard(0), *keep]]


def nll_loss_forward_rule(op, args: tuple, kwargs: dict) -> list[Rule]:
    """torch's rules, plus batch sharding for reduction="mean".

    torch gives a mean loss no sharded rule because the mean of per-shard
    means equals the global mean only when every shard counts the same number
    of non-ignored targets. Our batches are packed fixed-length sequences
    without ignored tokens, so that holds: the loss is Partial(avg) and the
    target count Partial(sum) (the backward asks for it replicated, one
    scalar all-reduce).
    """
    torch_rule = torch_single_dim_rule(op)
    rules = list(torch_rule(op, args, kwargs)) if torch_rule else _nll_loss_forward_base(args)
    logits, weight, reduction = args[0], args[2], args[3]
    if reduction != _MEAN or len(logits.shape) != 2:
        return rules
    rule: Rule = [Partial("avg"), Partial("sum"), Shard(0), Shard(0)]
    if weight is not None:
        rule.append(Replicate())
    return rules + [rule]


def nll_loss_backward_rule(op, args: tuple, kwargs: dict) -> list[Rule]:
    """torch's rules; where it lists none over one mesh dim (torch 2.11), the batch dim
    sharded (grad_input <- grad_out, logits, target[, weight], total_weight): grad_out
    follows the target without reduction and is a whole scalar with one; total_weight
    stays whole (the mean divides by the global count)."""
    torch_rule = torch_single_dim_rule(op)
    if torch_rule is not None:
        return list(torch_rule(op, args, kwargs))
    logits, weight, reduction = args[1], args[3], args[4]
    if len(logits.shape) != 2:
        return []
    keep = [Replicate()] if weight is not None else []
    grad_out = Shard(0) if reduction == _NONE else Replicate()
    return [[Shard(0), grad_out, Shard(0), Shard(0), *keep, Replicate()]]


RULES: dict[torch._ops.OpOverload, RuleFn] = {
    aten.nll_loss_forward.default: nll_loss_forward_rule,
    aten.nll_loss_backward.default: nll_loss_backward_rule,
    aten._scaled_dot_product_flash_attention_for_cpu.default: cpu_flash_attention_rule,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: cpu_flash_attention_backward_rule,
}

# Ops that are pure metadata or bookkeeping; strategies follow the input and
# the kernel costs nothing (used by the compute-cost model too).
VIEW_OPS = frozenset(
    {
        aten.view.default,
        aten._unsafe_view.default,
        aten.reshape.default,
        aten.t.default,
        aten.transpose.int,
        aten.permute.default,
        aten.expand.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.unsqueeze.default,
        aten.slice.Tensor,
        aten.select.int,
        aten.split.Tensor,
        aten.split_with_sizes.default,
        aten.alias.default,
        aten.detach.default,
        aten.view_as_real.default,
        aten.view_as_complex.default,
        aten._conj.default,
    }
)


def our_rule(op: object) -> RuleFn | None:
    return RULES.get(op)  # type: ignore[arg-type]
