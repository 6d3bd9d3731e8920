"""Run ``run_train.sh`` as a subprocess and read back what a job wrote.

Shared by the launcher tests, the training tests and
``experiments/baseline_cpu/run.py``. Every run is remembered in ``RUNS`` so that
``conftest.py`` can show the tail of its output when a test fails.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from torchtitan_autoparallel.launch.launch import SERVER_NAME

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
LAUNCHER = REPO / "run_train.sh"
PYTHON = Path(sys.executable)  # the launches use the torch the tests run on (``make smoke``: torch 2.11)
LLAMA3_CONFIG = REPO / "train_configs" / "llama3_debugmodel.toml"
QWEN3_CONFIG = REPO / "train_configs" / "qwen3_debugmodel.toml"
CONFIGS = {"llama3": LLAMA3_CONFIG, "qwen3": QWEN3_CONFIG}
# ``--model.n_layers`` of the parity-style launches: a plan's numerics do not depend on
# depth, and two blocks (first and last differ in what they receive and send) plan and
# compile in a third of the debug model's time, the bulk of such a launch here.
FEW_LAYERS = 2


@dataclass
class Run:
    cmd: str  # the command line as a user would type it, for messages
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def tail(self, lines: int = 40) -> str:
        out = "\n".join(self.stdout.splitlines()[-lines:])
        err_lines = self.stderr.splitlines()
        # a failed job ends in the launcher's report, after the ranks' output:
        # show the ranks' last lines first, then the launcher's
        rank_lines = [x for x in err_lines if x.startswith("[rank")]
        if self.returncode != 0 and rank_lines:
            err_lines = rank_lines[-lines:] + ["..."] + [x for x in err_lines if not x.startswith("[rank")][-12:]
        err = "\n".join(err_lines[-lines - 13:])
        return (
            f"$ {self.cmd}\n(exit {self.returncode} after {self.seconds:.1f} s)\n"
            f"--- stdout (last {lines} lines) ---\n{out}\n--- stderr (last {lines} lines) ---\n{err}"
        )

    def __iter__(self):  # rc, out, err = run_launcher(...)
        return iter((self.returncode, self.stdout, self.stderr))


RUNS: list[Run] = []


def run_launcher(
    args: list[str] | tuple[str, ...] = (),
    *,
    ngpu: int = 1,
    config: str | Path | None = None,
    comm_mode: str = "",
    log_rank: str = "0",
    timeout: float = 600,
    env: dict[str, str] | None = None,
) -> Run:
    """``NGPU=ngpu CONFIG_FILE=config ./run_train.sh args``; never raises on failure."""
    full_env = dict(os.environ)
    full_env.update(NGPU=str(ngpu), LOG_RANK=log_rank, PYTHON=str(PYTHON))
    full_env.pop("COMM_MODE", None)
    if comm_mode:
        full_env["COMM_MODE"] = comm_mode
    if config is not None:
        full_env["CONFIG_FILE"] = str(config)
    full_env.update(env or {})
    shown_env = f"NGPU={ngpu}" + (f" COMM_MODE={comm_mode}" if comm_mode else "")
    shown_env += f" CONFIG_FILE={config}" if config is not None else ""
    cmd = f"{shown_env} LOG_RANK={log_rank} ./run_train.sh " + " ".join(map(str, args))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rank_logs_") as logs:
        full_env["PET_LOG_DIR"] = logs  # torchrun's --log-dir: every rank's output, shown or not
        proc = subprocess.Popen(
            [str(LAUNCHER), *map(str, args)],
            cwd=REPO,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        returncode, out, err = finish(proc, timeout, Path(logs))
    run = Run(cmd, returncode, out, err, time.perf_counter() - start)
    RUNS.append(run)
    return run


def finish(proc: subprocess.Popen, timeout: float, logs: Path) -> tuple[int, str, str]:
    """``proc``'s exit status and output; past ``timeout`` (-9), ``stop_hung``'s, with
    each rank's stack from ``logs`` (torchrun's --log-dir) after it."""
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        out, err = stop_hung(proc)
        return -9, out, err + rank_stacks(logs) + f"\n[timed out after {timeout} s]"


def stop_hung(proc: subprocess.Popen) -> tuple[str, str]:
    """Stop a launch that ran past its timeout, keeping what it says about why.

    Each rank first prints its Python stacks (SIGUSR1, ``launch/main.py``), then the
    launcher is asked to stop (SIGTERM), so that torchrun stops the ranks itself and
    the launcher's ``stopped:`` line says so. Whatever still runs a minute later is
    killed.
    """
    for rank in rank_pids(proc.pid):
        _signal(rank, signal.SIGUSR1)
    time.sleep(2)  # torchrun copies rank output to the console every 0.1 s
    proc.terminate()
    try:
        return proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        for pid in [*rank_pids(proc.pid), *child_pids(proc.pid), proc.pid]:
            _signal(pid, signal.SIGKILL)
        return proc.communicate()


def rank_stacks(logs: Path, frames: int = 6) -> str:
    """The innermost ``frames`` of each rank's main thread, from the last stack dump in
    its torchrun log (``logs``: the job's --log-dir); every rank, whatever LOG_RANK shows."""
    lines = []
    for rank, path in rank_logs(logs):
        text = path.read_text(errors="replace")
        start = text.rfind("Current thread ")
        if start < 0:
            lines.append(f"[rank{rank}]:stack: none printed (the rank had not started the trainer)")
            continue
        where = [x.strip() for x in text[start:].splitlines()[1:] if x.startswith("  File ")][:frames]
        lines += [f"[rank{rank}]:stack: {x}" for x in where]
    return "".join(f"\n{x}" for x in lines)


def rank_logs(logs: Path) -> list[tuple[int, Path]]:
    """Each rank's stderr log under ``logs`` (torchrun's --log-dir), by rank:
    torchrun writes them to ``<run id>/attempt_<n>/<rank>/stderr.log``."""
    found = [(int(p.parent.name), p) for p in logs.glob("*/attempt_*/*/stderr.log")]
    return sorted(found)


def rank_pids(launcher: int) -> list[int]:
    """The launcher's ranks: its children, or on one CPU host the children of its fork
    server (``launch.start_fork_server``: forked, named ``SERVER_NAME``, or Python's
    own); the server and multiprocessing's resource tracker are not ranks."""
    ranks = []
    for pid in child_pids(launcher):
        command = _cmdline(pid)
        if process_name(pid) == SERVER_NAME or "multiprocessing.forkserver" in command:
            ranks += child_pids(pid)
        elif "multiprocessing." not in command:
            ranks.append(pid)
    return ranks


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = _stat_fields(stat)
        if fields and int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped, does not)."""
    fields = _stat_fields(Path(f"/proc/{pid}/stat"))
    return bool(fields) and fields[0] != "Z"


def _stat_fields(stat: Path) -> list[str]:
    """``/proc/PID/stat`` after the command name (state, ppid, ...); [] once it ended."""
    try:
        # "pid (comm) state ppid ...": comm may hold spaces, so read after its ")"
        return stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return []


def process_name(pid: int) -> str:
    """``pid``'s name, as ps shows it; "" for a process that is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def module_launch(
    module: str, *args: str, log_rank: str = "0", env: dict[str, str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """The command and environment that start two ranks of the test module ``module``
    (from ``tests/``) through our launcher, as ``run_train.sh`` starts them; ``env``
    replaces the whole environment when given."""
    base = dict(os.environ if env is None else env)
    base["PYTHONPATH"] = f"{TESTS}{os.pathsep}{base.get('PYTHONPATH', '')}"
    cmd = [str(PYTHON), "-m", "torchtitan_autoparallel.launch.launch", "--ngpu", "2", "--standalone",
           "--local-ranks-filter", log_rank, "--role", "rank", "--tee", "3", "--", "-m", module, *args]
    return cmd, base


def launch_test_module(
    module: str, *args: str, log_rank: str = "0", env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess:
    """Run ``module_launch``'s job to its end."""
    cmd, full_env = module_launch(module, *args, log_rank=log_rank, env=env)
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


def read_metrics(dump_folder: str | Path) -> list[dict]:
    path = Path(dump_folder) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train(
    dump_folder: str | Path,
    *overrides: str,
    model: str = "llama3",
    ngpu: int = 1,
    steps: int = 3,
    seq_len: int = 64,
    local_batch_size: int = 4,
    tensorboard: bool | None = False,
    fixed_peak: bool = True,
    timeout: float = 600,
    n_layers: int = 0,
) -> list[dict]:
    """Train with the shipped debug config; return the records of metrics.jsonl.

    ``model`` picks the config file and, unless ``overrides`` set ``--model.name``, the model
    (``llama3``, ``qwen3``: torchtitan's hand-written plans).

    ``tensorboard=None`` keeps the config file's setting; ``fixed_peak`` sets
    ``metrics.peak_tflops`` so the start-up matmul benchmark is skipped; ``n_layers``
    sets ``model.n_layers`` (0: the config's depth).
    """
    args = [
        "--job.dump_folder", str(dump_folder),
        "--training.steps", str(steps),
        "--training.seq_len", str(seq_len),
        "--training.local_batch_size", str(local_batch_size),
    ]
    if tensorboard is not None:
        args += ["--metrics.enable_tensorboard", "true" if tensorboard else "false"]
    if fixed_peak:
        args += ["--metrics.peak_tflops", "1"]
    if n_layers:
        args += ["--model.n_layers", str(n_layers)]
    args += list(overrides)
    if not any(str(x).startswith("--model.name") for x in overrides):
        args += ["--model.name", model]  # the shipped llama3 file plans; ``model`` names the hand-written plan
    run = run_launcher(args, ngpu=ngpu, config=CONFIGS[model], timeout=timeout)
    assert run.returncode == 0, f"training run failed\n{run.tail()}"
    assert "Traceback" not in run.stdout + run.stderr, f"traceback in a successful run\n{run.tail()}"
    # runpy's warning that a forked rank already held the trainer (launch.run_as_main)
    assert "found in sys.modules" not in run.stdout + run.stderr, run.tail()
    return read_metrics(dump_folder)


class RunCache:
    """Training runs made once per test module and shared between its tests, keyed by name;
    ``n_layers``: ``train``'s, for every run unless a call says otherwise."""

    def __init__(self, root: Path, n_layers: int = 0) -> None:
        self.root = root
        self.n_layers = n_layers
        self.cache: dict[str, list[dict]] = {}

    def get(self, key: str, *overrides: str, **kwargs) -> list[dict]:
        if key not in self.cache:
            kwargs.setdefault("n_layers", self.n_layers)
            self.cache[key] = train(self.root / key, *overrides, **kwargs)
        return self.cache[key]


def check_records(records: list[dict], steps: int) -> None:
    """Every step logged once, in order, with finite metrics."""
    import math

    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for r in records:
        for key in ("loss", "grad_norm", "tps", "tflops", "mfu", "memory_gib"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), (key, r)
        assert r["tps"] > 0 and r["memory_gib"] > 0


def descendants(pid: int) -> set[int]:
    """Every process below ``pid``, from /proc (children of children included)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def flip_byte(file: Path, at: int) -> None:
    """Invert the byte at offset ``at`` of ``file`` in place (a damaged checkpoint file)."""
    with open(file, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
