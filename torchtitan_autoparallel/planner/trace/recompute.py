"""Activation checkpointing inside the traced step: the recomputation becomes graph nodes.

While ``trace.py`` traces the joint step, each transformer block (a child of
``model.layers``, the unit torchtitan's ``apply_ac`` wraps) runs under
``torch.utils.checkpoint`` (non-reentrant). The backward then re-runs the
block's forward to rebuild what it did not save, and ``make_fx`` records that
re-run as ordinary nodes placed before the block's gradient ops. So the plan
prices the recomputation like any other op, the executor runs it like any
other op, and the forward activations die at their last forward use instead
of living until the backward.

Modes (``activation_checkpoint.mode``):

* ``full``: a block saves only its inputs; all of it is recomputed.
* ``selective``: torchtitan's per-op policy: the outputs of compute-heavy ops
  (matmuls, attention) are saved, except every second matmul; the rest is
  recomputed.

A mode may also be given per block (``block_modes``): what the planner's
``activation_checkpoint = "auto"`` chooses, block by block, in the solve
(``planner/plan/recompute_choice.py``, which reads each block's forward ops
from the ``BLOCK`` tag ``tagged_blocks`` puts on them while tracing).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import fx, nn
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from torchtitan_autoparallel.compat import checkpoint_for_real

AC_MODES = ("none", "full", "selective")
# The modes from the least recomputation to the most: each costs more step time and
# keeps fewer activations for the backward.
RECOMPUTE_ORDER = ("none", "selective", "full")
BLOCK = "block"  # node.meta key: the transformer block whose forward made the node (``tagged_blocks``)

_MM_OPS = (torch.ops.aten.mm.default, torch.ops.aten.linear.default)


@functools.cache
def _save_ops() -> frozenset:
    """Ops whose outputs selective AC keeps: those expensive to recompute."""
    from torch._functorch.partitioners import get_default_op_list

    ops = {op.default for op in get_default_op_list().compute_intensive_ops}
    # The trace always runs on CPU fake tensors, whose SDPA kernel is not in the
    # partitioner's list; a GPU run's flash kernel is, so keep it to plan what a
    # GPU run of torchtitan's policy would save.
    ops.add(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
    ops.add(torch.ops.aten.linear.default)  # some backends keep linear whole instead of mm
    return frozenset(ops)


def _selective_policy():
    """A fresh policy for one block call: save heavy ops but recompute every second matmul.

    Forward and recompute count matmuls separately, so both passes make the
    same choice for the same matmul (the recompute must find what the forward saved).
    """
    save = _save_ops()
    counts = {False: 0, True: 0}

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in _MM_OPS:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_saves(forward: Sequence[fx.Node]) -> set[fx.Node]:
    """Of one block's forward ops, in graph order, those whose outputs the selective
    policy keeps for the backward (``_selective_policy``, read off the graph)."""
    save, matmuls, kept = _save_ops(), 0, set()
    for node in forward:
        if node.target in _MM_OPS:
            matmuls += 1
            if matmuls % 2 == 0:
                continue
        if node.target in save:
            kept.add(node)
    return kept


def _checkpointed(forward, mode: str):
    def run(*args, **kwargs):
        extra = {}
        if mode == "selective":
            extra["context_fn"] = lambda: create_selective_checkpoint_contexts(_selective_policy())
        # No RNG state to keep: the traced models have no dropout, and the
        # trace's fake tensors draw no random numbers.
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **extra, **kwargs)

    return functools.wraps(forward)(run)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules torchtitan's activation checkpointing wraps: the children of ``model.layers``."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.Module) or not list(layers.children()):
        raise ValueError(
            f"activation checkpointing needs transformer blocks under model.layers; "
            f"{type(model).__name__} has none"
        )
    return list(layers.children())


def block_modes(mode: str | Sequence[str], n_blocks: int) -> tuple[str, ...]:
    """Each block's mode: ``mode`` for all, or ``mode[i]`` for block i."""
    modes = (mode,) * n_blocks if isinstance(mode, str) else tuple(mode)
    if len(modes) != n_blocks:
        raise ValueError(f"activation checkpointing modes for {len(modes)} blocks; the model has {n_blocks}")
    for m in modes:
        if m not in AC_MODES:
            raise ValueError(f"activation checkpointing mode {m!r} is not accepted; accepted: {', '.join(AC_MODES)}")
    return modes


def block_runs(modes: Sequence[str]) -> list[tuple[str, str]]:
    """Each run of blocks sharing a mode, as (mode, "0-1") or (mode, "2") for one block."""
    runs = []
    for mode, run in itertools.groupby(enumerate(modes), key=lambda im: im[1]):
        blocks = [i for i, _ in run]
        runs.append((mode, f"{blocks[0]}" + (f"-{blocks[-1]}" if len(blocks) > 1 else "")))
    return runs


def describe(modes: Sequence[str]) -> str:
    """One mode when all blocks share it, else its runs of blocks: "full 0-1, none 2-5"."""
    if len(set(modes)) == 1:
        return modes[0]
    return ", ".join(f"{mode} {blocks}" for mode, blocks in block_runs(modes))


@contextmanager
def tagged_blocks(model: nn.Module) -> Iterator[None]:
    """While ``make_fx`` traces ``model``, mark each node its transformer block's forward
    makes with ``node.meta[BLOCK]`` (the block's index): the planner prices each block's
    recomputation from them. A recomputation in the backward calls the block's forward
    directly, not the module, so its nodes stay unmarked. No-op for a model without blocks."""
    layers = getattr(model, "layers", None)
    blocks = list(layers.children()) if isinstance(layers, nn.Module) else []
    starts: dict[int, fx.Node] = {}

    def last_node() -> fx.Node | None:
        mode = get_proxy_mode()
        return None if mode is None else mode.tracer.graph._root.prev

    def enter(i: int, *_) -> None:
        node = last_node()
        if node is not None:
            starts[i] = node

    def leave(i: int, *_) -> None:
        end, node = last_node(), starts.pop(i, None)
        while node is not None and node is not end:
            node = node.next
            node.meta.setdefault(BLOCK, i)

    handles = []
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(functools.partial(enter, i)))
        handles.append(block.register_forward_hook(functools.partial(leave, i)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def checkpointed_blocks(model: nn.Module, mode: str | Sequence[str]) -> Iterator[None]:
    """Run each transformer block of ``model`` under activation checkpointing ``mode``
    (one for all blocks, or one per block: ``block_modes``).

    Only the blocks' ``forward`` is swapped (an instance attribute, removed on
    exit), so parameter names stay those of the plain model. The recompute
    runs during the backward, so the caller must keep any reparametrization
    (``functional_call``) open until the gradients are taken.
    """
    if mode == "none":
        yield
        return
    blocks = transformer_blocks(model)
    wrapped = [(b, m) for b, m in zip(blocks, block_modes(mode, len(blocks))) if m != "none"]
    for block, m in wrapped:
        if "forward" in block.__dict__:
            raise RuntimeError(f"{type(block).__name__}.forward is already overridden on the instance")
        block.forward = _checkpointed(block.forward, m)
    try:
        # Under a proxy mode selective checkpointing assumes torch.compile and
        # only tags nodes for a partitioner, recomputing nothing; the trace is
        # make_fx of a whole training step, so it must save and recompute for
        # real for the graph to show it.
        with checkpoint_for_real():
            yield
    finally:
        for block, _ in wrapped:
            del block.forward
