"""The training entry point: ``python -m torchtitan_autoparallel.launch.main [--section.key value ...]``.

``run_train.sh`` starts one of these per rank with torchrun. Bad input ends in
one ``error:`` line and exit status 2, never a traceback.
"""

from __future__ import annotations

import faulthandler
import logging
import math
import os
import signal
import sys
from datetime import timedelta

import torch

from torchtitan_autoparallel.compat import check_versions
from torchtitan_autoparallel.config import JobConfig, accumulation_steps, load_config, resolve_degrees
from torchtitan_autoparallel.config.dump import write_resolved
from torchtitan_autoparallel.config.validate import check_planned_validation_shape
from torchtitan_autoparallel.errors import TrainingDiverged, UserError, print_traceback_if_asked
from torchtitan_autoparallel.execute.inflight import mode_from_env
from torchtitan_autoparallel.launch import preflight
from torchtitan_autoparallel.launch.help import help_for, wants_help
from torchtitan_autoparallel.mesh.runtime import (
    Runtime,
    exit_process,
    init_runtime,
    set_collective_timeout,
    shutdown,
    startup_timeout,
)
from torchtitan_autoparallel.models.registry import build_model_config, get_entry
from torchtitan_autoparallel.train import checkpoint, hf_checkpoint
from torchtitan_autoparallel.train.auto import build_auto_training, plan_job
from torchtitan_autoparallel.train.failures import (
    INTERRUPTED_EXIT,
    USER_ERROR_EXIT,
    explain_collective_failure,
    record_user_error,
)
from torchtitan_autoparallel.train.garbage import ScheduledGC
from torchtitan_autoparallel.train.profiling import StepProfiler
from torchtitan_autoparallel.train.setup import (
    Training,
    TrainState,
    build_training,
    check_model_fits_mesh,
    check_seq_len_fits_model,
    fit_rope_to_job,
)
from torchtitan_autoparallel.train.tensor_memory import TensorMemoryProbe

logger = logging.getLogger("torchtitan_autoparallel")


def main(argv: list[str] | None = None) -> int:
    # Under torchrun (run_train.sh tees each rank's output) torchrun starts every line
    # with [rank<r>]: itself; tagging it again read [rank0]:[rank0] ...
    tag = "" if "TORCHELASTIC_RUN_ID" in os.environ else "[rank%(rank)s] "
    logging.basicConfig(level=logging.INFO, format=f"{tag}%(asctime)s %(message)s")
    if not tag:
        _untag_torch_logs()
    _tag_log_records_with_rank()
    # `kill -USR1 <rank pid>` prints where every thread of a rank is, even one stuck in
    # a collective or a lock: how to see why a job hangs without stopping it
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print(help_for(argv))
        return 0
    try:
        check_versions()
        job = load_config(argv)
        return run(job)
    except UserError as e:
        print_traceback_if_asked()
        record_user_error(str(e))
        return USER_ERROR_EXIT
    except KeyboardInterrupt:  # Ctrl-C reaches every rank: no traceback (the launcher says it)
        return INTERRUPTED_EXIT
    except Exception as e:  # a collective that lost a peer or timed out: one line, naming the rank at fault
        if (status := explain_collective_failure(e)) is None:
            raise
        return status
    finally:
        shutdown()


def _tag_log_records_with_rank() -> None:
    factory = logging.getLogRecordFactory()

    def make(*args, **kwargs):
        record = factory(*args, **kwargs)
        record.rank = os.environ.get("RANK", "0")
        return record

    logging.setLogRecordFactory(make)


def run(job: JobConfig) -> int:
    entry = get_entry(job.model.name)
    # Before anything loads a cost profile: the planner prices fp32 matmuls at this precision.
    torch.set_float32_matmul_precision(job.training.float32_matmul_precision)
    solve_s = job.autoparallel.time_limit_s if entry.auto_parallel else 0.0
    startup = startup_timeout(job.comm.init_timeout_seconds, solve_s)
    runtime = init_runtime(os.environ.get("COMM_MODE", ""), startup, one_gloo_thread=_queued_gloo(entry))
    degrees = resolve_degrees(job, runtime.world_size)
    accumulation_steps(job, degrees)  # before planning: refuse a bad batch early
    if entry.auto_parallel:
        check_planned_validation_shape(job)
    model_config = build_model_config(entry.family, job.model.flavor, job.model.n_layers)
    check_model_fits_mesh(model_config, degrees)
    check_seq_len_fits_model(model_config, job)
    fit_rope_to_job(model_config, job)
    checkpoint.check_resume(job, entry.family)  # before planning: refuse early, write nothing
    if runtime.rank == 0:
        written = write_resolved(job)
        logger.info(f"configuration written to {written}")
        if job.job.print_args:
            logger.info(f"configuration:\n{written.read_text()}")
    logger.info(
        f"{job.model.name} {job.model.flavor} on {runtime.world_size} {runtime.device_type} "
        f"rank(s) ({runtime.backend}); replicate {degrees[0]} x shard {degrees[1]} x tensor {degrees[2]}; "
        f"collective timeout {startup.total_seconds():.0f} s until the first step is done, then "
        f"{job.comm.train_timeout_seconds} s"
    )
    if entry.auto_parallel:
        return run_auto_parallel(job, runtime, entry.family, model_config, degrees)
    return run_manual(job, runtime, entry.family, model_config, degrees)


