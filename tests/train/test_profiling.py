"""``[profiling]``: which steps are traced, and a traced 2-rank run of an automatic plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _run import CONFIGS, check_records, read_metrics, run_launcher
from torch.profiler import ProfilerAction

from torchtitan_autoparallel.config import load_config
from torchtitan_autoparallel.train.profiling import StepProfiler


def _actions(first_step: int, freq: int, steps: int) -> dict[int, ProfilerAction]:
    job = load_config(["--profiling.enable_profiling", "true", "--profiling.profile_freq", str(freq)])
    profiler = StepProfiler(job, rank=0, device=torch.device("cpu"), first_step=first_step)
    return {first_step + i: profiler._action(i) for i in range(steps)}


def test_the_multiples_of_profile_freq_are_traced_after_three_warm_up_steps() -> None:
    a = _actions(first_step=1, freq=10, steps=20)
    assert [s for s, x in a.items() if x == ProfilerAction.RECORD_AND_SAVE] == [10, 20]
    assert [s for s, x in a.items() if x == ProfilerAction.WARMUP] == [7, 8, 9, 17, 18, 19]
    # a resumed run keeps the same steps: step 10 is traced whether the run started at 1 or 6
    resumed = _actions(first_step=6, freq=10, steps=5)
    assert resumed == {s: a[s] for s in range(6, 11)}
    assert set(_actions(first_step=1, freq=1, steps=3).values()) == {ProfilerAction.RECORD_AND_SAVE}


@pytest.mark.multirank
def test_a_profiled_run_writes_each_ranks_trace(tmp_path: Path) -> None:
    steps = 3
    args = [
        "--model.name", "llama3_auto_parallel", "--job.dump_folder", tmp_path,
        "--training.steps", steps, "--training.seq_len", 64, "--training.local_batch_size", 2,
        "--metrics.peak_tflops", 1, "--metrics.enable_tensorboard", "false",
        "--profiling.enable_profiling", "true", "--profiling.profile_freq", 2,
        "--profiling.enable_memory_snapshot", "true",
    ]
    run = run_launcher(args, ngpu=2, config=CONFIGS["llama3"], log_rank="0,1")
    assert run.returncode == 0, run.tail()
    out = run.stdout + run.stderr
    check_records(read_metrics(tmp_path), steps)
    traces = tmp_path / "profile_traces"
    assert sorted(p.name for p in traces.iterdir()) == ["iteration_2"]
    for rank in (0, 1):
        events = json.loads((traces / "iteration_2" / f"rank{rank}_trace.json").read_text())["traceEvents"]
        names = {e.get("name", "") for e in events}
        # the planned step's collectives and its matmuls are in the trace
        assert "aten::mm" in names and "gloo:all_gather" in names, sorted(names)[:50]
        assert "aten::mm" in (traces / "iteration_2" / f"rank{rank}_ops.txt").read_text()
    assert f"profile of step 2 written to {traces / 'iteration_2' / 'rank0_trace.json'}" in out, run.tail()
    assert "enable_memory_snapshot records CUDA memory: no effect on CPU ranks" in out, run.tail()
    assert not (tmp_path / "memory_snapshot").exists()
    # Kineto's CPU-only noise is kept out of the log
    assert "gpuGetDeviceCount" not in out and "USDT" not in out and "Profiler clears events" not in out, run.tail()
