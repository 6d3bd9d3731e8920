"""Everything a training run holds, built once: model, optimizer, data, metrics, step."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.tensor import DTensor

from torchtitan_autoparallel.config import JobConfig, accumulation_steps
from torchtitan_autoparallel.config.validate import validation_shape
from torchtitan_autoparallel.data.loader import build_data
from torchtitan_autoparallel.errors import ConfigError
from torchtitan_autoparallel.mesh.runtime import Runtime
from torchtitan_autoparallel.models.loss import build_loss_fn, cross_entropy_loss
from torchtitan_autoparallel.models.parallelize import (
    apply_manual_parallelism,
    build_parallel_dims,
    prepare_model_config,
)
from torchtitan_autoparallel.train import checkpoint
from torchtitan_autoparallel.train.metrics import MetricsLogger, resolve_peak
from torchtitan_autoparallel.train.optim import build_lr_scheduler, build_optimizer
from torchtitan_autoparallel.train.validate import build_validator
from torchtitan_autoparallel.train.wandb_log import start_run

logger = logging.getLogger("torchtitan_autoparallel")


@dataclass
class TrainState:
    step: int = 0


def check_model_fits_mesh(model_config, degrees: tuple[int, int, int]) -> None:
    tp = degrees[2]
    n_heads, n_kv = model_config.heads
    if n_heads % tp or n_kv % tp:
        raise ConfigError(
            f"tensor_parallel_degree {tp} does not divide the model's {n_heads} attention "
            f"heads and {n_kv} key/value heads; accepted: a common divisor of both"
        )


def _sequence_lengths(job: JobConfig) -> list[tuple[str, int]]:
    lengths = [("training.seq_len", job.training.seq_len)]
    if job.validation.enable:
        lengths.append(("validation.seq_len", validation_shape(job)[1]))
    return lengths


def check_seq_len_fits_model(model_config, job: JobConfig) -> None:
    """The rotary embedding is precomputed for ``max_seq_len`` positions: a longer sequence
    fails deep inside the first forward, on every rank, so refuse it up front."""
    longest = model_config.max_seq_len
    for key, value in _sequence_lengths(job):
        if value > longest:
            raise ConfigError(
                f"{key} {value} is above the maximum sequence length of {model_config.family} "
                f"{model_config.flavor}, {longest}; accepted: 2..{longest}"
            )


def fit_rope_to_job(model_config, job: JobConfig) -> None:
    """Size the rotary cache for the job's longest sequence (``compat.ModelConfig.fit_rope``)."""
    model_config.fit_rope(max(length for _, length in _sequence_lengths(job)))


@dataclass
class Training:
    job: JobConfig
    runtime: Runtime
    model: nn.Module
    model_id: str
    optimizer: torch.optim.Optimizer | None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    dataloader: object | None
    metrics: MetricsLogger | None
    dp_degree: int
    dp_group: dist.ProcessGroup | None
    n_params: int
    accumulation_steps: int = 1  # micro-batches per optimizer step
    validator: object | None = None  # train.validate.Validator when validation is on
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_loss

    @property
    def global_tokens_per_step(self) -> int:
        t = self.job.training
        return t.local_batch_size * t.seq_len * self.dp_degree * self.accumulation_steps

    def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimizer step over ``accumulation_steps`` micro-batches; returns
        (local loss, grad norm, the lr this step used)."""
        from torchtitan.distributed.utils import clip_grad_norm_

        self.optimizer.zero_grad()
        loss = torch.zeros((), device=self.runtime.device)
        for batch in batches:
            inputs, labels = (x.to(self.runtime.device) for x in batch)
            pred = self.model(inputs)
            if isinstance(pred, DTensor):
                pred = pred.full_tensor()
            # Data-parallel gradients are summed (not averaged) across ranks and
            # micro-batch gradients add up in .grad, so the local mean is divided by
            # both counts: the sum is then the gradient of the global batch's mean.
            micro_loss = self.loss_fn(pred, labels) / (self.dp_degree * len(batches))
            micro_loss.backward()
            loss += micro_loss.detach()
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = clip_grad_norm_(params, self.job.training.max_norm, foreach=True)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        return loss, grad_norm, lr

    def validation_loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The batch's global mean loss, forward only."""
        inputs, labels = (x.to(self.runtime.device) for x in batch)
        with torch.no_grad():
            pred = self.model(inputs)
            if isinstance(pred, DTensor):
                pred = pred.full_tensor()
            loss = self.loss_fn(pred, labels)
            if self.dp_degree > 1:
                dist.all_reduce(loss, group=self.dp_group)
        return loss / self.dp_degree

    def global_loss(self, local_loss: torch.Tensor) -> float:
        total = local_loss.clone()
        if self.dp_degree > 1:
            dist.all_reduce(total, group=self.dp_group)
        return float(total)

    def summary(self) -> str:
        lines = [f"{self.n_params:,} parameters; placements of the first tensors:"]
        for name, p in list(self.model.named_parameters())[:8]:
            placements = getattr(p, "placements", None)
            lines.append(f"  {name:50s} {tuple(p.shape)} {placements}")
        return "\n".join(lines)


