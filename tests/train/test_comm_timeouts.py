"""``[comm]`` collective timeouts on real ranks (gloo).

Start-up's timeout stretches by the solver's time limit, so the ranks waiting
for rank 0's plan do not give up while it solves; from the end of the first
step on, ``train_timeout_seconds`` holds, so a rank stuck in a collective
fails in seconds instead of torch's default half hour, and the job's line names
the rank that never reached the collective, not the one that timed out waiting.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from _run import (
    LLAMA3_CONFIG,
    REPO,
    alive,
    child_pids,
    finish,
    launch_test_module,
    module_launch,
    rank_logs,
    rank_pids,
    read_metrics,
)

from torchtitan_autoparallel.mesh.runtime import startup_timeout
from torchtitan_autoparallel.train import failures

pytestmark = pytest.mark.multirank


def _job(where: str, seconds: float, dump: Path, *job_args: str) -> tuple[str, ...]:
    """``_stalling_rank``'s arguments: the trainer's, with one rank held up at ``where``."""
    return ("_stalling_rank", where, str(seconds),
            "--job.config_file", str(LLAMA3_CONFIG), "--job.dump_folder", str(dump),
            "--model.name", "llama3_auto_parallel", "--training.steps", "2", "--training.seq_len", "64",
            "--training.local_batch_size", "2", "--metrics.peak_tflops", "1",
            "--metrics.enable_tensorboard", "false", *job_args)


def _launch(where: str, seconds: float, dump: Path, *job_args: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    run = launch_test_module(*_job(where, seconds, dump, *job_args), timeout=300)
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
    assert run.returncode == failures.STALLED_EXIT, run.stderr[-3000:]
    # the frozen rank is named, not rank 0 whose collective timed out waiting for it
    last = run.stderr.rstrip().splitlines()[-1]
    assert last == f"error: {failures.stalled_message([1], 0, 3.0)}", run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    assert seconds < 120, f"the job took {seconds:.0f} s to fail"
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]


def test_a_hung_launch_is_stopped_showing_where_its_ranks_were(tmp_path: Path) -> None:
    # rank 0's solve takes ten minutes; the test gives up on the job once it solves
    job = _job("solve", 600, tmp_path / "job", "--model.n_layers", "2")
    cmd, env = module_launch(*job, env={**os.environ, "PET_LOG_DIR": str(tmp_path / "logs")})
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    _wait_for_line(tmp_path / "logs", "stalling the solve for", proc)
    time.sleep(1)  # rank 1 has checked the problem with rank 0: it now waits for the plan
    ranks = rank_pids(proc.pid)
    helpers = child_pids(proc.pid)  # the fork server and resource tracker, when the ranks are forked
    start = time.perf_counter()
    returncode, _, err = finish(proc, 0.1, tmp_path / "logs")  # as if its timeout had passed
    assert time.perf_counter() - start < 60, err[-3000:]
    assert returncode == -9 and len(ranks) >= 2, (returncode, ranks)
    # rank 0's threads, printed on SIGUSR1 by the trainer; torchrun's own stop; then
    # each rank's innermost frames, rank 1's from a log that LOG_RANK=0 does not show
    assert "(most recent call first)" in err and "torchtitan_autoparallel/launch/main.py" in err, err[-3000:]
    assert "stopped: the launcher received SIGTERM; every rank was stopped" in err, err[-3000:]
    stacks = {r: [x for x in err.splitlines() if x.startswith(f"[rank{r}]:stack: ")] for r in (0, 1)}
    assert any("_stalling_rank.py" in x and " in slow" in x for x in stacks[0]), err[-3000:]
    assert any(" in broadcast" in x for x in stacks[1]), err[-3000:]  # waiting for rank 0's plan
    time.sleep(1)  # an orphan is reaped by init, not at once
    left = [pid for pid in ranks + helpers if alive(pid)]
    assert not left, f"ranks or helpers still running after the launcher stopped: {left}"


def _wait_for_line(logs: Path, text: str, proc: subprocess.Popen, timeout: float = 240) -> None:
    """Until rank 0's torchrun log (under ``logs``) holds ``text``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        if any(text in p.read_text(errors="replace") for rank, p in rank_logs(logs) if rank == 0):
            return
        time.sleep(0.5)
    proc.kill()
    raise AssertionError(f"rank 0 never logged {text!r} (launcher exit status {proc.poll()})")


def test_the_stalled_line_names_the_ranks_first() -> None:
    one = failures.stalled_message([3], 0, 3.0)
    assert one.startswith("rank 3 stopped responding: it never reached the collective that rank 0 waited 3 s in")
    assert "LOG_RANK=3" in one and "comm.train_timeout_seconds" in one
    several = failures.stalled_message([1, 2], 0, None)
    assert several.startswith("ranks 1, 2 stopped responding: they never reached the collective that rank 0 waited in")
    assert failures._waited_s("[gloo/pair.cc:129] Timed out waiting 3000ms for send operation") == 3.0


def test_a_timeout_with_every_rank_waiting_is_left_as_it_was(monkeypatch) -> None:
    # nothing points at one rank (all timed out): the error goes on unchanged
    monkeypatch.setattr(failures, "ranks_that_never_arrived", lambda: [])
    assert failures.name_stalled_ranks(RuntimeError("Timed out waiting 3000ms")) is None
    assert failures.name_stalled_ranks(RuntimeError("boom")) is None
