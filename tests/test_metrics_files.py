"""What the metrics write to disk: strict JSON in ``metrics.jsonl`` whatever the values,
and TensorBoard where ``metrics.save_tb_folder`` says (in this process, no ranks)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from torchtitan_autoparallel.config import load_config
from torchtitan_autoparallel.distributed.runtime import Runtime
from torchtitan_autoparallel.train.metrics import MetricsLogger, Peak
from torchtitan_autoparallel.train.setup import build_metrics
from torchtitan_autoparallel.train.validate import ValidationResult


def _strict(line: str) -> dict:
    """``json.loads`` less Python's extension: a bare NaN or Infinity is an error, as in JSON."""
    def refuse(name: str):
        raise ValueError(f"{name} is not JSON: {line}")

    return json.loads(line, parse_constant=refuse)


def test_a_value_that_is_not_finite_is_written_as_null(tmp_path: Path) -> None:
    metrics = MetricsLogger(str(tmp_path), flops_per_token=1.0, peak=Peak(1.0, "test"), world_size=1,
                            device=torch.device("cpu"), writes=True, tensorboard_folder=None)
    metrics.add_tokens(8)
    record = metrics.log(1, math.nan, math.inf, 1e-3)
    metrics.log_validation(ValidationResult(step=1, loss=-math.inf, batches=2, seconds=0.5))
    metrics.add_tokens(8)
    metrics.log(2, 1.5, 0.25, 1e-3)
    metrics.close()
    assert math.isnan(record["loss"])  # the caller (the divergence check) still sees the value
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    first, validation, second = (_strict(line) for line in lines)
    assert first["step"] == 1 and first["loss"] is None and first["grad_norm"] is None
    assert first["tps"] > 0 and first["lr"] == 1e-3
    assert validation["validation_loss"] is None and validation["validation_batches"] == 2
    assert (second["loss"], second["grad_norm"]) == (1.5, 0.25)


@pytest.mark.parametrize("absolute", [True, False])
def test_tensorboard_folder_absolute_as_given_relative_under_the_dump_folder(tmp_path: Path, absolute: bool) -> None:
    dump = tmp_path / "run"
    tb = tmp_path / "elsewhere" / "tb" if absolute else Path("board")
    job = load_config(["--job.dump_folder", str(dump), "--metrics.enable_tensorboard", "true",
                       "--metrics.save_tb_folder", str(tb), "--metrics.peak_tflops", "1"])
    runtime = Runtime(torch.device("cpu"), "gloo", rank=0, world_size=1, local_rank=0)
    metrics = build_metrics(job, runtime, flops_per_token=1.0)
    metrics.add_tokens(8)
    metrics.log(1, 1.0, 1.0, 1e-3)
    metrics.close()
    expected = tb if absolute else dump / tb
    assert list(expected.glob("events.out.tfevents.*")), sorted(tmp_path.rglob("*"))
    if absolute:
        assert not (dump / tmp_path.relative_to("/")).exists()  # not the old dump/<absolute path>
