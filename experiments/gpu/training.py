"""Summarise check.sh's training runs: training.json and training.md.

    python3 experiments/gpu/training.py --runs RUNS --logs OUT --out OUT

RUNS holds one dump folder per stage (check.sh's ``--job.dump_folder``), OUT the
stages' console logs. A run of ours is read from its ``metrics.jsonl`` and
``plan.json``; torchtitan's stock trainer writes neither, so its run is read from
its console lines (``step: ... tps: ... mfu: ...``) and, where TensorBoard can be
read, its ``memory/max_active(GiB)``. Throughput, MFU and step time are medians
over the steps after the first ``WARMUP`` (lazy initialisation, the allocator's
growth, compiles). A stage that did not train gives no row; its failure is in
``checks`` with the last line of its log. Without a GPU, ``plans`` holds what the
Qwen3 job's plan (``qwen_plan``) predicts for the GPU.

Peak memory measured is ``torch.cuda.max_memory_allocated`` on a GPU (ours) and
torchtitan's ``max_active`` (the same peak, as the caching allocator counts it);
on a CPU rank we have no tensor-memory measurement here (the process's resident
set is not one), so the field is null. Predicted is the plan's: parameters and
AdamW state plus the step's peak of activations and gradients
(``report.common.predicted_peak_bytes``).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from torchtitan_autoparallel.planner.plan.plan import Plan
from torchtitan_autoparallel.report.common import GIB, predicted_peak_bytes, predicted_step_us

WARMUP = 2
TORCHTITAN = "torchtitan-0.2.2"
# stage -> (case, impl); the stages check.sh runs, in its order
STAGES = {
    "debug_auto": ("llama3 debugmodel fp32", "auto"),
    "qwen_eager": ("qwen3 1.7B bf16 eager", "auto"),
    "qwen_compiled": ("qwen3 1.7B bf16 compiled", "auto"),
    "qwen_torchtitan": ("qwen3 1.7B bf16 eager", TORCHTITAN),
    "qwen_torchtitan_compiled": ("qwen3 1.7B bf16 compiled", TORCHTITAN),
}
_TITAN_STEP = re.compile(
    r"step:\s*(?P<step>\d+).*?memory:\s*(?P<mem>[\d.]+)GiB.*?tps:\s*(?P<tps>[\d,]+).*?mfu:\s*(?P<mfu>[\d.]+)%"
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _steady(values: list[float]) -> float | None:
    kept = values[WARMUP:] or values
    return statistics.median(kept) if kept else None


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def predicted_peak_gib(plan: Plan) -> float | None:
    """Parameters and AdamW state, plus the step's peak (activations, gradients, weight copies)."""
    peak = predicted_peak_bytes(plan)
    return None if peak is None else peak / GIB


def ours(folder: Path, on_gpu: bool) -> dict | None:
    """A row's measurements from our trainer's dump folder; None if it logged no step."""
    path = folder / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    records = [r for r in records if "tps" in r]
    if not records:
        return None
    plan = Plan.from_json(folder / "plan.json")
    last = records[-1]
    return {
        "steps": len(records),
        "tokens_per_s": _round(_steady([r["tps"] for r in records]), 1),
        "mfu": _round(_steady([r["mfu"] for r in records]), 2),
        "peak_memory_gib_measured": _round(last["memory_gib"]) if on_gpu else None,
        "peak_memory_gib_predicted": _round(predicted_peak_gib(plan)),
        "step_s_measured": _round(last.get("measured_step_s"), 4),
        "step_s_predicted": _round(last.get("predicted_step_s"), 4),
    }


