#!/usr/bin/env python
"""Start-up time of the README's default job (``make train``), cold and on a plan-cache hit.

The default job is ``./run_train.sh --model.name llama3_auto_parallel`` with
the shipped config (LLaMA3 debug model, 4 CPU ranks, FSDP 4 chosen by the
planner). Each measurement launches it as a user would, in a fresh dump
folder (cold: no plan cache) and then again in the same folder (warm: the
plan cache hit), and reads off:

* ``to_first_step_s``: from launching ``run_train.sh`` to the first step's
  record in metrics.jsonl (so it includes that first step);
* ``planning_s``: what plan.json says planning took (trace to placed weights);
* whether the log reports a plan-cache hit and a compiled-step cache hit.

    .venv/bin/python experiments/startup/run.py [--repeats 2]

Writes ``results.json`` and ``README.md`` beside this file. Run on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "tests"))

from _run import read_metrics, run_launcher  # noqa: E402

ARGS = ["--model.name", "llama3_auto_parallel", "--training.steps", "2"]
COMMAND = "./run_train.sh --model.name llama3_auto_parallel --training.steps 2 --job.dump_folder <dump>"
TARGETS = {"cold": 60.0, "warm": 20.0}


def launch(dump: Path) -> dict:
    (dump / "metrics.jsonl").unlink(missing_ok=True)
    start = time.time()
    run = run_launcher([*ARGS, "--job.dump_folder", str(dump)], ngpu=4, timeout=900)
    if run.returncode != 0:
        raise SystemExit(f"the default job failed:\n{run.tail()}")
    first = read_metrics(dump)[0]
    plan = json.loads((dump / "plan.json").read_text())
    return {
        "to_first_step_s": round(first["time"] - start, 2),
        "first_step_s": round(first["step_time_s"], 2),
        "planning_s": round(plan["timings"]["total"], 2),
        "plan_cache_hit": "plan cache hit" in run.stdout + run.stderr,
        "compiled_step_cache_hit": "compiled-step cache hit" in run.stdout + run.stderr,
        "wall_s": round(run.seconds, 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2, help="cold+warm pairs to measure")
    a = ap.parse_args(argv)
    runs: dict[str, list[dict]] = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory(prefix="startup_") as tmp:
        for i in range(a.repeats):
            dump = Path(tmp) / f"run{i}"
            for kind in ("cold", "warm"):
                runs[kind].append(launch(dump))
                print(kind, runs[kind][-1], flush=True)
    summary = {k: statistics.mean(r["to_first_step_s"] for r in v) for k, v in runs.items()}
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": COMMAND,
              "load_average_at_start": Path("/proc/loadavg").read_text().strip(),
              "runs": runs, "mean_to_first_step_s": summary, "targets_s": TARGETS}
    (HERE / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Start-up of the default job",
        "",
        f"Made by `experiments/startup/run.py --repeats {a.repeats}` on {result['date']} (2-core machine; load "
        f"average at start {result['load_average_at_start']}). Job: `NGPU=4 {COMMAND}` with the shipped "
        "`train_configs/llama3_debugmodel.toml`.",
        "",
        "| start | launch to first step s (mean) | target s | planning s | plan-cache hit | compiled-step cache hit |",
        "|---|---:|---:|---:|---|---|",
    ]
    for kind, rs in runs.items():
        lines.append(f"| {kind} | {summary[kind]:.1f} | {TARGETS[kind]:.0f} | "
                     f"{statistics.mean(r['planning_s'] for r in rs):.1f} | {all(r['plan_cache_hit'] for r in rs)} | "
                     f"{all(r['compiled_step_cache_hit'] for r in rs)} |")
    lines += ["", "Each run: " + "; ".join(f"{k}: {[r['to_first_step_s'] for r in v]}" for k, v in runs.items()), ""]
    notes = HERE / "notes.md"
    if notes.exists():
        lines += [notes.read_text().strip(), ""]
    (HERE / "README.md").write_text("\n".join(lines))
    print(f"wrote {HERE / 'results.json'} and {HERE / 'README.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
