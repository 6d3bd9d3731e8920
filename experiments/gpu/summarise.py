"""Compare the calibrated profiles of one GPU (experiments/gpu/results) with its built-in profile.

    .venv/bin/python experiments/gpu/summarise.py          # H100: results.json, results.md
    .venv/bin/python experiments/gpu/summarise.py h200     # results/h200: results_h200.json, results_h200.md

The H100's runs: ``single_calls``, the calibrator timed each compute call alone (before
28 Nov 2026); ``batched``, in batches of >= 5 ms, as a step queues its kernels. Another
GPU's run is the folder results/<gpu>, as check.sh writes it. Rates are what a kernel
reaches (the built-in's peak times its compute_efficiency).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from torchtitan_autoparallel.planner.cost.profiles import BUILTIN_PROFILES, TF32, default_profile_name

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Summary:
    gpu: str  # the tag check.sh names the profile by: <gpu>_profile.json
    runs: tuple[str, ...]  # folders under results/ whose calibrated profiles are compared
    timings: str  # the run whose matmul_precision.json and gemm_shapes.json are shown
    out: str  # stem of the .json and .md written beside this file


def summary_for(gpu: str) -> Summary:
    # The H100's two runs predate the per-GPU folders, and keep their files' names.
    if gpu == "h100":
        return Summary("h100", ("single_calls", "batched"), "batched", "results")
    return Summary(gpu, (gpu,), gpu, f"results_{gpu}")


def effective(profile: dict) -> dict[str, float]:
    eff = profile["compute_efficiency"]
    rates = {f"{d} TFLOP/s": v * eff for d, v in profile["peak_tflops"].items()}
    return {**rates, "HBM GB/s": profile["mem_bandwidth_GBps"], "kernel overhead us": profile["kernel_overhead_us"],
            "host us per graph node": profile["host_us_per_node"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("gpu", nargs="?", default="h100", help="the GPU's tag, as in results/<gpu>")
    s = summary_for(p.parse_args().gpu)
    name = default_profile_name("cuda", False, s.gpu.upper())  # as the trainer picks it for this GPU
    builtin = BUILTIN_PROFILES[name].to_dict()  # as built in, whatever this process's matmul precision
    rows = {f"built-in {name}": effective(builtin)}
    rows[f"built-in {name}"][f"{TF32} TFLOP/s"] = builtin["peak_tflops"][TF32] * builtin["compute_efficiency"]
    for run in s.runs:
        calibrated = json.loads((HERE / "results" / run / f"{s.gpu}_profile.json").read_text())
        rows[f"calibrated, {run.replace('_', ' ')}"] = effective(calibrated)
    precision = json.loads((HERE / "results" / s.timings / "matmul_precision.json").read_text())
    gemm = json.loads((HERE / "results" / s.timings / "gemm_shapes.json").read_text())
    by_tp = _ratios_by_tp(gemm["rows"])
    (HERE / f"{s.out}.json").write_text(
        json.dumps({"profiles": rows, "matmul_precision": precision, "gemm_ratio_by_tp": by_tp,
                    "gemm_summary": gemm["summary"]}, indent=2) + "\n"
    )

    keys = list(rows[f"built-in {name}"])
    lines = ["| | " + " | ".join(rows) + " |", "| --- |" + " --- |" * len(rows)]
    for k in keys:
        cells = [f"{rows[r][k]:,.1f}" if k in rows[r] else "-" for r in rows]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines += ["", f"Matmuls alone ({precision['device']}, torch {precision['torch']}, CUDA events, 20 calls):", "",
              "| n | dtype | float32_matmul_precision | TFLOP/s |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['n']} | {r['dtype']} | {r['float32_matmul_precision']} | {r['tflops']} |" for r in precision["rows"]]
    lines += ["", "LLaMA3-8B and 70B projections in bf16, 8192 tokens, each weight whole or cut by tp on "
              f"either dim: measured / priced by the built-in {gemm.get('profile', 'h100')} profile "
              "(gemm_shapes.py):", "",
              "| tp | shapes | median | min | max |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {tp} | {r['n']} | {r['median']:.3f} | {r['min']:.3f} | {r['max']:.3f} |" for tp, r in by_tp.items()]
    (HERE / f"{s.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _ratios_by_tp(rows: list[dict]) -> dict[str, dict]:
    out = {}
    for tp in sorted({r["tp"] for r in rows}):
        ratios = [r["ratio"] for r in rows if r["tp"] == tp]
        out[str(tp)] = {"n": len(ratios), "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return out


if __name__ == "__main__":
    main()
