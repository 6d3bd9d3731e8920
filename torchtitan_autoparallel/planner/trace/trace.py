"""Trace one training step (forward, loss, backward) into a single aten FX graph.

The model lives on the meta device; we trace on fake CPU tensors so a 70B model
costs no memory and SDPA dispatches to its CPU flash kernel (the op our
attention rules know). The traced function is

    (params, buffers, tokens, labels) -> (loss, grads)

built from ``torch.func.functional_call`` and ``torch.autograd.grad``, so the
graph holds the backward down to every parameter gradient.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx

from torchtitan_autoparallel.models.loss import cross_entropy_loss
from torchtitan_autoparallel.planner.trace.recompute import checkpointed_blocks, describe, tagged_blocks

log = logging.getLogger("torchtitan_autoparallel.planner")

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class BatchSpec:
    """Global shapes and dtypes of the model input and the labels.

    LLMs take (batch, seq) token ids for both; small test models may take
    float features. Dim 0 is always the batch dim the data-parallel axes split.
    """

    input_shape: tuple[int, ...]
    labels_shape: tuple[int, ...]
    input_dtype: torch.dtype = torch.long
    labels_dtype: torch.dtype = torch.long

    @classmethod
    def tokens(cls, batch_size: int, seq_len: int) -> BatchSpec:
        return cls((batch_size, seq_len), (batch_size, seq_len))


@dataclass
class TracedStep:
    """The joint graph and the roles of its placeholders and outputs."""

    graph: fx.GraphModule
    params: dict[str, fx.Node]  # parameter FQN -> placeholder (in the master dtype)
    buffers: dict[str, fx.Node]  # buffer FQN -> placeholder
    tokens: fx.Node
    labels: fx.Node
    loss: fx.Node
    grads: dict[str, fx.Node]  # parameter FQN -> node producing its gradient
    # Node that casts a gradient up to the reduce dtype; its input must not be
    # reduced before the cast (mixed precision with fp32 reduction).
    grad_casts: dict[str, fx.Node]
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    activation_checkpoint: str = "none"  # the recompute mode traced (recompute.py), or its runs of blocks
    block_recompute: tuple[str, ...] = ()  # each block's mode, when they differ

    @property
    def num_ops(self) -> int:
        return sum(1 for n in self.graph.graph.nodes if n.op == "call_function")


def trace_training_step(
    model: nn.Module,
    batch_size: int,
    seq_len: int,
    *,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    loss_fn: LossFn = cross_entropy_loss,
    batch: BatchSpec | None = None,
    activation_checkpoint: str | Sequence[str] = "none",
) -> TracedStep:
    """Trace ``loss_fn(model(tokens), labels)`` and its parameter gradients.

    ``batch`` overrides the (batch_size, seq_len) token batch for non-LLM models.
    ``activation_checkpoint`` ("none", "full", "selective", or one of them per
    block) recomputes transformer blocks in the backward; the recomputation is
    part of the graph (``recompute.py``).
    """
    batch = batch or BatchSpec.tokens(batch_size, seq_len)
    names = [n for n, _ in model.named_parameters()]
    buffer_names = [n for n, _ in model.named_buffers()]
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    with fake_mode:
        params = {n: _fake_like(p) for n, p in model.named_parameters()}
        buffers = {n: _fake_like(b) for n, b in model.named_buffers()}
        tokens = torch.empty(batch.input_shape, dtype=batch.input_dtype)
        labels = torch.empty(batch.labels_shape, dtype=batch.labels_dtype)
    for p in params.values():
        p.requires_grad_(True)
    mixed = param_dtype != next(iter(params.values())).dtype

    joint = _JointStep(model, loss_fn)

    casts: dict[int, torch.Tensor] = {}  # id(master) -> its compute-dtype copy, once made

    def step(ps, bs, tok, lab):
        # Mixed precision as FSDP2 does it: compute in param_dtype from a cast
        # of the master weight, so the graph shows the cast and the plan
        # chooses which side of it to gather on; gradients come back through
        # the cast (or an explicit one to reduce_dtype).
        if mixed and reduce_dtype == param_dtype:
            wrt = lambda: [casts[id(ps[n])] for n in names]  # noqa: E731  (made in the forward)
        else:
            wrt = lambda: [ps[n] for n in names]  # noqa: E731
        state = {f"model.{k}": v for k, v in {**ps, **bs}.items()}
        loss, grads = functional_call(joint, state, (tok, lab, wrt))
        if mixed and reduce_dtype == param_dtype:
            grads = [g.to(ps[n].dtype) for n, g in zip(names, grads)]
        return loss, list(grads)

    cast_to = param_dtype if mixed else None
    with checkpointed_blocks(model, activation_checkpoint), tagged_blocks(model), _cast_when_used(model, cast_to, casts):
        gm = make_fx(step, tracing_mode="fake", record_module_stack=True)(params, buffers, tokens, labels)
    _remove_inplace(gm)
    _drop_aliases(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    traced = _identify(gm, names, buffer_names, param_dtype, reduce_dtype, mixed)
    if isinstance(activation_checkpoint, str):
        traced.activation_checkpoint = activation_checkpoint
    else:
        traced.activation_checkpoint = describe(activation_checkpoint)
        traced.block_recompute = tuple(activation_checkpoint) if len(set(activation_checkpoint)) > 1 else ()
    log.info("trace: %d ops, %d parameters", traced.num_ops, len(names))
    return traced


class _JointStep(nn.Module):
    """Forward, loss and backward as one module call.

    ``functional_call`` swaps the traced tensors in only for the duration of
    the call; activation checkpointing re-runs block forwards inside
    ``autograd.grad``, which must still see them, so the backward runs inside.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, tokens, labels, wrt: Callable[[], list[torch.Tensor]]):
        loss = self.loss_fn(self.model(tokens), labels)
        return loss, torch.autograd.grad(loss, wrt())