def _max_active_gib(tb: Path) -> float | None:
    """torchtitan's ``memory/max_active(GiB)`` from its TensorBoard events, where readable."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return None
    values = []
    for run in sorted({p.parent for p in tb.rglob("events.out.tfevents.*")}):
        events = EventAccumulator(str(run)).Reload()
        if "memory/max_active(GiB)" in events.Tags().get("scalars", []):
            values += [e.value for e in events.Scalars("memory/max_active(GiB)")]
    return max(values) if values else None


def torchtitan(log: Path, folder: Path, tokens_per_step: int) -> dict | None:
    """A row's measurements from torchtitan's console log and TensorBoard events."""
    steps = [m.groupdict() for m in _TITAN_STEP.finditer(_ANSI.sub("", log.read_text(errors="replace")))]
    if not steps:
        return None
    tps = [float(s["tps"].replace(",", "")) for s in steps]
    measured = _max_active_gib(folder)
    return {
        "steps": len(steps),
        "tokens_per_s": _round(_steady(tps), 1),
        "mfu": _round(_steady([float(s["mfu"]) for s in steps]), 2),
        # max_active where TensorBoard is readable; else the console's max_reserved (each step's:
        # torchtitan resets the peak after every log line)
        "peak_memory_gib_measured": _round(measured if measured is not None else max(float(s["mem"]) for s in steps)),
        "peak_memory_gib_predicted": None,
        "step_s_measured": _round(tokens_per_step / _steady(tps), 4),
        "step_s_predicted": None,
    }


def last_line(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()] if log.is_file() else []
    return _ANSI.sub("", lines[-1]).strip()[:300] if lines else "(no log)"


def summarise(runs: Path, logs: Path, tokens_per_step: int) -> dict:
    import torch

    on_gpu = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if on_gpu else "cpu"
    rows, checks, plans = [], [], []
    plan_only = runs / "qwen_plan" / "plan.json"  # no GPU: the GPU job planned on a fake process group
    if plan_only.is_file():
        plan = Plan.from_json(plan_only)
        plans.append({"case": "qwen3 1.7B bf16, planned for an h100 on a fake process group",
                      "peak_memory_gib_predicted": _round(predicted_peak_gib(plan)),
                      "step_s_predicted": _round(predicted_step_us(plan) / 1e6, 4)})
    for stage, (case, impl) in STAGES.items():
        log = logs / f"{stage}.log"
        if not log.is_file():
            continue
        found = (torchtitan(log, runs / stage, tokens_per_step) if impl == TORCHTITAN
                 else ours(runs / stage, on_gpu))
        checks.append({"stage": stage, "trained": found is not None, "last_line": last_line(log)})
        if found is not None:
            rows.append({"case": case, "impl": impl, "device": device, "torch": torch.__version__, **found})
    return {"rows": rows, "checks": checks, "plans": plans}


COLUMNS = ["case", "impl", "device", "steps", "tokens_per_s", "mfu", "peak_memory_gib_measured",
           "peak_memory_gib_predicted", "step_s_measured", "step_s_predicted"]


def markdown(summary: dict) -> str:
    head = "| " + " | ".join(COLUMNS) + " |\n|" + " --- |" * len(COLUMNS) + "\n"
    body = "".join("| " + " | ".join("-" if r[c] is None else str(r[c]) for c in COLUMNS) + " |\n"
                   for r in summary["rows"])
    failed = [c for c in summary["checks"] if not c["trained"]]
    notes = "".join(f"\n- {c['stage']} did not train: `{c['last_line']}`" for c in failed)
    notes += "".join(f"\n- {p['case']}: peak {p['peak_memory_gib_predicted']} GiB, step {p['step_s_predicted']} s"
                     for p in summary.get("plans", []))
    return head + body + notes + ("\n" if notes else "")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=Path, required=True, help="the stages' dump folders")
    p.add_argument("--logs", type=Path, required=True, help="the stages' console logs (<stage>.log)")
    p.add_argument("--out", type=Path, required=True, help="where training.json and training.md go")
    p.add_argument("--tokens-per-step", type=int, default=4 * 4096, help="torchtitan's job: local batch x seq")
    a = p.parse_args()
    summary = summarise(a.runs, a.logs, a.tokens_per_step)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    (a.out / "training.md").write_text(markdown(summary))
    print(markdown(summary), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
