"""On one CPU host the launcher forks its ranks (``launch/forked_rank.py``): each must
start as a new process would, and a GPU or multi-node job must still start new ones."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from _run import LAUNCHER, PYTHON, REPO, descendants, launch_test_module

from torchtitan_autoparallel.launch import launch
from torchtitan_autoparallel.launch.launch import FORKED_RANK, RANK_IMPORTS, SERVER_NAME, rank_start
from torchtitan_autoparallel.train.failures import LAUNCHER_ENV


def test_only_a_single_cpu_host_forks_its_ranks() -> None:
    assert rank_start(0, ["--standalone", "--tee", "3"]) == ["--run-path", "--start-method", "forkserver", FORKED_RANK]
    assert Path(FORKED_RANK).is_file()
    assert rank_start(4, ["--standalone"]) == ["-m"]  # CUDA cannot be used across a fork
    assert rank_start(0, ["--nnodes", "2", "--rdzv-backend", "c10d"]) == ["-m"]
    assert rank_start(0, ["--standalone"], fork="0") == ["-m"]


def test_the_fork_server_is_forked_only_while_no_other_thread_runs(monkeypatch) -> None:
    # a fork beside a running Python thread can copy a lock it holds: then Python's own
    # server, a new interpreter, is started instead
    started = []
    monkeypatch.setattr(launch, "_fork_fork_server", lambda: started.append("forked"))
    monkeypatch.setattr(launch.multiprocessing.forkserver, "ensure_running", lambda: started.append("ensured"))
    monkeypatch.setattr(launch.multiprocessing.forkserver._forkserver, "_preload_modules", [])
    monkeypatch.setenv(LAUNCHER_ENV, "0")
    for threads, expected in ((1, ["forked", "ensured"]), (2, ["ensured"])):
        started.clear()
        monkeypatch.setattr(launch.threading, "active_count", lambda n=threads: n)
        launch.start_fork_server()
        assert started == expected, threads
    assert os.environ[LAUNCHER_ENV] == "1"  # passed on to the ranks through the server


def test_a_bad_fork_setting_is_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "AUTOPARALLEL_FORK_RANKS": "yes"}
    run = launch_test_module("torchtitan_autoparallel.launch.main", "--job.dump_folder", str(tmp_path), env=env)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "error: AUTOPARALLEL_FORK_RANKS='yes' is not accepted; accepted: 1 (fork CPU ranks, the default) or 0"
    ], run.stderr


def test_the_fork_server_imports_what_the_check_imports() -> None:
    # a server forked after the check holds what it imported; one that is not (another
    # module's job, or Python's own server) must import as much, or every rank pays for the rest
    code = (
        "import importlib, sys\n"
        f"for m in {RANK_IMPORTS!r}: importlib.import_module(m)\n"
        "before = set(sys.modules)\n"
        "from torchtitan_autoparallel.config import load_config\n"
        "from torchtitan_autoparallel.launch.preflight import check\n"
        "for name in ('llama3', 'qwen3'):\n"
        "    check(load_config(['--job.config_file', f'train_configs/{name}_debugmodel.toml',\n"
        "                       '--model.name', f'{name}_auto_parallel']), 2, False)\n"
        "print(sorted(set(sys.modules) - before))\n"
    )
    out = subprocess.run([str(PYTHON), "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    imported = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    added = [m for m in imported if not m.startswith("torchtitan_autoparallel.launch.preflight")]
    assert added == [], added


def test_the_trainer_runs_as_main_without_runpy_warning_of_its_earlier_import() -> None:
    # the check and the fork server's preload import the trainer before it runs as __main__
    code = (
        "import sys\n"
        f"import {launch.TRAIN_MODULE}\n"
        "from torchtitan_autoparallel.launch.launch import run_as_main\n"
        "sys.argv = ['main', '--help']\n"
        f"run_as_main({launch.TRAIN_MODULE!r})\n"
    )
    out = subprocess.run([str(PYTHON), "-W", "error::RuntimeWarning", "-c", code], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("usage:"), out.stdout[:500]


def test_a_refused_job_leaves_no_process_holding_its_output(tmp_path: Path) -> None:
    # the fork server is started only once the check has passed: a server started
    # earlier, as Python's own once was, held the launcher's output open until its
    # import of the trainer was done, seconds after the one-line refusal
    env = {**os.environ, "NGPU": "2", "PYTHON": str(PYTHON)}
    proc = subprocess.Popen([str(LAUNCHER), "--training.steps", "0", "--job.dump_folder", str(tmp_path)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.wait(timeout=180) == 2
    exited = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert err.strip() == "error: training.steps = 0 is too small; accepted: >= 1", err
    assert time.monotonic() - exited < 1.0, f"the output stayed open {time.monotonic() - exited:.1f} s after the exit"


def _state_job(tmp_path: Path, fork: str) -> subprocess.CompletedProcess:
    """Two ranks of ``_rank_state`` through the launcher, with no thread count set."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS")}
    return launch_test_module("_rank_state", str(tmp_path), env={**env, "AUTOPARALLEL_FORK_RANKS": fork})


