"""``[comm]`` collective timeouts on real ranks (gloo).

Start-up's timeout stretches by the solver's time limit, so the ranks waiting
for rank 0's plan do not give up while it solves; from the end of the first
step on, ``train_timeout_seconds`` holds, so a rank stuck in a collective
fails in seconds instead of torch's default half hour.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from _run import LLAMA3_CONFIG, PYTHON, REPO, read_metrics

from torchtitan_autoparallel.distributed.runtime import startup_timeout
from torchtitan_autoparallel.train import failures

pytestmark = pytest.mark.multirank
TESTS = Path(__file__).resolve().parent


def _launch(where: str, seconds: float, dump: Path, *job_args: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [str(PYTHON), "-m", "torchtitan_autoparallel.train.launch", "--ngpu", "2", "--standalone",
           "--local-ranks-filter", "0", "--role", "rank", "--tee", "3", "--",
           "-m", "_stalling_rank", where, str(seconds),
           "--job.config_file", str(LLAMA3_CONFIG), "--job.dump_folder", str(dump),
           "--model.name", "llama3_auto_parallel", "--training.steps", "2", "--training.seq_len", "64",
           "--training.local_batch_size", "2", "--metrics.peak_tflops", "1",
           "--metrics.enable_tensorboard", "false", *job_args]
    start = time.perf_counter()
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return run, time.perf_counter() - start


def test_startup_timeout_adds_the_solve() -> None:
    assert startup_timeout(300, 120).total_seconds() == 540
    assert startup_timeout(300, 0).total_seconds() == 300


def test_ranks_wait_out_a_solve_longer_than_the_init_timeout(tmp_path: Path) -> None:
    # rank 0 solves 6 s longer than usual; init_timeout_seconds alone (2 s) would end the wait
    run, _ = _launch("solve", 6, tmp_path, "--comm.init_timeout_seconds", "2", "--autoparallel.time_limit_s", "10")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "collective timeout 22 s until the first step is done, then 100 s" in run.stderr, run.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_a_stuck_collective_after_the_first_step_fails_within_the_train_timeout(tmp_path: Path) -> None:
    # rank 1 comes 200 s late to step 2; rank 0 gives up after 3 s
    run, seconds = _launch("step", 200, tmp_path, "--comm.train_timeout_seconds", "3")
    assert run.returncode != 0, run.stderr[-3000:]
    last = run.stderr.rstrip().splitlines()[-1]
    assert last.startswith("error: rank 0 failed") and "timed out" in last.lower(), run.stderr[-3000:]
    assert last.endswith(f"({failures.TIMEOUT_HINT})"), last
    assert seconds < 120, f"the job took {seconds:.0f} s to fail"
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]
