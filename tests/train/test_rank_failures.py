"""A rank that fails after the launch: one ``error:`` line from the launcher, the
rank's exit status, and no torchrun traceback (``train/failures.py``)."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
from _failing_rank import BAD_INPUT
from _run import PYTHON, REPO, launch_test_module, run_launcher
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from torchtitan_autoparallel.train import failures


def _launch(how: str, log_rank: str) -> subprocess.CompletedProcess:
    """Two ranks of ``_failing_rank`` through our launcher, as ``run_train.sh`` starts them."""
    return launch_test_module("_failing_rank", how, log_rank=log_rank)


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "error:" in line]


def test_bad_input_on_a_hidden_rank_is_the_launchers_one_line() -> None:
    run = _launch("user", log_rank="0")  # rank 1 fails; its output is not shown
    assert run.returncode == failures.USER_ERROR_EXIT, run.stderr
    assert "Traceback" not in run.stdout + run.stderr, run.stderr
    assert _error_lines(run.stdout + run.stderr) == [f"error: {BAD_INPUT}"], run.stderr
    assert run.stderr.rstrip().splitlines()[-1] == f"error: {BAD_INPUT}"


def test_crash_on_a_hidden_rank_shows_its_traceback_and_names_it() -> None:
    run = _launch("crash", log_rank="0")
    assert run.returncode == 1, run.stderr
    last = run.stderr.rstrip().splitlines()[-1]
    assert last == (
        "error: rank 1 failed with exit status 1: RuntimeError: boom on rank 1 "
        "(its output is hidden: LOG_RANK=1 shows it)"
    ), run.stderr
    # the rank's own traceback, read back from its error file, not torchrun's
    assert "rank 1's traceback (its output is not shown):" in run.stderr
    assert 'raise RuntimeError("boom on rank 1")' in run.stderr
    assert "ChildFailedError" not in run.stderr and "closing signal" not in run.stderr


def test_crash_on_a_shown_rank_is_not_repeated() -> None:
    run = _launch("crash", log_rank="1")
    assert run.returncode == 1, run.stderr
    assert "its output is not shown" not in run.stderr  # the rank printed its traceback
    assert "[rank1]:RuntimeError: boom on rank 1" in run.stderr
    assert run.stderr.rstrip().splitlines()[-1] == (
        "error: rank 1 failed with exit status 1: RuntimeError: boom on rank 1"
    )


def test_a_killed_rank_is_named_not_the_rank_that_lost_it() -> None:
    # rank 0's collective fails at once with a lost connection, often before the agent
    # sees rank 1 gone: the line names rank 1 and its signal, and rank 0 prints no traceback
    run = _launch("kill", log_rank="0")
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stdout + run.stderr, run.stderr
    assert _error_lines(run.stdout + run.stderr) == [
        f"error: rank 1 was killed by SIGKILL ({failures.KILLED_HINT}) (its output is hidden: LOG_RANK=1 shows it)"
    ], run.stderr


def test_a_lost_peer_comes_after_the_rank_that_ended(tmp_path: Path, monkeypatch) -> None:
    message = "RuntimeError: [pair.cc:545] Read error [127.0.0.1]:1: Connection reset by peer."
    # as torch's ``record`` writes a rank's uncaught error
    lost = _failure(tmp_path, 0, 1, {"message": {"message": message, "extraInfo": {"timestamp": "0"}}})
    killed = _failure(tmp_path, 1, -9, None)
    lost.timestamp = killed.timestamp - 1  # it failed first
    assert failures.root_cause({0: lost, 1: killed}) == (1, killed)
    monkeypatch.setenv(failures.ERROR_FILE_ENV, str(tmp_path / "rank0.json"))
    monkeypatch.setenv(failures.LAUNCHER_ENV, "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(failures, "LOST_PEER_WAIT_S", 0)
    assert failures.explain_collective_failure(RuntimeError("Connection closed by peer [127.0.0.1]:1")) == 1
    recorded = ProcessFailure(0, 1, 1, str(tmp_path / "rank0.json"))
    assert recorded.message.startswith("rank 0 lost its connection to another rank in a collective")
    assert failures.root_cause({0: recorded, 1: killed}) == (1, killed)


@pytest.mark.multirank
def _the_one_error_line(run) -> str:
    """A job stopped for bad input: exit status 2, no traceback, and one ``error:`` line, its last."""
    assert run.returncode == failures.USER_ERROR_EXIT, run.tail()
    assert "Traceback" not in run.stdout + run.stderr, run.tail()
    errors = _error_lines(run.stdout + run.stderr)
    assert len(errors) == 1 and errors[0].startswith("error: "), run.tail()
    assert run.stderr.rstrip().splitlines()[-1] == errors[0]
    return errors[0]


def test_infeasible_budget_on_real_ranks_is_one_error_line(tmp_path: Path) -> None:
    """Found while planning, after torchrun started the ranks (the fake-backend
    run of ``test_auto_plan`` never reaches torchrun)."""
    run = run_launcher(
        ["--model.name", "llama3_auto_parallel", "--job.dump_folder", tmp_path / "out",
         "--autoparallel.memory_budget_gib", "0.0001"],
        ngpu=2, timeout=300,
    )
    error = _the_one_error_line(run)
    assert "memory_budget_gib = 0.0001" in error, error
    assert "smallest feasible budget is" in error, error
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.parametrize("model", ["llama3", "llama3_auto_parallel"])
def test_a_diverged_run_stops_in_one_line(tmp_path: Path, model: str) -> None:
    """A learning rate of 1e30 makes every weight overflow in step 1: step 2's loss is
    NaN on every rank, and the run stops there instead of training on."""
    dump = tmp_path / "out"
    run = run_launcher(
        ["--model.name", model, "--job.dump_folder", dump, "--optimizer.lr", "1e30",
         "--training.steps", "5", "--training.seq_len", "32", "--training.local_batch_size", "1",
         "--metrics.peak_tflops", "1", "--metrics.enable_tensorboard", "false"],
        ngpu=2, timeout=300,
    )
    error = _the_one_error_line(run)
    assert error.startswith("error: training diverged at step "), error
    assert "optimizer.lr (1e+30)" in error, error
    # strict JSON: a bare NaN or Infinity (json.dumps's default) would be refused
    records = [json.loads(line, parse_constant=_not_json) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    # logged up to the first step whose loss or norm is not finite (written as null), and no further
    assert records[0]["step"] == 1 and math.isfinite(records[0]["loss"])
    last = records[-1]
    assert last["loss"] is None or last["grad_norm"] is None, last
    assert f"at step {last['step']}:" in error and last["step"] < 5


def _not_json(constant: str):
    raise ValueError(f"{constant} in metrics.jsonl is not JSON")


def test_calibration_bad_input_through_the_launcher_is_one_line() -> None:
    run = run_launcher(["--mesh-shape", "3x1"], ngpu=2, env={"CALIBRATE": "1"}, timeout=300)
    assert run.returncode == failures.USER_ERROR_EXIT, run.tail()
    assert run.stderr.strip() == (
        "error: --mesh-shape 3x1 does not cover the 2 ranks launched; "
        "accepted: sizes joined by 'x' whose product is 2"
    ), run.tail()


def _failure(tmp_path: Path, rank: int, exitcode: int, record: dict | None) -> ProcessFailure:
    path = tmp_path / f"error-{rank}.json"
    if record is not None:
        path.write_text(json.dumps(record))
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(path))


def test_root_cause_is_not_a_rank_the_agent_stopped(tmp_path: Path) -> None:
    stopped = _failure(tmp_path, 0, -15, None)  # SIGTERM from the agent, in the same second
    failed = _failure(tmp_path, 1, 2, {"message": "bad", "timestamp": 0})
    failed.timestamp = stopped.timestamp  # error files hold whole seconds: a tie
    assert failures.root_cause({0: stopped, 1: failed}) == (1, failed)
    # a rank killed with nothing else failing (say, out of memory) is the root cause
    killed = _failure(tmp_path, 0, -9, None)
    assert failures.root_cause({0: killed}) == (0, killed)
    assert failures.describe(0, killed, hidden=False) == f"rank 0 was killed by SIGKILL ({failures.KILLED_HINT})"
    stopped_line = failures.describe(0, stopped, hidden=False)
    assert stopped_line == "rank 0 was killed by SIGTERM", stopped_line  # no hint: the agent's own stop
    # a rank that aborted (found: a heap corruption in a compiled step) and ranks the agent
    # then stopped, all in the same second: the abort is the cause, not the lowest rank
    aborted = _failure(tmp_path, 3, -6, None)
    aborted.timestamp = stopped.timestamp
    assert failures.root_cause({0: stopped, 3: aborted}) == (3, aborted)
    assert failures.describe(3, aborted, hidden=True) == (
        "rank 3 was killed by SIGABRT (its output is hidden: LOG_RANK=3 shows it)"
    )


def test_exit_2_without_a_message_is_named_as_a_failure(tmp_path: Path, capsys) -> None:
    class Failed:  # what torchrun raises: the failed ranks by global rank
        failures = {3: _failure(tmp_path, 3, 2, None)}

    assert failures.report(Failed(), shown_ranks={0}) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: rank 3 failed with exit status 2 (its output is hidden: LOG_RANK=3 shows it)"


@pytest.mark.parametrize(
    "args,shown",
    [([], None), (["--local-ranks-filter", "0"], {0}), (["--local-ranks-filter=0,2"], {0, 2})],
)
def test_shown_ranks(args: list[str], shown: set[int] | None) -> None:
    assert failures.shown_ranks(["--standalone", *args, "-m", "x"]) == shown


def test_a_rank_without_our_launcher_prints_its_error(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv(failures.ERROR_FILE_ENV, str(tmp_path / "error.json"))
    monkeypatch.delenv(failures.LAUNCHER_ENV, raising=False)  # plain torchrun
    failures.record_user_error("x = 1 is bad")
    assert capsys.readouterr().err == "error: x = 1 is bad\n"
    assert ProcessFailure(0, 1, 2, str(tmp_path / "error.json")).message == "x = 1 is bad"
    monkeypatch.setenv(failures.LAUNCHER_ENV, "1")  # ours prints it, once
    failures.record_user_error("x = 1 is bad")
    assert capsys.readouterr().err == ""


@pytest.mark.multirank
def test_ctrl_c_stops_the_job_in_one_line(tmp_path: Path) -> None:
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it: the ranks
    stop without tracebacks, what they logged stays readable, the launcher says why."""
    import signal
    import time

    dump = tmp_path / "out"
    env = {**os.environ, "NGPU": "2", "LOG_RANK": "0", "PYTHON": str(PYTHON)}
    args = ["--job.dump_folder", str(dump), "--training.steps", "10000", "--training.seq_len", "64",
            "--metrics.enable_tensorboard", "true", "--metrics.peak_tflops", "1"]
    proc = subprocess.Popen([str(REPO / "run_train.sh"), *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    metrics = dump / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == failures.INTERRUPTED_EXIT, err[-3000:]
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err, err[-3000:]
    assert err.rstrip().splitlines()[-1] == "stopped: the launcher received SIGINT; every rank was stopped"
    assert "interrupted in step" in out + err
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(records) >= 2 and records[0]["step"] == 1