@pytest.mark.multirank
@pytest.mark.parametrize("fork", ["1", "0"])
def test_a_forked_rank_starts_as_a_new_process_would(tmp_path: Path, fork: str) -> None:
    run = _state_job(tmp_path, fork)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "[rank0]:rank 0 reported" in run.stdout
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    for rank in (0, 1):
        state = json.loads((tmp_path / f"state{rank}.json").read_text())
        # a forked rank's parent is the fork server, not the launcher, where torchrun's
        # store and rendezvous threads run: a fork can copy a lock one of them holds
        torchrun_threads = [x for x in state.pop("parent_threads") if x.startswith("pt_")]
        assert bool(torchrun_threads) == (fork == "0"), (rank, torchrun_threads)
        # the server forked from the launcher (no second import of the trainer), whose
        # name each rank sheds for the one a new process has
        parent_name = state.pop("parent_name")
        assert (parent_name == SERVER_NAME) == (fork == "1"), (rank, parent_name)
        assert state.pop("name") == Path(PYTHON).name, rank
        assert state == {
            "forked": fork == "1",
            "own_session": True,  # a terminal's Ctrl-C reaches the launcher, which stops the ranks
            "threads": share,  # the launcher's share of the cores, not its own thread count
            "omp_num_threads": str(share),
            "sigterm_default": True,  # not the launcher's handler, which raises instead of ending
            "sigint_raises": True,
            "root_log_handlers": 0,
            "default_start_method": True,  # not the fork server's, which would register its locks
        }, (rank, state)
        # runtime.exit_process ends a new process by os._exit, before any exit hook; a forked
        # rank returns to torchrun, and forked_rank.py runs the hooks the rank registered
        assert (tmp_path / f"exit_hook{rank}").exists() == (fork == "1")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; only its parent's wait is missing


@pytest.mark.multirank
@pytest.mark.parametrize("fork", ["1", "0"])
def test_a_killed_launcher_takes_its_fork_server_and_ranks_down(tmp_path: Path, fork: str) -> None:
    # fork 0: each rank a new process, as on GPUs; its parent is the launcher itself
    # (torchrun's agent runs there), which ends each rank by its parent-death signal
    env = {**os.environ, "NGPU": "2", "PYTHON": str(PYTHON), "AUTOPARALLEL_FORK_RANKS": fork}
    proc = subprocess.Popen(
        [str(LAUNCHER), "--model.name", "llama3_auto_parallel", "--model.n_layers", "2", "--training.steps", "10000",
         "--training.seq_len", "64", "--metrics.enable_tensorboard", "false", "--job.dump_folder", str(tmp_path)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    below: set[int] = set()
    try:
        for line in proc.stdout:  # training has started on every rank once rank 0 logs a step
            if "step:  2" in line:
                break
        below = descendants(proc.pid)
        assert len(below) >= (3 if fork == "1" else 2), below  # two ranks (and the fork server)
        proc.kill()  # SIGKILL: the launcher runs no handler
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in below) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in below if _alive(p)], "processes outlived the killed launcher"
    finally:  # a failed check leaves nothing running
        proc.kill()
        for p in below:
            try:
                os.kill(p, 9)
            except OSError:
                pass


def test_a_rank_whose_launcher_died_before_it_asked_to_follow_it_ends_at_once() -> None:
    # a new process learns the launcher's pid from its environment; a parent other than
    # that pid (the launcher died while the rank imported torch) ends it
    code = ("import os\nfrom torchtitan_autoparallel.mesh.runtime import LAUNCHER_PID_ENV\n"
            "from torchtitan_autoparallel.mesh.runtime import end_with_launcher\n"
            "os.environ[LAUNCHER_PID_ENV] = {pid!r}\nend_with_launcher()\nprint('still running')\n")
    gone = subprocess.run([str(PYTHON), "-c", code.format(pid="1")], cwd=REPO, capture_output=True, text=True)
    assert gone.returncode == -9 and "still running" not in gone.stdout, (gone.returncode, gone.stderr[-2000:])
    kept = subprocess.run([str(PYTHON), "-c", code.format(pid=str(os.getpid()))], cwd=REPO, capture_output=True,
                          text=True)
    assert kept.returncode == 0 and "still running" in kept.stdout, kept.stderr[-2000:]