def set_determinism(job: JobConfig, device: torch.device) -> None:
    torch.manual_seed(job.training.seed)
    if job.training.deterministic:
        if device.type == "cuda":  # cuBLAS needs a fixed workspace to be deterministic
            import os

            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def build_training(
    job: JobConfig, runtime: Runtime, family: str, model_config, degrees: tuple[int, int, int]
) -> Training:
    set_determinism(job, runtime.device)
    dims = build_parallel_dims(job, degrees, runtime.world_size)
    prepare_model_config(model_config, job, degrees)
    with torch.device("meta"):
        model = model_config.build()
    n_params, flops_per_token = model_config.nparams_and_flops(model, job.training.seq_len)
    model = apply_manual_parallelism(model, model_config, job, degrees, dims, runtime)
    dp_degree, dp_rank, dp_group = _data_parallel_coords(dims)
    t = job.training
    steps = accumulation_steps(job, degrees)
    common = dict(
        job=job,
        runtime=runtime,
        model=model,
        model_id=checkpoint.job_model_id(job, family),
        dp_degree=dp_degree,
        dp_group=dp_group,
        n_params=n_params,
        accumulation_steps=steps,
        loss_fn=build_loss_fn(job),
    )
    if runtime.fake:
        return Training(optimizer=None, scheduler=None, dataloader=None, metrics=None, **common)
    _materialize(model, model_config, job.training.seed, runtime.device, job.training.full_init_max_gib * 2**30)
    optimizer = build_optimizer(model, job.optimizer)
    return Training(
        optimizer=optimizer,
        scheduler=build_lr_scheduler(optimizer, t.steps, job.lr_scheduler),
        dataloader=build_data(job, model_config, dp_rank, dp_degree),
        metrics=build_metrics(job, runtime, flops_per_token),
        validator=build_validator(job, model_config, dp_rank, dp_degree),
        **common,
    )


def _data_parallel_coords(dims) -> tuple[int, int, dist.ProcessGroup | None]:
    if not dims.dp_enabled:
        return 1, 0, None
    mesh = dims.get_mesh("batch")
    return mesh.size(), mesh.get_local_rank(), mesh.get_group()


def init_full_model(model_config, seed: int, device: torch.device) -> nn.Module:
    """The unsharded model, initialised exactly as a 1-rank run initialises it."""
    torch.manual_seed(seed)
    with torch.device(device):
        full = model_config.build()
    with torch.no_grad():
        full.init_weights(buffer_device=None)
    return full


def param_bytes(model: nn.Module) -> int:
    """The model's parameters in bytes (a meta model is fine; a tied weight counts once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _materialize(model: nn.Module, model_config, seed: int, device: torch.device, max_whole_bytes: float) -> None:
    """Allocate the sharded weights and initialise them: a model up to ``max_whole_bytes``
    whole on every rank, so the sharded weights equal a 1-rank run's bit for bit."""
    model.to_empty(device=device)
    if param_bytes(model) > max_whole_bytes:
        # Too big to materialise whole on every rank: torchtitan's sharded init.
        torch.manual_seed(seed)
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        return
    full = init_full_model(model_config, seed, device)
    # remove_duplicate=False: a tied weight (Qwen3's embedding and output) is
    # found under both names, which tensor parallelism may have untied.
    full_tensors = dict(full.named_parameters(remove_duplicate=False)) | dict(
        full.named_buffers(remove_duplicate=False)
    )
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        _copy_into(tensor, full_tensors[_unwrapped_name(name)])


def _unwrapped_name(name: str) -> str:
    """``name`` without the module torch's checkpoint wrapper adds (activation checkpointing)."""
    return name.replace(_CHECKPOINT_PREFIX, "")


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    from torch.distributed.tensor import distribute_tensor

    with torch.no_grad():
        if isinstance(dst, DTensor):
            src = distribute_tensor(src, dst.device_mesh, dst.placements, src_data_rank=None)
            dst.to_local().copy_(src.to_local())
        else:
            dst.copy_(src)


def build_metrics(job: JobConfig, runtime: Runtime, flops_per_token: float) -> MetricsLogger:
    peak = resolve_peak(job.metrics.peak_tflops, runtime.device, job.training.mixed_precision_param,
                        job.autoparallel.cost_profile)
    logger.info(f"MFU peak: {peak.tflops:.4f} TFLOPs per device ({peak.source})")
    tb = tensorboard_folder(job) if job.metrics.enable_tensorboard else None
    return MetricsLogger(
        job.job.dump_folder,
        flops_per_token=flops_per_token,
        peak=peak,
        world_size=runtime.world_size,
        device=runtime.device,
        writes=runtime.rank == 0,
        tensorboard_folder=tb,
        wandb_run=_wandb_run(job) if job.metrics.enable_wandb and runtime.rank == 0 else None,
    )


def tensorboard_folder(job: JobConfig) -> str:
    """``metrics.save_tb_folder``: under the dump folder, or as given where absolute
    (torchtitan's ``os.path.join`` reads it so)."""
    return os.path.join(job.job.dump_folder, job.metrics.save_tb_folder)


def _wandb_run(job: JobConfig):

    return start_run(job)