def _queued_gloo(entry) -> bool:
    """Whether a planned model's gloo groups get one worker thread (execute/inflight.py)."""
    if not entry.auto_parallel:
        return False

    return mode_from_env() == "queued"


def run_auto_parallel(job: JobConfig, runtime: Runtime, family: str, model_config, degrees) -> int:

    if runtime.fake:
        plan_job(job, runtime, model_config, degrees)
        logger.info("COMM_MODE=fake_backend: plan written; no training on a fake process group")
        return 0
    return train(job, build_auto_training(job, runtime, family, model_config, degrees))


def run_manual(job: JobConfig, runtime: Runtime, family: str, model_config, degrees) -> int:
    t = build_training(job, runtime, family, model_config, degrees)
    if runtime.fake:
        logger.info(t.summary())
        logger.info("COMM_MODE=fake_backend: configuration checked; no training on a fake process group")
        return 0
    return train(job, t)


def train(job: JobConfig, t: Training) -> int:
    state = TrainState()
    ckpt_folder = checkpoint.job_folder(job)
    _restore(job, t, state, ckpt_folder)
    if t.accumulation_steps > 1:
        logger.info(
            f"gradient accumulation: {t.accumulation_steps} micro-batches of {job.training.local_batch_size} "
            f"sample(s) per data-parallel rank per step (global batch {job.training.global_batch_size})"
        )
    try:
        with (
            StepProfiler(job, t.runtime.rank, t.runtime.device, first_step=state.step + 1) as profiler,
            ScheduledGC(job.training.gc_freq) as collector,
            TensorMemoryProbe(
                job.metrics.tensor_memory_step, state.step + 1, t.runtime.rank, t.runtime.device, job.job.dump_folder
            ) as tensor_memory,
        ):
            _loop(job, t, state, _saver(job, ckpt_folder), (profiler, collector, tensor_memory))
    except KeyboardInterrupt:
        logger.info(f"interrupted in step {state.step}")
        raise
    finally:  # interrupted too: what was logged stays readable (metrics.jsonl, TensorBoard)
        t.metrics.close()
    logger.info("training finished")
    return 0


def _restore(job: JobConfig, t: Training, state: TrainState, ckpt_folder) -> None:
    """Resume this job's latest checkpoint, or start from ``checkpoint.initial_load_path``."""
    c = job.checkpoint
    fresh_optimizer = "optimizer" in c.exclude_from_loading
    saved = None
    if (step := checkpoint.step_to_load(job)) is not None:
        saved = checkpoint.load(ckpt_folder, step, t.model, t.optimizer, t.model_id, fresh_optimizer)
    elif (path := checkpoint.initial_load_path(job)) is not None:
        hf = _hf_adapter(job) if c.initial_load_in_hf else None
        saved = checkpoint.load_initial(
            path, t.model, t.optimizer, t.model_id, c.initial_load_model_only, hf, fresh_optimizer
        )
    if saved is not None:  # a resume: step, data position and schedule continue
        state.step = saved["step"]
        if fresh_optimizer:
            logger.info("optimizer state not loaded (checkpoint.exclude_from_loading): AdamW starts afresh")
        if "dataloader" in c.exclude_from_loading:
            logger.info("data position not loaded (checkpoint.exclude_from_loading): the data starts over")
        else:
            t.dataloader.load_state_dict(saved["data"])
        t.scheduler = preflight.resumed_scheduler(job, t.optimizer, saved, state.step)  # keep_lr_schedule


def _untag_torch_logs() -> None:
    """torch's own log lines (its warnings) start with [rank<r>]: once a process group
    exists, after the tag torchrun gives every line already: keep their layout, less the tag."""
    layout = logging.Formatter("%(levelname).1s%(asctime)s %(process)d %(pathname)s:%(lineno)d] %(message)s")
    for name, logger_ in logging.Logger.manager.loggerDict.items():  # torch gives several their own handler
        if (name == "torch" or name.startswith("torch.")) and isinstance(logger_, logging.Logger):
            for handler in logger_.handlers:
                handler.setFormatter(layout)


