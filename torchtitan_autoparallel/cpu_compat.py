"""The few places where torchtitan 0.3.0 needs help to run on CPU (and gloo).

Kept in one module so that each workaround is visible, documented and easy to
drop when torchtitan fixes it upstream.

1. Attention: torchtitan's language models default to FlexAttention, whose
   backward has no CPU implementation, and ``get_attention_config("sdpa")`` is
   refused for language models. We swap each layer's inner attention for
   torchtitan's own ``ScaledDotProductAttention`` (causal, no document masks),
   which runs forward and backward on CPU and GPU.
2. Device: torchtitan resolves its device type at import time
   (``point_torchtitan_at``).
3. Start-up: torchtitan's attention module compiles FlexAttention when it is
   imported (a ``torch.compile`` class attribute), which imports inductor,
   about 0.5 s in every process, for a kernel the SDPA swap above never
   calls. ``import_model_module`` imports a model package with
   ``torch.compile`` deferred: the compile happens at the first call, if any.
4. gloo: a gloo group runs its collectives on two worker threads, and two
   collectives of one group running at once corrupt the heap now and then
   under torch 2.14.1 (``experiments/gloo_inflight``). ``one_gloo_worker_thread``
   gives each group one thread: its collectives run in issue order, still
   asynchronously to the caller (``AUTOPARALLEL_GLOO_COLLECTIVES=queued``).
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType


def import_model_module(name: str) -> ModuleType:
    """``importlib.import_module(name)`` with import-time ``torch.compile`` calls made lazy."""
    import torch

    real = torch.compile

    def deferred(model=None, **options):
        if model is None:  # used as @torch.compile(...)
            return lambda fn: deferred(fn, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = real(model, **options)
            return compiled(*args, **kwargs)

        return call

    torch.compile = deferred
    try:
        return importlib.import_module(name)
    finally:
        torch.compile = real


def use_sdpa_attention(model_config) -> None:
    """Point every layer of a torchtitan decoder config at causal SDPA."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in model_config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()


def point_torchtitan_at(device_type: str) -> None:
    """Make torchtitan build meshes and pick backends for ``device_type``.

    torchtitan resolves its device once at import time and falls back to
    ``"cuda"`` when no accelerator exists, so on a CPU-only machine its meshes
    and process groups would ask for CUDA. The value is copied into several
    modules by ``from ... import device_type``; each copy is updated here.
    """
    import torch
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tool_utils

    module = torch.cpu if device_type == "cpu" else getattr(torch, device_type)
    for m in (tool_utils, dist_utils):
        m.device_type, m.device_module = device_type, module
    parallel_dims.device_type = device_type


def sum_reduce_gradients_on_gloo(model) -> None:
    """Let FSDP2 reduce gradients with plain SUM.

    FSDP2 as torchtitan configures it reduces with ``ReduceOp.PREMUL_SUM``,
    which gloo does not implement. torchtitan already disables FSDP's own
    gradient division (the loss is normalised by the global token count), so a
    plain sum is numerically the same reduction.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def keep_weight_tying_under_tp(model) -> None:
    """Re-tie the embedding and output weights after torchtitan's TP step.

    Not CPU-specific, but the same kind of fix: torchtitan 0.3.0's tensor
    parallelism replaces each module's weight with its own DTensor, so Qwen3's
    tied ``tok_embeddings.weight`` / ``lm_head.weight`` silently become two
    parameters that train apart. Both are ``Shard(0)`` on the TP axis, so the
    output layer's DTensor can serve both, as the unsharded model does; this
    must happen before FSDP wraps the parameters, hence the hook on
    ``model.parallelize`` (the TP step torchtitan calls first).
    """
    if not getattr(model, "enable_weight_tying", False):
        return
    tensor_parallelize = model.parallelize

    def parallelize_and_retie(*args, **kwargs):
        result = tensor_parallelize(*args, **kwargs)
        head, embed = model.lm_head.weight, model.tok_embeddings.weight
        if getattr(head, "placements", None) != getattr(embed, "placements", None):
            raise RuntimeError(
                f"cannot keep tied weights: lm_head {head.placements} vs tok_embeddings {embed.placements}"
            )
        model.tok_embeddings.weight = head
        return result

    model.parallelize = parallelize_and_retie


def one_gloo_worker_thread() -> bool:
    """Give every gloo process group created from now on one worker thread.

    torch creates gloo groups through a registered backend plugin that ignores
    the ``pg_options`` a caller passes, with two worker threads each; this
    registers a plugin that builds the same group with one. The ``malloc():
    unaligned tcache chunk`` aborts and SIGSEGVs of Inductor-built steps on
    gloo came with two collectives of one group on its two threads at once (a
    core dump caught both inside ``gloo::allgather``); with one thread per
    group the same steps ran clean (``experiments/gloo_inflight``).
    Returns False, changing nothing, where this torch lacks the private hooks.
    """
    from torch.distributed import distributed_c10d as c10d

    register = getattr(c10d.Backend, "_ensure_backend_registered", None)
    if register is not None:  # torch registers its gloo plugin on first use
        register("gloo")
    plugin = getattr(c10d.Backend, "_BackendPlugin", None)
    plugins = getattr(c10d.Backend, "_plugins", None)
    gloo = getattr(c10d, "ProcessGroupGloo", None)
    if plugin is None or not isinstance(plugins, dict) or "GLOO" not in plugins or gloo is None:
        return False

    def create(opts, backend_options):
        options = gloo._Options()
        options._timeout = opts.timeout
        options._devices = [gloo.create_default_device()]
        options._threads = 1
        options.enable_reconfigure = opts.enable_reconfigure
        group = gloo(opts.store, opts.group_rank, opts.group_size, options)
        group.options.global_ranks_in_group = opts.global_ranks_in_group
        group.options.group_name = opts.group_id
        return group

    plugins["GLOO"] = plugin(create, True)
    return True
