"""Check a job before any rank starts, so bad input is reported once, in one line.

``run_train.sh`` runs this with the same arguments as the job plus ``--ngpu``;
a non-zero exit stops the launch before torchrun prints per-rank failures.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import fields
from pathlib import Path

from torchtitan_autoparallel.config import JobConfig, accumulation_steps, load_config, resolve_degrees
from torchtitan_autoparallel.config.job_config import AutoParallel, LRScheduler
from torchtitan_autoparallel.config.validate import check_planned_validation_shape
from torchtitan_autoparallel.data.tokenizer import DataError, resolve_tokenizer_path
from torchtitan_autoparallel.errors import ConfigError, UserError
from torchtitan_autoparallel.execute import inflight
from torchtitan_autoparallel.models.registry import MODELS, build_model_config, get_entry
from torchtitan_autoparallel.planner.cost.profiles import load_profile
from torchtitan_autoparallel.train import checkpoint
from torchtitan_autoparallel.train.optim import build_lr_scheduler
from torchtitan_autoparallel.train.setup import check_model_fits_mesh, check_seq_len_fits_model, tensorboard_folder


def check(job: JobConfig, ngpu: int, fake: bool = False) -> None:
    """``fake``: the job runs with ``COMM_MODE=fake_backend``."""

    degrees = resolve_degrees(job, ngpu)
    accumulation_steps(job, degrees)
    entry = get_entry(job.model.name)
    model_config = build_model_config(entry.family, job.model.flavor, job.model.n_layers)
    check_model_fits_mesh(model_config, degrees)
    check_seq_len_fits_model(model_config, job)
    if entry.auto_parallel:
        _check_cost_profile(job.autoparallel.cost_profile)
        inflight.mode_from_env()
        check_planned_validation_shape(job)
        _warn_unused_fsdp_setting(job)
        _warn_unused_mip_gap(job)
        _warn_unused_optimality_check(job)
    else:
        _warn_unused_planner_settings(job)
        if job.activation_checkpoint.mode == "auto":
            raise ConfigError(
                f"activation_checkpoint.mode = 'auto': the planner chooses it, and model.name = {job.model.name!r} "
                "is parallelised by hand; accepted for it: none, full, selective"
            )
    checkpoint.check_resume(job, entry.family)
    warn_resumed_changes(job, ngpu, entry.family)
    if not fake:  # a plan for a cluster: the checkpoint folder is the cluster's
        checkpoint.check_destination(job, entry.family)
    _check_writable_folder("job.dump_folder", job.job.dump_folder, job.job.dump_folder)
    if job.metrics.enable_tensorboard:  # an absolute folder may lie outside the dump folder
        _check_writable_folder("metrics.save_tb_folder", job.metrics.save_tb_folder, tensorboard_folder(job))
    if job.autoparallel.export_problem:
        export = job.autoparallel.export_problem
        _check_writable_folder("autoparallel.export_problem", export, str(Path(export).parent))
    try:
        _check_data_paths(job)
    except ConfigError as e:
        if not (fake and entry.auto_parallel):
            raise
        # planning for a cluster from a laptop: the paths are the cluster's
        print(f"warning: {e}; COMM_MODE=fake_backend only plans and reads no data, "
              "but the real run will need it", file=sys.stderr)


# train_state.json's records of what a resume must not change unnoticed (``resume_record``)
LR_SCHEDULE, GLOBAL_BATCH = "lr_schedule", "global_batch"
KEEP_LR_SCHEDULE = "checkpoint.keep_lr_schedule"


def resume_record(job: JobConfig, world_size: int, scheduler=None) -> dict:
    """What a save records for a later resume to compare with its own settings: the
    learning-rate schedule followed (``scheduler``'s when a resume kept a saved one) and
    the global batch, with the parts it is the product of."""
    schedule = getattr(scheduler, LR_SCHEDULE, None) or lr_schedule(job.training.steps, job.lr_scheduler)
    degrees = resolve_degrees(job, world_size)
    batch = {
        "training.local_batch_size": job.training.local_batch_size,
        "data-parallel degree": degrees[0] * degrees[1],
        "gradient accumulation steps": accumulation_steps(job, degrees),
    }
    return {LR_SCHEDULE: schedule, GLOBAL_BATCH: batch}


def lr_schedule(steps: int, cfg: LRScheduler) -> dict:
    """The settings the learning rate of every step depends on (``optim.lr_factor``)."""
    return {"training.steps": steps, **{f"lr_scheduler.{f.name}": getattr(cfg, f.name) for f in fields(LRScheduler)}}


def resumed_scheduler(job: JobConfig, optimizer, saved: dict, done_steps: int):
    """On a rank: the schedule a resume goes on with, from step ``done_steps + 1``: the
    job's, or with ``checkpoint.keep_lr_schedule`` the one saved in ``saved`` (its train
    state), which the scheduler then carries for the next save to record."""

    kept = saved.get(LR_SCHEDULE) if job.checkpoint.keep_lr_schedule else None
    steps, cfg = job.training.steps, job.lr_scheduler
    if kept:
        steps = kept["training.steps"]
        names = {f.name for f in fields(LRScheduler)}
        cfg = LRScheduler(**{k.split(".", 1)[1]: v for k, v in kept.items() if k.split(".", 1)[1] in names})
    scheduler = build_lr_scheduler(optimizer, steps, cfg, done_steps)
    setattr(scheduler, LR_SCHEDULE, lr_schedule(steps, cfg))
    return scheduler


def warn_resumed_changes(job: JobConfig, ngpu: int, family: str) -> None:
    """One line for each of what a resume changes silently otherwise: the learning-rate
    schedule (the steps to come follow the new one) and the global batch (each step
    sees more or fewer samples, under a learning rate tuned for the saved one)."""
    found = _resumed_train_state(job, family)
    if found is None:
        return
    where, saved = found
    now = resume_record(job, ngpu)
    if (old := saved.get(LR_SCHEDULE)) and (changes := _changes(old, now[LR_SCHEDULE])):
        if job.checkpoint.keep_lr_schedule:
            print(f"note: resuming {where}: {changes} are not applied to the learning rate: {KEEP_LR_SCHEDULE} "
                  "= true keeps the saved schedule", file=sys.stderr)
        else:
            print(f"warning: resuming {where} with another learning-rate schedule: {changes}; the steps to "
                  f"come follow the new one; accepted: {KEEP_LR_SCHEDULE} = true keeps the saved one",
                  file=sys.stderr)
    if (old := saved.get(GLOBAL_BATCH)) and _product(old) != _product(now[GLOBAL_BATCH]):
        print(f"warning: resuming {where} with another global batch: {_product(old)} samples a step "
              f"({_parts(old)}) -> {_product(now[GLOBAL_BATCH])} ({_parts(now[GLOBAL_BATCH])}); the learning "
              f"rate is not scaled with it; accepted: {_same_batch(job, _product(old), now[GLOBAL_BATCH])}",
              file=sys.stderr)


def _resumed_train_state(job: JobConfig, family: str) -> tuple[str, dict] | None:
    """(where, train state) of the checkpoint a run of ``job`` goes on from; None when it
    starts at step 1 (fresh, or from another checkpoint's weights only)."""

    wanted = checkpoint.job_model_id(job, family)
    if (step := checkpoint.step_to_load(job)) is not None:
        return f"checkpoint step-{step}", checkpoint.read_train_state(checkpoint.job_folder(job), step, wanted)
    c = job.checkpoint
    path = checkpoint.initial_load_path(job)
    if path is None or c.initial_load_model_only or c.initial_load_in_hf:
        return None
    return f"checkpoint {str(path)!r}", checkpoint.check_initial(path, wanted, False)


def _changes(old: dict, new: dict) -> str:
    """'key old -> new' for each setting that differs, comma-separated ('' for none)."""
    return ", ".join(f"{k} {old[k]!r} -> {new[k]!r}" for k in new if k in old and old[k] != new[k])


def _same_batch(job: JobConfig, samples: int, now: dict) -> str:
    """The setting that gives ``samples`` a step again on this run's data-parallel ranks."""
    dp = now["data-parallel degree"]
    if samples % (job.training.local_batch_size * dp) == 0:  # gradient accumulation makes up the rest
        return f"training.global_batch_size = {samples} keeps the saved batch"
    if samples % dp == 0:
        return f"training.local_batch_size = {samples // dp} (training.global_batch_size = -1) keeps the saved batch"
    return f"a data-parallel degree that divides {samples} keeps the saved batch"


def _product(batch: dict) -> int:
    result = 1
    for value in batch.values():
        result *= value
    return result


def _parts(batch: dict) -> str:
    return " x ".join(f"{k} {v}" for k, v in batch.items())


def _check_data_paths(job: JobConfig) -> None:

    try:
        resolve_tokenizer_path(job.model.tokenizer_path)
    except DataError as e:
        raise ConfigError(f"model.tokenizer_path: {e}") from None
    _check_dataset_path("training", job.training.dataset, job.training.dataset_path)
    if job.validation.enable:
        _check_dataset_path("validation", job.validation.dataset, job.validation.dataset_path)


def _check_dataset_path(section: str, dataset: str, path: str) -> None:
    if dataset in ("text", "jsonl") and not Path(path).exists():
        raise ConfigError(
            f"{section}.dataset_path {path!r} does not exist; accepted: a {dataset} "
            f"file or a folder of them"
        )


def _check_writable_folder(key: str, value: str, folder: str) -> None:
    """The run writes into ``folder`` (its plan, metrics, checkpoints, an exported
    problem): refuse one it cannot make or write now, not after planning. Probed with a
    folder made and removed at once, in the deepest part that exists, so a refused job
    leaves nothing behind."""
    existing = Path(folder).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    accepted = "accepted: a path in a folder this user can create and write"
    if not existing.is_dir():
        raise ConfigError(f"{key} {value!r}: {str(existing)!r} is not a folder; {accepted}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=existing))
    except OSError as e:
        raise ConfigError(
            f"{key} {value!r} cannot be written ({e.strerror} in {str(existing)!r}); {accepted}"
        ) from None


def _warn_unused_planner_settings(job: JobConfig) -> None:
    """A hand-written plan ignores ``[autoparallel]``: say so rather than let a budget
    or solver the user set pass for applied."""

    default = AutoParallel()
    changed = [
        f"autoparallel.{f.name} = {getattr(job.autoparallel, f.name)!r}"
        for f in fields(AutoParallel)
        if getattr(job.autoparallel, f.name) != getattr(default, f.name)
    ]
    if changed:
        print(
            f"warning: {', '.join(changed)} {'has' if len(changed) == 1 else 'have'} no effect: "
            f"model.name = {job.model.name!r} trains with torchtitan's "
            f"hand-written plan; the planner runs for "
            f"{', '.join(n for n, e in MODELS.items() if e.auto_parallel)}",
            file=sys.stderr,
        )


def _warn_unused_fsdp_setting(job: JobConfig) -> None:
    """A plan places every gather itself: torchtitan's FSDP reshard setting is not read."""
    value = job.parallelism.fsdp_reshard_after_forward
    if value != "default":
        print(
            f"warning: parallelism.fsdp_reshard_after_forward = {value!r} has no effect: "
            f"model.name = {job.model.name!r} is planned, and its plan decides which "
            "gathered weights the backward reuses",
            file=sys.stderr,
        )


def _warn_unused_mip_gap(job: JobConfig) -> None:
    """Only a MIP search stops at a gap: TRW-S (and its overlap sweep) runs none."""
    a = job.autoparallel
    if a.mip_gap is None:
        return
    if a.solver == "approx":
        print(
            f"warning: autoparallel.mip_gap = {a.mip_gap!r} has no effect: solver = {a.solver!r} "
            "runs no MIP search; it applies to solver = ilp or auto",
            file=sys.stderr,
        )


def _warn_unused_optimality_check(job: JobConfig) -> None:
    """The check's LP bounds the plain objective; with overlap the savings lower the
    objective below it, so each overlap solver proves its own bound instead."""
    a = job.autoparallel
    if a.optimality_check and a.overlap:
        print(
            "warning: autoparallel.optimality_check = True has no effect with autoparallel.overlap = True: "
            "every overlap solver reports its own proven bound (the log's 'solve: ... bound ..., gap ...' "
            "and plan.json's lower_bound)",
            file=sys.stderr,
        )


def _check_cost_profile(name: str) -> None:

    if name == "auto":
        return
    try:
        load_profile(name)
    except ValueError as e:
        raise ConfigError(f"autoparallel.cost_profile: {e}") from None


def parse_ngpu(text: str) -> int:
    try:
        ngpu = int(text)
    except ValueError:
        raise ConfigError(f"NGPU={text!r} is not a number; accepted: a positive integer") from None
    if ngpu < 1:
        raise ConfigError(f"NGPU={ngpu}; accepted: a positive integer")
    return ngpu


# COMM_MODE's values: unset for real ranks, or one process on a fake process group
# (``mesh/runtime.py``); any other value used to be ignored, silently.
FAKE_BACKEND = "fake_backend"
COMM_MODES = ("", FAKE_BACKEND)


def parse_comm_mode(text: str) -> bool:
    """``COMM_MODE`` -> whether the job runs on the fake backend."""
    if text not in COMM_MODES:
        raise ConfigError(f"COMM_MODE={text!r} is not accepted; accepted: unset (real ranks) or {FAKE_BACKEND}")
    return text == FAKE_BACKEND


def parse_log_ranks(text: str, ngpu: int) -> set[int]:
    """``LOG_RANK`` (torchrun's ``--local-ranks-filter``) -> the ranks it shows. torchrun
    shows nothing for a rank it does not start, silently, and fails on a non-number
    with a traceback."""
    accepted = f"accepted: ranks of 0..{ngpu - 1}, comma-separated (e.g. 0 or 0,1)"
    try:
        ranks = {int(r) for r in text.split(",")}
    except ValueError:
        raise ConfigError(f"LOG_RANK={text!r} is not a list of ranks; {accepted}") from None
    outside = sorted(r for r in ranks if not 0 <= r < ngpu)
    if outside:
        names = ", ".join(map(str, outside))
        raise ConfigError(f"LOG_RANK={text!r}: no rank {names} among the {ngpu} launched (NGPU={ngpu}); {accepted}")
    return ranks


def main(argv: list[str]) -> int:
    try:
        if len(argv) < 2 or argv[0] != "--ngpu":
            raise ConfigError("usage: preflight --ngpu N [--section.key value ...]")
        check(load_config(argv[2:]), parse_ngpu(argv[1]), parse_comm_mode(os.environ.get("COMM_MODE", "")))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
