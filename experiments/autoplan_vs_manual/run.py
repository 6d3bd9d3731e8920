#!/usr/bin/env python
"""The automatic plan against torchtitan's hand-written plan, side by side in one run.

For each (model, mesh) pair below, the same training job is launched twice
through ``./run_train.sh`` on 4 CPU ranks (gloo): once with torchtitan's own
parallelisation (``--model.name llama3``) and once with the planner's
(``--model.name llama3_auto_parallel``), alternating, with identical settings
to ``experiments/baseline_cpu`` (seq 128, global batch 8, 8 steps, the first 3
excluded, fp32, AdamW, measured fp32 matmul peak for MFU). The automatic rows
also record what the plan predicted and how long planning took.

    .venv/bin/python experiments/autoplan_vs_manual/run.py          # full (about 10 min here)
    .venv/bin/python experiments/autoplan_vs_manual/run.py --quick  # 2 steps, first pair only

Writes ``results.json`` and ``README.md`` beside this file (``--quick``:
``results_quick.json`` and ``quick.md``). Run on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "baseline_cpu"))

from run import machine, measure_peak_tflops, run_row  # noqa: E402  (experiments/baseline_cpu/run.py)

RANKS = 4
# (model, plan name, replicate, shard, tensor)
PAIRS = [
    ("llama3", "FSDP 4", 1, 4, 1),
    ("llama3", "FSDP2xTP2", 1, 2, 2),
    ("qwen3", "FSDP2xTP2", 1, 2, 2),
]


def plan_summary(dump: Path) -> dict:
    plan = json.loads((dump / "plan.json").read_text())
    return {
        "planning_s": plan["timings"].get("total"),
        "predicted_us": plan["predicted"]["total_us"],
        "collectives": {k: sum(c["count"] for c in plan["collectives"] if c["kind"] == k)
                        for k in sorted({c["kind"] for c in plan["collectives"]})},
        "parameters": plan["parameters"],
    }


def markdown(result: dict) -> str:
    lines = [
        "# Automatic plan vs torchtitan's hand-written plan (4 CPU ranks, gloo)",
        "",
        f"Made by `experiments/autoplan_vs_manual/run.py{' --quick' if result['quick'] else ''}` on "
        f"{result['date']}; load average at start {result['machine']['load_average_at_start']}.",
        "Same job, same loop, same mesh; seq 128, global batch 8, means over steps 4-8. "
        f"MFU against the measured fp32 matmul peak of one rank ({result['peak_tflops']:.4f} TFLOPs).",
        "",
        "| model | mesh | plan | s/step | tps | MFU % | auto / manual s/step |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for manual, auto in result["pairs"]:
        for r in (manual, auto):
            if "error" in r:
                lines.append(f"| {r['model']} | {r['plan']} | {r['kind']} | failed | | | |")
                continue
            ratio = ""
            if r is auto and "error" not in manual:
                ratio = f"{auto['s_per_step'] / manual['s_per_step']:.3f}"
            lines.append(f"| {r['model']} | {r['plan']} | {r['kind']} | {r['s_per_step']:.3f} | {r['tps']:.0f} "
                         f"| {r['mfu_pct']:.2f} | {ratio} |")
    lines += ["", "## Commands", ""]
    for pair in result["pairs"]:
        for r in pair:
            lines.append(f"- {r['model']} {r['plan']} ({r['kind']}): `{r['command']}`")
    lines += ["", "## The automatic plans", ""]
    for _, auto in result["pairs"]:
        if "plan_summary" in auto:
            p = auto["plan_summary"]
            lines.append(f"- {auto['model']} {auto['plan']}: planned in {p['planning_s']:.1f} s, predicted "
                         f"{p['predicted_us']:.0f} us/step on the cost profile, collectives per step {p['collectives']}")
    lines += ["", NOTES, ""]
    return "\n".join(lines)


NOTES_FILE = HERE / "notes.md"
NOTES = NOTES_FILE.read_text().strip() if NOTES_FILE.exists() else ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 steps, the first pair only")
    a = ap.parse_args(argv)
    steps, warmup = (2, 1) if a.quick else (8, 3)
    pairs = PAIRS[:1] if a.quick else PAIRS
    nproc = len(os.sched_getaffinity(0))
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "quick": a.quick,
        "machine": machine(),
        "peak_tflops": measure_peak_tflops(max(nproc // RANKS, 1)),
        "pairs": [],
    }
    with tempfile.TemporaryDirectory(prefix="autoplan_vs_manual_") as tmp:
        for model, plan, rep, shard, tp in pairs:
            pair = []
            for name in (model, f"{model}_auto_parallel"):
                row = run_row(model, RANKS, plan, rep, shard, tp, steps, warmup, Path(tmp),
                              result["peak_tflops"], model_name=name)
                row["kind"] = "automatic" if name.endswith("_auto_parallel") else "torchtitan"
                if row["kind"] == "automatic" and "error" not in row:
                    row["plan_summary"] = plan_summary(Path(row["dump"]))
                pair.append(row)
            result["pairs"].append(pair)
    out_json = HERE / ("results_quick.json" if a.quick else "results.json")
    out_md = HERE / ("quick.md" if a.quick else "README.md")
    out_json.write_text(json.dumps(result, indent=2) + "\n")
    out_md.write_text(markdown(result))
    print(f"wrote {out_json} and {out_md}")
    return 1 if any("error" in r for pair in result["pairs"] for r in pair) else 0


if __name__ == "__main__":
    sys.exit(main())
