"""``metrics.enable_wandb``: rank 0 logs the TensorBoard values to Weights & Biases.

End to end offline (``WANDB_MODE=offline``: no network here): wandb's own run
summary, printed when the run finishes, holds the last step's loss of
metrics.jsonl. In process, with a stand-in run: what is logged, at which step.
A run that cannot start is one line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from _run import LLAMA3_CONFIG, read_metrics, run_launcher

from torchtitan_autoparallel.errors import UserError


@pytest.mark.multirank
def test_an_offline_run_gets_the_logged_values(tmp_path: Path) -> None:
    dump = tmp_path / "out"
    run = run_launcher(
        ["--job.dump_folder", dump, "--model.name", "llama3", "--training.steps", "2", "--training.seq_len", "32",
         "--training.local_batch_size", "1", "--metrics.peak_tflops", "1",
         "--metrics.enable_tensorboard", "false", "--metrics.enable_wandb", "true"],
        ngpu=2, config=LLAMA3_CONFIG, env={"WANDB_MODE": "offline"}, timeout=300,
    )
    assert run.returncode == 0, run.tail()
    out = run.stdout + run.stderr
    assert f"Run data is saved locally in {dump / 'wandb'}/offline-run-" in out, run.tail()
    summary = re.search(r"Run summary:(.*?)wandb: \n", out, re.S)
    assert summary, run.tail()
    logged = float(re.search(r"loss_metrics/global_avg_loss ([0-9.]+)", summary.group(1)).group(1))
    assert logged == pytest.approx(read_metrics(dump)[-1]["loss"], abs=1e-5)  # wandb prints 6 digits


class _Run:
    def __init__(self) -> None:
        self.logged: list[tuple[dict, int]] = []
        self.finished = False

    def log(self, values: dict, step: int) -> None:
        self.logged.append((values, step))

    def finish(self) -> None:
        self.finished = True


def test_steps_and_validations_are_logged_at_their_step(tmp_path: Path) -> None:
    from torchtitan_autoparallel.train.metrics import MetricsLogger, Peak
    from torchtitan_autoparallel.train.validate import ValidationResult

    run = _Run()
    metrics = MetricsLogger(str(tmp_path), flops_per_token=1e6, peak=Peak(1.0, "test"), world_size=1,
                            device=torch.device("cpu"), writes=True, tensorboard_folder=None, wandb_run=run)
    metrics.add_tokens(100)
    record = metrics.log(1, 7.5, 0.5, 1e-3)
    metrics.log_validation(ValidationResult(step=1, loss=7.25, batches=2, seconds=0.1))
    metrics.close()
    (train, step), (validation, vstep) = run.logged
    assert step == vstep == 1 and run.finished
    # torchtitan's names for what torchtitan logs, so its users' W&B panels fill
    assert train["loss_metrics/global_avg_loss"] == 7.5 and train["grad_norm"] == 0.5 and train["lr"] == 1e-3
    assert train["throughput(tps)"] == record["tps"] and train["mfu(%)"] == record["mfu"] and train["n_tokens_seen"] == 100
    assert train["train/memory_gib"] == record["memory_gib"] and "train/loss" not in train
    assert "train/step" not in train and "train/time" not in train
    assert validation == {"validation_metrics/loss": 7.25}


def test_a_run_that_cannot_start_is_one_line(monkeypatch, tmp_path: Path) -> None:
    import wandb

    from torchtitan_autoparallel.config import load_config
    from torchtitan_autoparallel.train.wandb_log import start_run

    def refuse(**kwargs):
        raise RuntimeError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])\nmore")

    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(UserError) as e:
        start_run(load_config(["--metrics.enable_wandb", "true", "--job.dump_folder", str(tmp_path)]))
    assert str(e.value) == (
        "metrics.enable_wandb: wandb could not start a run (api_key not configured (no-tty). call "
        "wandb.login(key=[your_api_key])); accepted: `wandb login` (or WANDB_API_KEY), WANDB_MODE=offline "
        "to keep the run on disk, or enable_wandb = false"
    )
