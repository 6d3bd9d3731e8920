#!/usr/bin/env python
"""Inductor's collectives in flight on gloo: how often a compiled 4-rank step crashes.

The Qwen3 debug model on 4 gloo ranks (FSDP 2 x TP 2, selective activation
checkpointing, ``--compile.enable true``) is trained ``--runs`` times per
arm, the arms alternating so that the machine's load falls on both alike:

* ``async``: Inductor's own schedule, which keeps several collectives in
  flight at once (what the trainer did before ``execute/inflight.py``);
* ``blocking``: each collective finished before the next op;
* ``chained``: the default, each collective issued after the previous one's
  wait and waited for where the graph waits: one in flight, overlapped;
* ``queued``: Inductor's own schedule on gloo groups of one worker thread
  each: a group runs its collectives one at a time.

Each arm sets ``AUTOPARALLEL_GLOO_COLLECTIVES`` to its name.

Per run: exit status, the launcher's line naming the rank that failed, the
steps logged, the last loss, the median step time and the worker threads of
its gloo groups (1 where the compile log says so). Per arm: the most
collectives in flight at once in the step Inductor generated (read from the
generated code in that arm's ``TORCHINDUCTOR_CACHE_DIR``).

Outputs: ``results.json`` and ``README.md`` beside this script.
Reproduce: ``.venv/bin/python experiments/gloo_inflight/run.py [--runs 4]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(HERE.parent))

from _run import QWEN3_CONFIG, read_metrics, run_launcher  # noqa: E402
from bench_args import kept_notes  # noqa: E402  (experiments/)

STEPS = 60
ARGS = [
    "--model.name", "qwen3_auto_parallel", "--parallelism.tensor_parallel_degree", "2",
    "--compile.enable", "true", "--activation_checkpoint.mode", "selective",
    "--training.steps", str(STEPS), "--training.seq_len", "64", "--training.local_batch_size", "2",
    "--metrics.enable_tensorboard", "false",
]  # fmt: skip
ARMS = ("async", "blocking", "chained", "queued")
ISSUE = re.compile(
    r"^\s*(?:(buf\d+) = )?torch\.ops\.(?:_c10d_functional\.(?!wait_tensor)\w+|autoparallel\.collective_after)"
    r"\.default\((buf\d+)?"
)
NOW = "autoparallel.collective_now"
QUEUED_LOG = "one worker thread per group"  # backend.py's log line in queued mode
WAIT = re.compile(r"_c10d_functional\.wait_tensor\.default\((buf\d+)\)")


def run_one(arm: str, cache: Path, out: Path) -> dict:
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache), "AUTOPARALLEL_GLOO_COLLECTIVES": arm}
    run = run_launcher([*ARGS, "--job.dump_folder", str(out)], ngpu=4, config=QWEN3_CONFIG, env=env, timeout=1500)
    records = [r for r in read_metrics(out) if "loss" in r] if (out / "metrics.jsonl").exists() else []
    failed = [line.strip() for line in run.stderr.splitlines() if "was killed by" in line or "exited with" in line]
    return {
        "arm": arm,
        "returncode": run.returncode,
        "failure": failed[0] if failed else "",
        "gloo_threads": 1 if QUEUED_LOG in run.stdout + run.stderr else 2,
        "steps": len(records),
        "last_loss": records[-1]["loss"] if records else None,
        "s_per_step": statistics.median(r["step_time_s"] for r in records[2:]) if len(records) > 2 else None,
        "command": f"AUTOPARALLEL_GLOO_COLLECTIVES={arm} {run.cmd}",
    }


def most_in_flight(cache: Path) -> int:
    """The most functional collectives issued and not yet waited for, over the generated steps."""
    most = 0
    for path in cache.rglob("*.py"):
        text = path.read_text(errors="replace")
        if NOW in text:
            most = max(most, 1)
        pending: set[str] = set()
        for line in text.splitlines():
            if m := ISSUE.match(line):
                pending.add(m.group(1) or m.group(2))  # out-of-place: its result; in place: its input
                most = max(most, len(pending))
            elif m := WAIT.search(line):
                pending.discard(m.group(1))
    return most


def measure(runs: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        caches = {arm: Path(tmp) / f"cache-{arm}" for arm in ARMS}
        rows = []
        for i in range(runs):
            for arm in ARMS:
                row = run_one(arm, caches[arm], Path(tmp) / f"out-{arm}-{i}")
                print(json.dumps(row), flush=True)
                rows.append(row)
        in_flight = {arm: most_in_flight(caches[arm]) for arm in ARMS}
    return {"steps": STEPS, "rows": rows, "most_in_flight": in_flight}


def write_markdown(results: dict, path: Path) -> None:
    lines = [
        "# Collectives in flight on gloo: compiled 4-rank steps",
        "",
        f"Measured on {platform.node()} ({platform.machine()}, {os.cpu_count()} cores): Qwen3 debug model,",
        f"4 gloo ranks (FSDP 2 x TP 2), selective AC, `--compile.enable true`, seq_len 64, {STEPS} steps.",
        "Arms alternate run by run. Reproduce: `.venv/bin/python experiments/gloo_inflight/run.py`.",
        "",
        "| arm | runs | crashed | how | gloo threads per group | most collectives in flight "
        "| median s/step | last loss of full runs |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for arm in ARMS:
        rows = [r for r in results["rows"] if r["arm"] == arm]
        bad = [r for r in rows if r["returncode"] != 0]
        times = [r["s_per_step"] for r in rows if r["s_per_step"]]
        median = f"{statistics.median(times):.3f}" if times else "-"
        losses = sorted({f"{r['last_loss']:.4f}" for r in rows if r["returncode"] == 0 and r["last_loss"]})
        lines.append(
            f"| {arm} | {len(rows)} | {len(bad)} | {_how(bad)} | {_threads(rows)} | {results['most_in_flight'][arm]} "
            f"| {median} | {', '.join(losses) or '-'} |"
        )
    path.write_text("\n".join(lines) + "\n\n" + kept_notes(path))


def _threads(rows: list[dict]) -> str:
    return ", ".join(str(t) for t in sorted({r.get("gloo_threads", 2) for r in rows}))


def _how(failed: list[dict]) -> str:
    """'SIGABRT (rank 0 x2, rank 3)' from the launcher's lines 'rank N was killed by SIG...'."""
    by_signal: dict[str, Counter] = {}
    for r in failed:
        m = re.search(r"rank (\d+) was killed by (\w+)", r["failure"])
        signal, rank = (m.group(2), m.group(1)) if m else ("other", "?")
        by_signal.setdefault(signal, Counter())[rank] += 1
    return "; ".join(
        f"{s} ({', '.join(f'rank {r}' + (f' x{n}' if n > 1 else '') for r, n in sorted(ranks.items()))})"
        for s, ranks in sorted(by_signal.items())
    ) or "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4, help="runs per arm")
    parser.add_argument("--report-only", action="store_true", help="rewrite README.md from results.json")
    args = parser.parse_args()
    if args.runs < 1:
        raise SystemExit(f"--runs must be at least 1, got {args.runs}")
    if not args.report_only:
        (HERE / "results.json").write_text(json.dumps(measure(args.runs), indent=1) + "\n")
    write_markdown(json.loads((HERE / "results.json").read_text()), HERE / "README.md")
    print((HERE / "README.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
