"""Inject each fault of issue 75 into jobs of the debug model on 2 CPU ranks, and record
how each ends: exit status, last stderr line, seconds to exit and, for checkpoint
faults, whether a resume then loads the last good checkpoint.

    .venv/bin/python experiments/faults/run.py [--only CASE ...] [--out experiments/faults]

Writes results.json (``{"rows": [...]}``) and results.md (the table) to ``--out``.
Mounting a tmpfs (the full disk, the read-only folder) needs root; without it those
rows say they were not run. A row that does not pass is written as not passing.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from _run import LAUNCHER, LLAMA3_CONFIG, PYTHON, alive, descendants, flip_byte, module_launch, rank_pids  # noqa: E402

# The planned debug model cut to 2 blocks, short sequences: each launch is mostly start-up.
JOB = ["--model.name", "llama3_auto_parallel", "--model.n_layers", "2", "--training.seq_len", "32",
       "--training.local_batch_size", "1", "--metrics.peak_tflops", "1", "--metrics.enable_tensorboard", "false"]
CKPT = ["--checkpoint.enable", "true", "--checkpoint.interval", "2"]
LAUNCH_TIMEOUT = 300
GONE_WITHIN_S = 15  # ranks of a killed launcher must be gone by then


@dataclass
class Row:
    case: str
    exit_code: int | None
    last_line: str
    seconds_to_exit: float | None
    last_good_resumed: bool | None  # None: not a checkpoint case
    passed: bool


@dataclass
class Outcome:
    code: int
    out: str
    err: str
    seconds: float

    @property
    def last(self) -> str:
        lines = [x for x in self.err.splitlines() if x.strip()]
        return lines[-1].strip() if lines else ""

    def one_error_line(self, *needles: str) -> bool:
        """Non-zero exit, no traceback, one ``error:`` line, the last, holding every needle."""
        errors = [x for x in (self.out + self.err).splitlines() if x.startswith("error:")]
        return (self.code != 0 and "Traceback" not in self.out + self.err and len(errors) == 1
                and self.last == errors[0] and all(n in errors[0] for n in needles))


def launch(dump: Path, *args: str, env: dict[str, str] | None = None, ngpu: str = "2") -> Outcome:
    """``NGPU=ngpu ./run_train.sh --job.dump_folder dump JOB args`` to its end."""
    full = {**os.environ, "NGPU": ngpu, "PYTHON": str(PYTHON), "LOG_RANK": "0", **(env or {})}
    start = time.perf_counter()
    try:
        done = subprocess.run([str(LAUNCHER), "--job.dump_folder", str(dump), *JOB, *args], cwd=REPO, env=full,
                              capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
        return Outcome(done.returncode, done.stdout, done.stderr, time.perf_counter() - start)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return Outcome(-9, "", err + f"\n[not ended after {LAUNCH_TIMEOUT} s]", time.perf_counter() - start)


def resumed_step(outcome: Outcome) -> int | None:
    """The step a launch resumed from, as its rank 0 logs it."""
    found = re.search(r"resumed from checkpoint \S*step-(\d+) ", outcome.out + outcome.err)
    return int(found.group(1)) if found else None


def resume_picks(dump: Path, good: int, suggested_by: str = "") -> bool:
    """Whether a resume of ``dump`` as the error line ``suggested_by`` directs loads step
    ``good``: with the ``checkpoint.load_step`` it names, or after removing the folder it
    says to remove, else as it is (the latest complete checkpoint)."""
    found = re.search(r"checkpoint\.load_step = (\d+)", suggested_by)
    extra = ["--checkpoint.load_step", found.group(1)] if found else []
    remove = re.search(r"or remove (\S+?)[;,)]?$", suggested_by)
    if not found and remove and Path(remove.group(1)).resolve().is_relative_to(dump.resolve()):
        shutil.rmtree(remove.group(1), ignore_errors=True)
    outcome = launch(dump, *CKPT, "--training.steps", str(good + 1), *extra)
    return outcome.code == 0 and resumed_step(outcome) == good


def complete_steps(folder: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in folder.glob("step-*/train_state.json"))


def copy_of(saved: Path, where: Path, name: str) -> Path:
    dump = where / name
    shutil.copytree(saved, dump)
    return dump


class Planted:
    """A pickle whose loading creates ``marker``: any unpickling runs such code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def mount_tmpfs(path: Path, options: str) -> str:
    """Mount a tmpfs at ``path``; '' on success, else why not."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    return "" if done.returncode == 0 else (done.stderr.strip() or f"mount exit status {done.returncode}")


def unmount(path: Path) -> None:
    subprocess.run(["umount", str(path)], capture_output=True)


# ---------------------------------------------------------------- checkpoint faults


def disk_full(saved: Path, tmp: Path) -> Row:
    """A 40 MiB tmpfs holds one checkpoint of the 2-block model, not two: the step-4 save fails."""
    mount = tmp / "small"
    why = mount_tmpfs(mount, "size=40m")
    if why:
        return Row("disk full (tmpfs)", None, f"not run: cannot mount a tmpfs ({why})", None, None, False)
    try:
        shutil.copytree(saved / "plan_cache", mount / "out" / "plan_cache")
        outcome = launch(mount / "out", *CKPT, "--training.steps", "4")
        kept = complete_steps(mount / "out" / "checkpoint")
        moved = shutil.copytree(mount / "out", tmp / "disk_full_moved")  # the resume, on a disk with room
    finally:
        unmount(mount)
    resumed = bool(kept) and resume_picks(moved, kept[-1])
    ok = outcome.one_error_line("no space left on device") and kept == [2] and resumed
    return Row("disk full (tmpfs)", outcome.code, outcome.last, round(outcome.seconds, 1), resumed, ok)


def unwritable_folder(saved: Path, tmp: Path) -> Row:
    """checkpoint.folder on a read-only file system (root writes through chmod): refused before launch."""
    folder = tmp / "read_only"
    why = mount_tmpfs(folder, "ro,size=1m")
    try:
        if why:  # a non-root user is stopped by the mode alone
            folder.mkdir(exist_ok=True)
            folder.chmod(0o500)
        outcome = launch(tmp / "unwritable", *CKPT, "--training.steps", "4", "--checkpoint.folder", str(folder))
    finally:
        if why:
            folder.chmod(0o700)
        else:
            unmount(folder)
    ok = outcome.one_error_line(str(folder))
    return Row("unwritable checkpoint folder", outcome.code, outcome.last, round(outcome.seconds, 1), None, ok)


def damaged(saved: Path, tmp: Path, case: str, damage) -> Row:
    """Damage step-4 of a copy of ``saved`` with ``damage(step4)``: the resume must refuse it in
    one line, and a resume as that line suggests must load step 2, the last good one."""
    dump = copy_of(saved, tmp, case.replace(" ", "_"))
    step4 = dump / "checkpoint" / "step-4"
    marker = damage(step4) or tmp / "no-marker"
    outcome = launch(dump, *CKPT, "--training.steps", "6")
    refused = outcome.one_error_line(str(step4)) and not marker.exists()
    resumed = resume_picks(dump, 2, outcome.last)
    return Row(case, outcome.code, outcome.last, round(outcome.seconds, 1), resumed, refused and resumed)


def flip_shard(step4: Path) -> None:
    shard = step4 / "__1_0.distcp"
    flip_byte(shard, shard.stat().st_size // 2)  # in a tensor's bytes


def truncate_shard(step4: Path) -> None:
    shard = step4 / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])


def plant_metadata(step4: Path) -> Path:
    marker = step4.parent.parent / "planted-code-ran"
    (step4 / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    (step4 / "checksums.json").unlink(missing_ok=True)  # no checksum to catch it: the unpickler must
    return marker


def malformed_state(step4: Path) -> None:
    (step4 / "train_state.json").write_text('{"step": 4, "model_id": ')


def missing_state(step4: Path) -> None:
    (step4 / "train_state.json").unlink()


def mismatched_state(step4: Path) -> None:
    state = json.loads((step4 / "train_state.json").read_text())
    (step4 / "train_state.json").write_text(json.dumps({**state, "step": 2}))


def planted_graph(saved: Path, tmp: Path) -> Row:
    """A pickle in place of each rank's compiled-step cache entry: refused (the step compiled
    again), never unpickled; the resume goes on from step 4."""
    import torch

    dump = copy_of(saved, tmp, "planted_graph")
    marker = tmp / "graph-code-ran"
    entries = sorted((dump / "plan_cache" / "graphs").glob("*.pt"))
    for entry in entries:
        torch.save({"header": Planted(marker)}, entry)
    outcome = launch(dump, *CKPT, "--training.steps", "5")
    ok = bool(entries) and outcome.code == 0 and not marker.exists() and resumed_step(outcome) == 4
    last = f"{len(entries)} entries planted; " + _cache_line(outcome)
    return Row("planted pickle in plan_cache/graphs", outcome.code, last, round(outcome.seconds, 1),
               resumed_step(outcome) == 4, ok)


def _cache_line(outcome: Outcome) -> str:
    """Rank 0's line on the compiled-step cache (what became of the planted entry)."""
    for line in (outcome.out + outcome.err).splitlines():
        if "compiled-step cache" in line or "compiled into a local-tensor graph" in line:
            return line.split(" ", 2)[-1] if line.startswith("[rank") else line
    return outcome.last


