"""torchtitan's hand-written parallelisms (DDP / FSDP / HSDP / TP) applied from the knobs.

This is the baseline the automatic plan is measured against: the model, the
mesh and the parallelize function are torchtitan's own; we only translate our
config into a ``compat.HandPlan``, which ``compat`` hands to whichever
torchtitan release is installed in the form that release expects.
"""

from __future__ import annotations

from torch import nn

from torchtitan_autoparallel import compat
from torchtitan_autoparallel.compat import HandPlan, ModelConfig
from torchtitan_autoparallel.config import JobConfig
from torchtitan_autoparallel.cpu_compat import keep_weight_tying_under_tp, sum_reduce_gradients_on_gloo
from torchtitan_autoparallel.mesh.runtime import Runtime


def hand_plan(job: JobConfig, degrees: tuple[int, int, int]) -> HandPlan:
    t, c = job.training, job.compile  # torchtitan compiles each transformer block ("model" in components)
    return HandPlan(
        degrees=degrees,
        seq_len=t.seq_len,
        local_batch_size=t.local_batch_size,
        max_norm=t.max_norm,
        mixed_precision_param=t.mixed_precision_param,
        mixed_precision_reduce=t.mixed_precision_reduce,
        enable_sequence_parallel=job.parallelism.enable_sequence_parallel,
        fsdp_reshard_after_forward=job.parallelism.fsdp_reshard_after_forward,
        compile_enable=c.enable,
        compile_components=tuple(c.components),
        compile_backend=c.backend,
        ac_mode=job.activation_checkpoint.mode,
        dump_folder=job.job.dump_folder,
    )


def build_parallel_dims(job: JobConfig, degrees: tuple[int, int, int], world_size: int):
    return compat.build_parallel_dims(hand_plan(job, degrees), world_size)


def prepare_model_config(model_config: ModelConfig, job: JobConfig, degrees: tuple[int, int, int]) -> None:
    """Let torchtitan fill the sharding annotations its TP plan reads."""
    compat.prepare_model_config(model_config, hand_plan(job, degrees))


def apply_manual_parallelism(
    model: nn.Module, model_config: ModelConfig, job: JobConfig, degrees: tuple[int, int, int], parallel_dims,
    runtime: Runtime,
) -> nn.Module:
    """Apply torchtitan's parallelize function for the model's family to a meta-device model."""
    keep_weight_tying_under_tp(model, model_config.output_name)
    model = compat.hand_parallelize(model, model_config, hand_plan(job, degrees), parallel_dims)
    if runtime.backend == "gloo":
        sum_reduce_gradients_on_gloo(model)
    return model
