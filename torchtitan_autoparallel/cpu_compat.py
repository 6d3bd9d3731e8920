"""The few places where torchtitan needs help to run on CPU (and gloo).

Kept in one module so that each workaround is visible, documented and easy to
drop when torchtitan fixes it upstream.

1. Device: torchtitan resolves its device type at import time
   (``point_torchtitan_at``).
2. gloo: a gloo group runs its collectives on two worker threads, and two
   collectives of one group running at once corrupt the heap now and then
   under torch 2.14.1 (``experiments/gloo_inflight``). ``one_gloo_worker_thread``
   gives each group one thread: its collectives run in issue order, still
   asynchronously to the caller (``AUTOPARALLEL_GLOO_COLLECTIVES=queued``).

Attention needs help too (FlexAttention, torchtitan's default, has no CPU
backward); ``compat.ModelConfig`` picks torchtitan's causal SDPA, in the form
each torchtitan release takes it.
"""

from __future__ import annotations


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


def keep_weight_tying_under_tp(model, output_name: str) -> None:
    """Re-tie the embedding and output weights after torchtitan's TP step.

    Not CPU-specific, but the same kind of fix: torchtitan 0.3's tensor
    parallelism replaces each module's weight with its own DTensor, so Qwen3's
    tied ``tok_embeddings.weight`` / ``lm_head.weight`` silently become two
    parameters that train apart. Both are ``Shard(0)`` on the TP axis, so the
    output layer's DTensor can serve both, as the unsharded model does; this
    must happen before FSDP wraps the parameters, hence the hook on
    ``model.parallelize`` (the TP step torchtitan calls first).
    """
    if not getattr(model, "enable_weight_tying", False) or not hasattr(model, "parallelize"):
        return  # untied, or torchtitan 0.2, whose TP step is not a model method
    tensor_parallelize = model.parallelize

    def parallelize_and_retie(*args, **kwargs):
        result = tensor_parallelize(*args, **kwargs)
        head, embed = getattr(model, output_name).weight, model.tok_embeddings.weight
        if getattr(head, "placements", None) != getattr(embed, "placements", None):
            raise RuntimeError(
                f"cannot keep tied weights: {output_name} {head.placements} vs tok_embeddings {embed.placements}"
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
