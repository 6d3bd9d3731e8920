"""torchtitan's hand-written parallelisms (DDP / FSDP / HSDP / TP) applied from the knobs.

This is the baseline the automatic plan is measured against: the model, the
mesh and the parallelize function are torchtitan's own; we only translate our
config into the objects torchtitan 0.3.0 expects.
"""

from __future__ import annotations

from types import SimpleNamespace

from torch import nn

from torchtitan_autoparallel.config import JobConfig
from torchtitan_autoparallel.cpu_compat import keep_weight_tying_under_tp, sum_reduce_gradients_on_gloo
from torchtitan_autoparallel.distributed.runtime import Runtime


def _torchtitan_configs(job: JobConfig, degrees: tuple[int, int, int]):
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig

    rep, shard, tp = degrees
    parallelism = ParallelismConfig(
        data_parallel_replicate_degree=rep,
        data_parallel_shard_degree=shard,
        tensor_parallel_degree=tp,
        enable_sequence_parallel=job.parallelism.enable_sequence_parallel,
        fsdp_reshard_after_forward=job.parallelism.fsdp_reshard_after_forward,
        # DTensor on model-parallel axes only: the classic FSDP2 + TP stack.
        spmd_backend="partial_dtensor",
    )
    training = TrainingConfig(
        local_batch_size=job.training.local_batch_size,
        seq_len=job.training.seq_len,
        max_norm=job.training.max_norm,
        mixed_precision_param=job.training.mixed_precision_param,
        mixed_precision_reduce=job.training.mixed_precision_reduce,
    )
    c = job.compile  # torchtitan compiles each transformer block ("model" in components)
    compile_config = CompileConfig(enable=c.enable, components=list(c.components), backend=c.backend)
    return parallelism, training, compile_config


def _ac_config(mode: str):
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    return {"none": None, "full": FullAC.Config(), "selective": SelectiveAC.Config()}[mode]


def build_parallel_dims(job: JobConfig, degrees: tuple[int, int, int], world_size: int):
    from torchtitan.distributed import ParallelDims

    parallelism, _, _ = _torchtitan_configs(job, degrees)
    dims = ParallelDims.from_config(parallelism, world_size)
    dims.build_mesh()
    return dims


def prepare_model_config(model_config, job: JobConfig, degrees: tuple[int, int, int]) -> None:
    """Let torchtitan fill the sharding annotations its TP plan reads."""
    parallelism, training, _ = _torchtitan_configs(job, degrees)
    model_config.update_from_config(config=SimpleNamespace(parallelism=parallelism, training=training))


def apply_manual_parallelism(
    model: nn.Module, family: str, job: JobConfig, degrees: tuple[int, int, int], parallel_dims, runtime: Runtime
) -> nn.Module:
    """Apply torchtitan's parallelize function for ``family`` to a meta-device model."""
    if family == "llama3":
        from torchtitan.models.llama3 import parallelize_llama as parallelize
    else:
        from torchtitan.models.qwen3 import parallelize_qwen3 as parallelize
    parallelism, training, compile_config = _torchtitan_configs(job, degrees)
    keep_weight_tying_under_tp(model)
    model = parallelize(
        model,
        parallel_dims=parallel_dims,
        training=training,
        parallelism=parallelism,
        compile_config=compile_config,
        ac_config=_ac_config(job.activation_checkpoint.mode),
        dump_folder=job.job.dump_folder,
    )
    if runtime.backend == "gloo":
        sum_reduce_gradients_on_gloo(model)
    return model
