"""What the metrics write to disk: strict JSON in ``metrics.jsonl`` whatever the values,
and TensorBoard where ``metrics.save_tb_folder`` says (in this process, no ranks)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from torchtitan_autoparallel.config import load_config
from torchtitan_autoparallel.mesh.runtime import Runtime
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


# --- torchtitan's tags, and a fixed MFU peak ------------------------------------


def _tags(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_has_torchtitans_tags_and_ours_beside_them(tmp_path: Path) -> None:
    metrics = MetricsLogger(str(tmp_path), flops_per_token=1e6, peak=Peak(1.0, "test"), world_size=2,
                            device=torch.device("cpu"), writes=True, tensorboard_folder=str(tmp_path / "tb"))
    for step in (1, 2):
        metrics.add_tokens(64)
        record = metrics.log(step, 8.0 - step, 0.5, 1e-3)
    metrics.log_validation(ValidationResult(step=2, loss=6.5, batches=1, seconds=0.1))
    metrics.close()
    tags = _tags(tmp_path / "tb")
    # torchtitan 0.2.2's names (torchtitan/components/metrics.py) for what it logs
    assert tags["loss_metrics/global_avg_loss"] == [(1, 7.0), (2, 6.0)]
    assert tags["n_tokens_seen"] == [(1, 64.0), (2, 128.0)] and tags["validation_metrics/loss"] == [(2, 6.5)]
    assert tags["mfu(%)"][-1][1] == pytest.approx(record["mfu"]) and tags["throughput(tps)"][-1][1] == pytest.approx(record["tps"])
    assert {"grad_norm", "tflops", "lr", "time_metrics/end_to_end(s)"} <= set(tags)
    assert {"train/memory_gib", "train/step_time_s"} <= set(tags)  # ours, which torchtitan does not log
    assert not {"train/loss", "train/tps", "train/mfu", "validation/loss"} & set(tags)


def test_on_gpu_torchtitans_memory_tags(monkeypatch) -> None:
    from torchtitan_autoparallel.train.metrics import cuda_memory_scalars

    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {
        "active_bytes.all.peak": 2**30, "reserved_bytes.all.peak": 2**31, "num_alloc_retries": 3, "num_ooms": 0})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: type("P", (), {"total_memory": 2**33}))
    assert cuda_memory_scalars(torch.device("cuda", 0)) == {
        "memory/max_active(GiB)": 1.0, "memory/max_active(%)": 12.5, "memory/max_reserved(GiB)": 2.0,
        "memory/max_reserved(%)": 25.0, "memory/num_alloc_retries": 3, "memory/num_ooms": 0,
    }
    assert cuda_memory_scalars(torch.device("cpu")) == {}


def test_the_cpu_peak_is_the_cost_profiles_and_never_measured(monkeypatch, tmp_path: Path) -> None:
    from torchtitan_autoparallel.planner.cost.profiles import BUILTIN_PROFILES
    from torchtitan_autoparallel.train.metrics import resolve_peak

    def no_benchmark(*args, **kwargs):
        raise AssertionError("the peak was measured")

    monkeypatch.setattr(torch, "mm", no_benchmark)
    cpu = torch.device("cpu")
    peak = resolve_peak(None, cpu, "float32")
    assert peak.tflops == BUILTIN_PROFILES["cpu_gloo"].peak_tflops["float32"] == resolve_peak(None, cpu, "float32").tflops
    assert "cost profile cpu_gloo's built-in float32 peak" in peak.source and "not measured here" in peak.source
    assert resolve_peak(None, cpu, "bfloat16").tflops == BUILTIN_PROFILES["cpu_gloo"].peak_tflops["bfloat16"]
    calibrated = tmp_path / "profile.json"
    BUILTIN_PROFILES["cpu_gloo"].__class__.to_json(BUILTIN_PROFILES["cpu_gloo"], calibrated)
    data = json.loads(calibrated.read_text())
    data["peak_tflops"]["float32"] = 0.042
    calibrated.write_text(json.dumps(data))
    peak = resolve_peak(None, cpu, "float32", str(calibrated))
    assert peak.tflops == 0.042 and f"calibrated cost profile {calibrated}" in peak.source
    assert resolve_peak(2.5, cpu, "float32", str(calibrated)).tflops == 2.5  # [metrics] peak_tflops wins