def _check_finite(job: JobConfig, step: int, loss: float, grad_norm: float, finite_at: int) -> None:
    """Stop a run whose loss or gradient norm is no longer finite (the same on every
    rank: both are global), rather than train on NaN weights.

    ``finite_at``: the last step whose logged loss was finite (else the step resumed from).
    The checkpoint to go back to was saved before it: a checkpoint's weights make the
    losses of the steps after it, so one saved at or after ``finite_at`` may hold the
    weights that went bad. Of those, the latest whose files verify is named.
    """
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    folder = checkpoint.job_folder(job)
    saved = checkpoint.last_verified(folder, before=finite_at) if job.checkpoint.enable else None
    if saved is not None:
        resume = (
            f"resume from checkpoint step-{saved} (checkpoint.load_step = {saved}: the latest that verifies "
            f"and was saved before the loss stopped being finite)"
        )
    elif job.checkpoint.enable and checkpoint.resumable_steps(folder):
        resume = f"restart after moving the step folders of {folder} aside (none was saved before the loss went bad)"
    else:
        resume = "restart"
    raise TrainingDiverged(
        f"training diverged at step {step}: loss {loss}, grad_norm {grad_norm}, so the weights "
        f"are no longer usable; accepted: {resume} with a smaller optimizer.lr "
        f"({job.optimizer.lr}), a longer lr_scheduler.warmup_steps ({job.lr_scheduler.warmup_steps}) "
        f"or a smaller training.max_norm ({job.training.max_norm})"
    )


def _saver(job: JobConfig, ckpt_folder) -> checkpoint.Saver | None:
    c = job.checkpoint
    return checkpoint.Saver(ckpt_folder, c.keep_latest_k, c.async_mode) if c.enable else None


def _loop(job: JobConfig, t: Training, state: TrainState, saver, per_step: tuple) -> None:
    """The steps; ``per_step``: what is told of each finished step (``step(n)``)."""
    data = iter(t.dataloader)
    first, finite_at = state.step + 1, state.step
    while state.step < job.training.steps:
        state.step += 1
        loss, grad_norm, lr = t.train_step([next(data) for _ in range(t.accumulation_steps)])
        if state.step == first:  # start-up (planning, the step's compile) is over: catch hangs sooner
            set_collective_timeout(timedelta(seconds=job.comm.train_timeout_seconds))
        t.metrics.add_tokens(t.global_tokens_per_step)
        for hook in per_step:
            hook.step(state.step)
        if state.step % job.metrics.log_freq == 0 or state.step == job.training.steps:
            global_loss, norm = t.global_loss(loss), float(grad_norm)
            t.metrics.log(state.step, global_loss, norm, lr)
            _check_finite(job, state.step, global_loss, norm, finite_at)
            finite_at = state.step
        if t.validator is not None and t.validator.due(state.step):
            t.metrics.log_validation(t.validator.run(t, state.step))
        if saver is not None and _saves(job, state.step):
            _save(job, t, state.step, saver)
    if saver is not None:
        saver.wait()  # a save still being written in the background


def _saves(job: JobConfig, step: int) -> bool:
    """Every ``interval`` steps, at the last step, and after the first if asked, as torchtitan."""
    c = job.checkpoint
    return step % c.interval == 0 or step == job.training.steps or (step == 1 and c.enable_first_step_checkpoint)


def _save(job: JobConfig, t: Training, step: int, saver: checkpoint.Saver) -> None:
    c = job.checkpoint
    train_state = {"data": t.dataloader.state_dict(), "model_id": t.model_id, "world_size": t.runtime.world_size}
    train_state.update(preflight.resume_record(job, t.runtime.world_size, t.scheduler))  # what a resume compares
    model_only = c.last_save_model_only and step == job.training.steps
    dtype = getattr(torch, c.export_dtype) if model_only else None
    hf = _hf_adapter(job) if model_only and c.last_save_in_hf else None
    saver.save(step, t.model, t.optimizer, train_state, model_only_dtype=dtype, hf_adapter=hf)


def _hf_adapter(job: JobConfig):

    family = get_entry(job.model.name).family
    return hf_checkpoint.adapter(family, build_model_config(family, job.model.flavor, job.model.n_layers))


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    # a crash's traceback goes to torchrun's error file too: the launcher shows it
    # when LOG_RANK hides this rank (``failures.py``)
    exit_process(record(main)())
