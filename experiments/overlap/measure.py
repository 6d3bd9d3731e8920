#!/usr/bin/env python
"""Measured seconds per step with the executor's overlap on and off, side by side in one run.

The LLaMA3 debug model's automatic plan trains on 4 CPU ranks (gloo) through
``./run_train.sh`` in three execution modes, alternating, with the settings of
``experiments/baseline_cpu`` (seq 128, global batch 8, 8 steps, the first 3
excluded, fp32):

* ``interpreted``: ``--autoparallel.compile false`` (DTensor dispatch per op);
* ``compiled``: the local-tensor graph with its collectives bucketed
  (``execute/bucketing.py``), each where the bucketing put it
  (``--autoparallel.overlap_execution false``);
* ``compiled+overlap``: the same graph reordered by ``execute/overlap.py``
  (the default).

The plan is the same in all three (plan cache off, same solver), so only the
execution differs; the final losses are listed to show they agree.

    .venv/bin/python experiments/overlap/measure.py [--repeats 2]

Writes ``measured.json`` and ``measured.md`` beside this file. Run on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "baseline_cpu"))

from run import machine, measure_peak_tflops, run_row  # noqa: E402  (experiments/baseline_cpu/run.py)

RANKS = 4
MESHES = [("FSDP 4", 1, 4, 1), ("FSDP2xTP2", 1, 2, 2)]  # (name, replicate, shard, tensor)
MODES = {
    "interpreted": ("--autoparallel.compile", "false"),
    "compiled": ("--autoparallel.overlap_execution", "false"),
    "compiled+overlap": ("--autoparallel.overlap_execution", "true"),
}


def measure(repeats: int, steps: int, warmup: int) -> dict:
    peak = measure_peak_tflops(max(len(os.sched_getaffinity(0)) // RANKS, 1))
    rows = []
    with tempfile.TemporaryDirectory(prefix="overlap_measure_") as tmp:
        for mesh, rep, shard, tp in MESHES:
            for r in range(repeats):
                for mode, flags in MODES.items():
                    row = run_row("llama3", RANKS, mesh, rep, shard, tp, steps, warmup, Path(tmp), peak,
                                  model_name="llama3_auto_parallel",
                                  extra=(*flags, "--autoparallel.plan_cache", "false"), tag=f"-{mode}-{r}")
                    rows.append({**row, "mode": mode, "repeat": r})
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
            "repeats": repeats, "rows": rows}


def markdown(result: dict) -> str:
    lines = [
        "# Executor overlap, measured (4 CPU ranks, gloo, LLaMA3 debug model)",
        "",
        f"Made by `experiments/overlap/measure.py --repeats {result['repeats']}` on {result['date']}; "
        f"load average at start {result['machine']['load_average_at_start']}. Seq 128, global batch 8, "
        "mean s/step over steps 4-8, then the mean over repeats (runs alternate between modes).",
        "`interpreted`: `--autoparallel.compile false`; `compiled`: the local-tensor graph, collectives",
        "bucketed, `--autoparallel.overlap_execution false`; `compiled+overlap`: the same graph reordered",
        "so collectives are issued early and waited for late (the default).",
        "",
        "| mesh | mode | s/step (mean of repeats) | each repeat | final loss |",
        "|---|---|---:|---|---:|",
    ]
    for mesh, *_ in MESHES:
        for mode in MODES:
            runs = [r for r in result["rows"] if r["plan"] == mesh and r["mode"] == mode and "error" not in r]
            if not runs:
                lines.append(f"| {mesh} | {mode} | failed | | |")
                continue
            each = ", ".join(f"{r['s_per_step']:.3f}" for r in runs)
            lines.append(f"| {mesh} | {mode} | {statistics.mean(r['s_per_step'] for r in runs):.3f} | {each} "
                         f"| {runs[-1]['final_loss']:.4f} |")
    lines += ["", "Commands (`<dump>`: a fresh folder):", ""]
    seen = set()
    for r in result["rows"]:
        if r["command"] not in seen:
            seen.add(r["command"])
            lines.append(f"- `{r['command']}`")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args(argv)
    if a.repeats < 1 or a.steps < 4:
        sys.exit(f"error: --repeats {a.repeats} --steps {a.steps}; accepted: repeats >= 1, steps >= 4")
    result = measure(a.repeats, a.steps, warmup=3)
    (HERE / "measured.json").write_text(json.dumps(result, indent=2) + "\n")
    (HERE / "measured.md").write_text(markdown(result))
    print(f"wrote {HERE / 'measured.json'} and {HERE / 'measured.md'}")
    return 1 if any("error" in r for r in result["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