def planted_problem(saved: Path, tmp: Path) -> Row:
    """An exported problem (.npz) whose array is a pickle: ``Problem.load`` refuses it unread."""
    import numpy as np

    marker = tmp / "problem-code-ran"
    path = tmp / "planted_problem.npz"
    np.savez(path, format_version=np.array(3), num_strategies=np.array([Planted(marker)], dtype=object))
    code = f"from torchtitan_autoparallel.planner.problem.problem import Problem\nProblem.load({str(path)!r})\n"
    start = time.perf_counter()
    done = subprocess.run([str(PYTHON), "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    outcome = Outcome(done.returncode, done.stdout, done.stderr, time.perf_counter() - start)
    ok = outcome.code != 0 and not marker.exists() and f"{path}: holds pickled objects, which are not loaded" in outcome.last
    return Row("planted pickle in an exported problem .npz", outcome.code, outcome.last, round(outcome.seconds, 1),
               None, ok)


def lr_change(saved: Path, tmp: Path) -> Row:
    """Resume 4 steps' checkpoint with training.steps 6: one warning naming old and new and the flag."""
    dump = copy_of(saved, tmp, "lr_change")
    outcome = launch(dump, *CKPT, "--training.steps", "6")
    warnings = [x for x in outcome.err.splitlines() if x.startswith("warning: resuming")]
    ok = (outcome.code == 0 and len(warnings) == 1 and "training.steps 4 -> 6" in warnings[0]
          and "checkpoint.keep_lr_schedule" in warnings[0] and resumed_step(outcome) == 4)
    line = warnings[0] if warnings else outcome.last
    return Row("LR schedule change on resume", outcome.code, line, round(outcome.seconds, 1),
               resumed_step(outcome) == 4, ok)


# ---------------------------------------------------------------- processes killed or frozen


def _start_training(dump: Path, fork: str, *args: str) -> tuple[subprocess.Popen, list[str]]:
    """A long job, read until rank 0 has logged step 2 (every rank trains by then)."""
    env = {**os.environ, "NGPU": "2", "PYTHON": str(PYTHON), "LOG_RANK": "0", "AUTOPARALLEL_FORK_RANKS": fork}
    proc = subprocess.Popen([str(LAUNCHER), "--job.dump_folder", str(dump), *JOB, "--training.steps", "100000", *args],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines = []
    for line in proc.stdout:
        lines.append(line.rstrip())
        if "step:  2" in line:
            break
    return proc, lines


def _kill_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def killed_launcher(saved: Path, tmp: Path, fork: str) -> Row:
    """kill -9 of the launcher mid-run: every process below it must end within seconds."""
    case = f"kill -9 launcher ({'forked' if fork == '1' else 'new-process'} ranks)"
    dump = tmp / f"killed_launcher_{fork}"
    shutil.copytree(saved / "plan_cache", dump / "plan_cache")
    proc, lines = _start_training(dump, fork)
    below = descendants(proc.pid)
    start = time.monotonic()
    proc.kill()
    proc.wait(timeout=30)
    while any(alive(p) for p in below) and time.monotonic() - start < 60:
        time.sleep(0.1)
    seconds, left = time.monotonic() - start, [p for p in below if alive(p)]
    _kill_all(left)
    last = f"{len(below)} processes below the launcher; {len(left)} left after {seconds:.1f} s"
    ok = len(below) >= 2 and not left and seconds < GONE_WITHIN_S
    return Row(case, proc.returncode, last, round(seconds, 1), None, ok)


def killed_rank(saved: Path, tmp: Path) -> Row:
    """kill -9 of one rank once a checkpoint is saved: one line naming the rank and signal; the
    resume loads the latest complete checkpoint."""
    dump = tmp / "killed_rank"
    shutil.copytree(saved / "plan_cache", dump / "plan_cache")
    proc, _ = _start_training(dump, "1", *CKPT)
    folder = dump / "checkpoint"
    while not complete_steps(folder) and proc.poll() is None:
        proc.stdout.readline()
    ranks = sorted(rank_pids(proc.pid))
    start = time.monotonic()
    _kill_all(ranks[-1:])
    rest = proc.stdout.read()
    proc.wait(timeout=120)
    outcome = Outcome(proc.returncode, "", rest, time.monotonic() - start)
    kept = complete_steps(folder)
    resumed = bool(kept) and resume_picks(dump, kept[-1])
    ok = outcome.one_error_line("was killed by SIGKILL") and resumed
    return Row("kill -9 of one rank", outcome.code, outcome.last, round(outcome.seconds, 1), resumed, ok)


def frozen_rank(saved: Path, tmp: Path) -> Row:
    """Rank 1 starts its second step 200 s late; rank 0's collective times out after 3 s."""
    dump = tmp / "frozen"
    shutil.copytree(saved / "plan_cache", dump / "plan_cache")
    cmd, env = module_launch("_stalling_rank", "step", "200", "--job.config_file", str(LLAMA3_CONFIG),
                             "--job.dump_folder", str(dump), *JOB, "--training.steps", "3",
                             "--comm.train_timeout_seconds", "3")
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    outcome = Outcome(done.returncode, done.stdout, done.stderr, time.perf_counter() - start)
    ok = outcome.one_error_line() and outcome.last.startswith("error: rank 1 stopped responding")
    return Row("frozen rank (collective timeout)", outcome.code, outcome.last, round(outcome.seconds, 1), None, ok)


# ---------------------------------------------------------------- bad input before launch


def bad_input(case: str, args: list[str], env: dict[str, str], needles: tuple[str, ...], tmp: Path) -> Row:
    outcome = launch(tmp / case.replace(" ", "_"), *args, env=env)
    ok = outcome.one_error_line(*needles)
    return Row(case, outcome.code, outcome.last, round(outcome.seconds, 1), None, ok)


def non_utf8_config(saved: Path, tmp: Path) -> Row:
    config = tmp / "latin1.toml"
    config.write_bytes(LLAMA3_CONFIG.read_bytes() + b'\n# caf\xe9 (Latin-1, not UTF-8)\n')
    return bad_input("non-UTF-8 config", [], {"CONFIG_FILE": str(config)}, (str(config),), tmp)


def seq_len_too_long(saved: Path, tmp: Path) -> Row:
    return bad_input("seq_len above the model maximum", ["--training.seq_len", "10000000"], {},
                     ("training.seq_len 10000000", "maximum sequence length"), tmp)


def log_rank_out_of_range(saved: Path, tmp: Path) -> Row:
    return bad_input("LOG_RANK out of range", [], {"LOG_RANK": "5"}, ("LOG_RANK='5'", "0..1"), tmp)


def comm_mode_foo(saved: Path, tmp: Path) -> Row:
    return bad_input("COMM_MODE=foo", [], {"COMM_MODE": "foo"}, ("COMM_MODE='foo'", "fake_backend"), tmp)


CASES = {
    "disk_full": disk_full,
    "unwritable_folder": unwritable_folder,
    "kill_launcher_forked": lambda s, t: killed_launcher(s, t, "1"),
    "kill_launcher_new_process": lambda s, t: killed_launcher(s, t, "0"),
    "kill_rank": killed_rank,
    "shard_byte_edit": lambda s, t: damaged(s, t, "byte edits in a shard", flip_shard),
    "shard_truncated": lambda s, t: damaged(s, t, "truncated shard", truncate_shard),
    "planted_metadata": lambda s, t: damaged(s, t, "planted pickle in .metadata", plant_metadata),
    "planted_graph": planted_graph,
    "planted_problem": planted_problem,
    "train_state_malformed": lambda s, t: damaged(s, t, "malformed train_state.json", malformed_state),
    "train_state_missing": lambda s, t: damaged(s, t, "missing train_state.json", missing_state),
    "train_state_step_mismatch": lambda s, t: damaged(s, t, "step-mismatched train_state.json", mismatched_state),
    "seq_len_too_long": seq_len_too_long,
    "lr_schedule_change": lr_change,
    "frozen_rank": frozen_rank,
    "log_rank_out_of_range": log_rank_out_of_range,
    "comm_mode_foo": comm_mode_foo,
    "non_utf8_config": non_utf8_config,
}


def saved_run(tmp: Path) -> Path:
    """A 2-rank run's checkpoints at steps 2 and 4, with its plan and compiled-step caches."""
    dump = tmp / "saved"
    outcome = launch(dump, *CKPT, "--training.steps", "4")
    if outcome.code != 0 or complete_steps(dump / "checkpoint") != [2, 4]:
        sys.exit(f"the run every case starts from failed (exit {outcome.code}):\n{outcome.err[-3000:]}")
    return dump


def markdown(rows: list[Row]) -> str:
    lines = ["| case | exit code | seconds to exit | last good resumed | passed | last line |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        resumed = "n/a" if r.last_good_resumed is None else ("yes" if r.last_good_resumed else "no")
        seconds = "" if r.seconds_to_exit is None else f"{r.seconds_to_exit:.1f}"
        last = r.last_line.replace("|", "\\|")
        lines.append(f"| {r.case} | {r.exit_code} | {seconds} | {resumed} | {'yes' if r.passed else 'NO'} | {last} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=sorted(CASES), help="run these cases only")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="faults_") as root:
        tmp = Path(root)
        start = time.perf_counter()
        saved = saved_run(tmp)
        for name in args.only or CASES:
            print(f"[{time.perf_counter() - start:6.0f} s] {name} ...", flush=True)
            try:
                row = CASES[name](saved, tmp)
            except Exception as e:  # a broken case is a row that did not pass, not a lost run
                row = Row(name, None, f"the case itself failed: {type(e).__name__}: {e}", None, None, False)
            row.last_line = re.sub(r"\x1b\[[0-9;]*m", "", row.last_line)  # torch's bold in a message
            print(f"         {'passed' if row.passed else 'NOT PASSED'}: {row.last_line[:200]}", flush=True)
            rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"rows": [asdict(r) for r in rows]}, indent=1) + "\n")
    (args.out / "results.md").write_text(markdown(rows))
    print(f"{sum(r.passed for r in rows)} of {len(rows)} passed; {args.out / 'results.md'}")


if __name__ == "__main__":
    main()
