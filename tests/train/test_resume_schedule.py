"""A resume that changes the learning-rate schedule or the global batch says so
before any rank starts (``preflight.warn_resumed_changes``), and
``checkpoint.keep_lr_schedule`` keeps the saved schedule (issue 75)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from _run import LLAMA3_CONFIG, read_metrics, run_launcher, train

from torchtitan_autoparallel.config import load_config
from torchtitan_autoparallel.launch import preflight
from torchtitan_autoparallel.train.optim import lr_factor

MODEL_ID = "llama3:debugmodel"


def _job(dump: Path, *args: str):
    return load_config(["--job.dump_folder", str(dump), "--checkpoint.enable", "true", "--checkpoint.load_step", "5",
                        "--training.local_batch_size", "4", *args])


def _saved(dump: Path, *args: str, ngpu: int = 2) -> None:
    """A step-5 train_state.json as a save of ``args`` on ``ngpu`` ranks writes it."""
    job = load_config(["--job.dump_folder", str(dump), "--training.local_batch_size", "4", *args])
    folder = dump / "checkpoint" / "step-5"
    folder.mkdir(parents=True)
    state = {"step": 5, "model_id": MODEL_ID, "world_size": ngpu, **preflight.resume_record(job, ngpu)}
    (folder / "train_state.json").write_text(json.dumps(state))


def _warnings(job, capsys, ngpu: int = 2) -> list[str]:
    preflight.warn_resumed_changes(job, ngpu, "llama3")
    return capsys.readouterr().err.splitlines()


def test_the_same_settings_resume_without_a_word(tmp_path: Path, capsys) -> None:
    _saved(tmp_path, "--training.steps", "10")
    assert _warnings(_job(tmp_path, "--training.steps", "10"), capsys) == []


def test_another_schedule_is_one_warning_naming_old_and_new(tmp_path: Path, capsys) -> None:
    _saved(tmp_path, "--training.steps", "10")
    lines = _warnings(_job(tmp_path, "--training.steps", "20", "--lr_scheduler.warmup_steps", "3"), capsys)
    assert lines == [
        "warning: resuming checkpoint step-5 with another learning-rate schedule: training.steps 10 -> 20, "
        "lr_scheduler.warmup_steps 2 -> 3; the steps to come follow the new one; accepted: "
        "checkpoint.keep_lr_schedule = true keeps the saved one"
    ], lines
    kept = _warnings(_job(tmp_path, "--training.steps", "20", "--checkpoint.keep_lr_schedule", "true"), capsys)
    assert kept == [
        "note: resuming checkpoint step-5: training.steps 10 -> 20 are not applied to the learning rate: "
        "checkpoint.keep_lr_schedule = true keeps the saved schedule"
    ], kept


def test_another_global_batch_is_one_warning(tmp_path: Path, capsys) -> None:
    _saved(tmp_path, "--training.steps", "10")  # 4 a rank x 2 ranks
    lines = _warnings(_job(tmp_path, "--training.steps", "10"), capsys, ngpu=4)
    assert lines == [
        "warning: resuming checkpoint step-5 with another global batch: 8 samples a step "
        "(training.local_batch_size 4 x data-parallel degree 2 x gradient accumulation steps 1) -> 16 "
        "(training.local_batch_size 4 x data-parallel degree 4 x gradient accumulation steps 1); the learning "
        "rate is not scaled with it; accepted: training.local_batch_size = 2 (training.global_batch_size = -1) "
        "keeps the saved batch"
    ], lines
    # fewer samples a rank: gradient accumulation can make up the saved batch
    fewer = _warnings(_job(tmp_path, "--training.steps", "10", "--training.local_batch_size", "1"), capsys)
    assert fewer[0].endswith("accepted: training.global_batch_size = 8 keeps the saved batch"), fewer
    # the same 8 samples, as 2 micro-batches of 2 on 2 ranks: no warning
    same = _job(tmp_path, "--training.steps", "10", "--training.local_batch_size", "2",
                "--training.global_batch_size", "8")
    assert _warnings(same, capsys) == []


def test_a_checkpoint_saved_before_the_record_is_resumed_quietly(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "checkpoint" / "step-5"
    folder.mkdir(parents=True)
    (folder / "train_state.json").write_text(json.dumps({"step": 5, "model_id": MODEL_ID}))
    assert _warnings(_job(tmp_path, "--training.steps", "99"), capsys) == []


def test_the_kept_schedule_drives_the_lr_and_is_saved_again(tmp_path: Path) -> None:
    saved_job = load_config(["--training.steps", "10", "--lr_scheduler.warmup_steps", "2"])
    saved = preflight.resume_record(saved_job, 1)
    job = load_config(["--training.steps", "20", "--lr_scheduler.warmup_steps", "5", "--checkpoint.keep_lr_schedule"])
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    optimizer.param_groups[0]["initial_lr"] = 1.0  # set by the schedule the run was built with
    scheduler = preflight.resumed_scheduler(job, optimizer, saved, 5)
    assert scheduler.get_last_lr()[0] == pytest.approx(lr_factor(6, 10, saved_job.lr_scheduler))
    # the next save records the schedule followed, not the job's settings
    assert preflight.resume_record(job, 1, scheduler)["lr_schedule"] == saved["lr_schedule"]
    job.checkpoint.keep_lr_schedule = False
    scheduler = preflight.resumed_scheduler(job, optimizer, saved, 5)
    assert scheduler.get_last_lr()[0] == pytest.approx(lr_factor(6, 20, job.lr_scheduler))


@pytest.mark.multirank
def test_a_resume_with_more_steps_warns_before_launch_and_keeps_the_schedule_when_asked(tmp_path: Path) -> None:
    first = tmp_path / "first"
    common = ("--model.name", "llama3", "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--model.n_layers", "2")
    train(first, *common, steps=4, local_batch_size=2)
    state = json.loads((first / "checkpoint" / "step-4" / "train_state.json").read_text())
    assert state["lr_schedule"]["training.steps"] == 4, state
    runs = {}
    for keep in ("false", "true"):
        dump = tmp_path / keep
        shutil.copytree(first / "checkpoint", dump / "checkpoint")
        runs[keep] = run_launcher(
            ["--job.dump_folder", dump, "--training.steps", "6", "--training.seq_len", "64",
             "--training.local_batch_size", "2", "--metrics.peak_tflops", "1", "--metrics.enable_tensorboard",
             "false", "--checkpoint.keep_lr_schedule", keep, *common], timeout=300)
        assert runs[keep].returncode == 0, runs[keep].tail()
    assert "warning: resuming checkpoint step-4 with another learning-rate schedule: training.steps 4 -> 6;" \
        in runs["false"].stderr, runs["false"].tail()
    assert "note: resuming checkpoint step-4: training.steps 4 -> 6 are not applied" in runs["true"].stderr
    job = load_config(["--job.config_file", str(LLAMA3_CONFIG)])  # the launches' schedule
    for keep, total in (("false", 6), ("true", 4)):
        lrs = {r["step"]: r["lr"] for r in read_metrics(tmp_path / keep)}
        expected = {s: job.optimizer.lr * lr_factor(s, total, job.lr_scheduler) for s in (5, 6)}
        assert lrs == pytest.approx(expected), (keep, lrs, expected)
