"""Compare the calibrated H100 profiles (experiments/gpu/results) with the built-in ``h100``.

    .venv/bin/python experiments/gpu/summarise.py

Writes results.json and results.md beside this file. ``single_calls``: the calibrator
timed each compute call alone (before 28 Nov 2026); ``batched``: in batches of >= 5 ms,
as a step queues its kernels. Rates are what a kernel reaches (the built-in's peak times
its compute_efficiency).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from torchtitan_autoparallel.planner.profiles import BUILTIN_PROFILES, TF32

HERE = Path(__file__).resolve().parent
RUNS = ("single_calls", "batched")


def effective(profile: dict) -> dict[str, float]:
    eff = profile["compute_efficiency"]
    rates = {f"{d} TFLOP/s": v * eff for d, v in profile["peak_tflops"].items()}
    return {**rates, "HBM GB/s": profile["mem_bandwidth_GBps"], "kernel overhead us": profile["kernel_overhead_us"],
            "host us per graph node": profile["host_us_per_node"]}


def main() -> None:
    builtin = BUILTIN_PROFILES["h100"].to_dict()  # as built in, whatever this process's matmul precision
    rows = {"built-in h100": effective(builtin)}
    rows["built-in h100"][f"{TF32} TFLOP/s"] = builtin["peak_tflops"][TF32] * builtin["compute_efficiency"]
    for run in RUNS:
        rows[f"calibrated, {run.replace('_', ' ')}"] = effective(json.loads((HERE / "results" / run / "h100_profile.json").read_text()))
    precision = json.loads((HERE / "results" / "batched" / "matmul_precision.json").read_text())
    gemm = json.loads((HERE / "results" / "batched" / "gemm_shapes.json").read_text())
    by_tp = _ratios_by_tp(gemm["rows"])
    (HERE / "results.json").write_text(
        json.dumps({"profiles": rows, "matmul_precision": precision, "gemm_ratio_by_tp": by_tp,
                    "gemm_summary": gemm["summary"]}, indent=2) + "\n"
    )

    keys = list(rows["built-in h100"])
    lines = ["| | " + " | ".join(rows) + " |", "| --- |" + " --- |" * len(rows)]
    for k in keys:
        cells = [f"{rows[r][k]:,.1f}" if k in rows[r] else "-" for r in rows]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines += ["", f"Matmuls alone ({precision['device']}, torch {precision['torch']}, CUDA events, 20 calls):", "",
              "| n | dtype | float32_matmul_precision | TFLOP/s |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['n']} | {r['dtype']} | {r['float32_matmul_precision']} | {r['tflops']} |" for r in precision["rows"]]
    lines += ["", "LLaMA3-8B and 70B projections in bf16, 8192 tokens, each weight whole or cut by tp on "
              "either dim: measured / priced by the built-in h100 profile (gemm_shapes.py):", "",
              "| tp | shapes | median | min | max |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {tp} | {r['n']} | {r['median']:.3f} | {r['min']:.3f} | {r['max']:.3f} |" for tp, r in by_tp.items()]
    (HERE / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _ratios_by_tp(rows: list[dict]) -> dict[str, dict]:
    out = {}
    for tp in sorted({r["tp"] for r in rows}):
        ratios = [r["ratio"] for r in rows if r["tp"] == tp]
        out[str(tp)] = {"n": len(ratios), "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return out


if __name__ == "__main__":
    main()
