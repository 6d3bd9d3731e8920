"""experiments/gpu/training.py reads torchtitan 0.2.2's console lines as its trainer writes them.

The GPU check's torchtitan stage cannot run without a GPU, so its parser is checked
here on lines in that trainer's own format (``components/metrics.py``: colour codes,
``tps`` with thousands separators, ``mfu`` in percent, the step's peak reserved memory).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from _run import REPO

spec = importlib.util.spec_from_file_location("gpu_training", REPO / "experiments" / "gpu" / "training.py")
training = importlib.util.module_from_spec(spec)
spec.loader.exec_module(training)

RED, BLUE, RESET = "\x1b[31m", "\x1b[34m", "\x1b[39m"


def _titan_line(step: int, tps: int, mfu: float, reserved_gib: float) -> str:
    return (f"[rank0]:[titan] 2026-12-06 04:00:00,000 - root - INFO - {RED}step: {step:2}  loss: {9.5 - step:8.5f}  "
            f"grad_norm: {1.25:7.4f}  memory: {reserved_gib:5.2f}GiB({reserved_gib / 1.4:.2f}%)  "
            f"{BLUE}tps: {tps:,}  tflops: {tps * 11.3e-3:,.2f}  mfu: {mfu:.2f}%{RESET}")


def test_torchtitan_console_lines_give_the_steady_state(tmp_path: Path) -> None:
    lines = ["[rank0]:[titan] starting", _titan_line(1, 1_200, 1.0, 90.0), _titan_line(2, 9_800, 8.0, 97.5)]
    lines += [_titan_line(s, tps, mfu, 96.0) for s, tps, mfu in [(3, 31_000, 35.0), (4, 33_000, 37.0), (5, 32_000, 36.0)]]
    log = tmp_path / "qwen_torchtitan.log"
    log.write_text("\n".join(lines) + "\n")
    row = training.torchtitan(log, tmp_path / "no_tb", tokens_per_step=4 * 4096)
    assert row["steps"] == 5
    assert row["tokens_per_s"] == 32_000.0 and row["mfu"] == 36.0  # medians after the 2 warm-up steps
    assert row["peak_memory_gib_measured"] == 97.5  # the largest step's peak, not the last one
    assert row["step_s_measured"] == pytest.approx(4 * 4096 / 32_000, abs=1e-4)
    assert row["peak_memory_gib_predicted"] is None and row["step_s_predicted"] is None


def test_a_stage_that_did_not_train_is_a_check_not_a_row(tmp_path: Path) -> None:
    logs, runs = tmp_path / "logs", tmp_path / "runs"
    logs.mkdir()
    (logs / "qwen_torchtitan.log").write_text("torch.OutOfMemoryError: CUDA out of memory.\n")
    summary = training.summarise(runs, logs, tokens_per_step=16384)
    assert summary["rows"] == []
    assert summary["checks"] == [{"stage": "qwen_torchtitan", "trained": False,
                                  "last_line": "torch.OutOfMemoryError: CUDA out of memory."}]
    assert "qwen_torchtitan did not train: `torch.OutOfMemoryError" in training.markdown(summary)
    json.dumps(summary)  # what training.json holds