@contextmanager
def _cast_when_used(model: nn.Module, dtype: torch.dtype | None, casts: dict[int, torch.Tensor]) -> Iterator[None]:
    """Cast each module's parameters to ``dtype`` as the module starts its forward, as
    FSDP2's pre-forward hook does, not all of them before the step.

    Where a cast is made decides where the backward casts its gradient back: autograd
    runs the nodes made first last, so casts made up front would leave every layer's
    gradient unreduced (a full-size Partial, on a plan that reduces after the cast)
    until the end of the backward, all of them live at once and none of their
    reductions overlapping the backward's compute. A tied parameter is cast once.
    """
    if dtype is None:
        yield
        return

    def cast_own(module: nn.Module, args) -> None:
        for name, p in module._parameters.items():
            if p is not None and p.dtype != dtype:
                if id(p) not in casts:
                    casts[id(p)] = p.to(dtype)
                module._parameters[name] = casts[id(p)]

    handles = [m.register_forward_pre_hook(cast_own) for m in model.modules() if m._parameters]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _fake_like(t: torch.Tensor) -> torch.Tensor:
    # CPU, not meta: SDPA must pick a real backend so the graph names its kernel.
    return torch.empty(t.shape, dtype=t.dtype, device="cpu")


def _identify(
    gm: fx.GraphModule,
    names: list[str],
    buffer_names: list[str],
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    mixed: bool,
) -> TracedStep:
    """Name placeholders and outputs from the flattening order of ``step``."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    n_p, n_b = len(names), len(buffer_names)
    if len(placeholders) != n_p + n_b + 2:
        raise RuntimeError(f"expected {n_p + n_b + 2} placeholders, traced {len(placeholders)}")
    params = dict(zip(names, placeholders[:n_p]))
    buffers = dict(zip(buffer_names, placeholders[n_p : n_p + n_b]))
    for fqn, node in [*params.items(), *buffers.items()]:
        node.meta["fqn"] = fqn
    out = next(n for n in gm.graph.nodes if n.op == "output")
    flat = _flatten(out.args[0])
    loss, grad_nodes = flat[0], flat[1:]
    if len(grad_nodes) != n_p or any(g is None for g in grad_nodes):
        raise RuntimeError("a parameter has no gradient in the traced step")
    grads = dict(zip(names, grad_nodes))
    grad_casts = {}
    if mixed:
        for fqn, g in grads.items():
            if _is_dtype_cast(g):
                grad_casts[fqn] = g
    return TracedStep(
        graph=gm,
        params=params,
        buffers=buffers,
        tokens=placeholders[-2],
        labels=placeholders[-1],
        loss=loss,
        grads=grads,
        grad_casts=grad_casts,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
    )


def _flatten(x) -> list:
    if isinstance(x, (list, tuple)):
        return [y for item in x for y in _flatten(item)]
    return [x]


def _is_dtype_cast(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (
        torch.ops.aten._to_copy.default,
        torch.ops.prims.convert_element_type.default,
    )


def _remove_inplace(gm: fx.GraphModule) -> None:
    """Swap in-place ops for their functional twin when nothing else sees the mutation.

    Sharding rules describe values, not mutations; every in-place op in a
    traced step (e.g. ``add_`` of an epsilon in RMSNorm) writes a temporary
    that only it and its result's users read.
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        op = node.target
        if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
            continue
        if not op._schema.is_mutable:
            continue
        functional = _functional_twin(op)
        target = node.args[0]
        later = [u for u in target.users if u is not node and order[u] > order[node]]
        if functional is None or later or target.op == "placeholder":
            raise RuntimeError(f"cannot make {op} functional in the traced step")
        node.target = functional


def _functional_twin(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    base = op._schema.name.split("::")[1]
    if not base.endswith("_"):
        return None
    packet = getattr(torch.ops.aten, base[:-1], None)
    return getattr(packet, op._overloadname, None) if packet is not None else None


def _drop_aliases(gm: fx.GraphModule) -> None:
    # alias/detach nodes are saved-for-backward bookkeeping: same value, no kernel.
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in (
            torch.ops.aten.alias.default,
            torch.ops.aten.detach.default,
        ):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
