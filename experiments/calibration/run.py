#!/usr/bin/env python
"""Does a calibrated cost model predict CPU step times? Calibrate, then train and compare.

1. ``CALIBRATE=1 NGPU=4 ./run_train.sh --out OUT/profile.json``: measure the
   4 CPU gloo ranks (matmuls, copies, the four collectives over the 4-rank
   mesh dim) and fit a cost profile.
2. For each plan shape, train the llama3 debug model's automatic plan on 4
   ranks with ``--autoparallel.cost_profile OUT/profile.json``; the degrees
   force the mesh, the planner picks the placements:
     fsdp     dp_shard 4           (local batch 2)
     tp       dp_shard 1 x tp 4    (local batch 8)
     fsdp_tp  dp_shard 2 x tp 2    (local batch 4)
   seq_len 128, global batch 8, fp32, TensorBoard off, ``--steps`` steps.
3. Read the last record of each run's metrics.jsonl: the plan's predicted
   step time, the measured one (median of the steps after the first two) and
   their ratio; write ``OUT/results.json`` and print a table.

    .venv/bin/python experiments/calibration/run.py                # all three, ~10 min
    .venv/bin/python experiments/calibration/run.py --plans fsdp   # one, to check the script

Run it on an otherwise idle machine: the ranks share its cores, and the
calibration measures whatever else is running too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "tests"))

from _run import CONFIGS, read_metrics, run_launcher  # noqa: E402

NGPU = 4
GLOBAL_BATCH = 8
SEQ_LEN = 128
# plan -> (dp_shard, tp)
PLANS = {"fsdp": (4, 1), "tp": (1, 4), "fsdp_tp": (2, 2)}
TERMS = ("compute", "comm", "host", "alloc", "optimizer")


def calibrate(out: Path, repeats: int) -> Path:
    profile = out / "profile.json"
    run = run_launcher(["--out", profile, "--repeats", repeats], ngpu=NGPU, env={"CALIBRATE": "1"}, timeout=900)
    if run.returncode != 0:
        sys.exit(f"calibration failed\n{run.tail()}")
    print("\n".join(line for line in run.stdout.splitlines() if "[calibrate]" in line))
    return profile


def train(plan: str, profile: Path, out: Path, steps: int) -> dict:
    shard, tp = PLANS[plan]
    folder = out / plan
    args = [
        "--model.name", "llama3_auto_parallel", "--job.dump_folder", folder,
        "--parallelism.data_parallel_shard_degree", shard, "--parallelism.tensor_parallel_degree", tp,
        "--training.steps", steps, "--training.seq_len", SEQ_LEN,
        "--training.local_batch_size", GLOBAL_BATCH // shard,
        "--metrics.enable_tensorboard", "false", "--metrics.peak_tflops", 1,
        "--autoparallel.cost_profile", profile, "--autoparallel.plan_cache", "false",
    ]
    start = time.perf_counter()
    run = run_launcher(args, ngpu=NGPU, config=CONFIGS["llama3"], timeout=1200)
    if run.returncode != 0:
        sys.exit(f"training {plan} failed\n{run.tail()}")
    records = read_metrics(folder)
    # metrics.jsonl is appended to: this run's records start at its last step 1.
    records = records[max(i for i, r in enumerate(records) if r["step"] == 1):]
    last = records[-1]
    plan_json = json.loads((folder / "plan.json").read_text())
    return {
        "plan": plan,
        "mesh": plan_json["mesh"],
        "predicted_step_s": last["predicted_step_s"],
        # The plan check's terms, repriced from the compiled graph (train/plan_check.py).
        **{f"predicted_{t}_s": last.get(f"predicted_{t}_s", 0.0) for t in TERMS},
        "plan_comm_s": plan_json["predicted"]["comm_us"] / 1e6,  # before bucketing, as the planner priced it
        "measured_step_s": last.get("measured_step_s"),
        "measured_over_predicted": last.get("measured_over_predicted"),
        "step_seconds": [r["step_time_s"] for r in records],  # every step, warm-up included: the spread
        "run_seconds": time.perf_counter() - start,
        "command": run.cmd,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", default=",".join(PLANS), help=f"comma-separated, from {', '.join(PLANS)}")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--repeats", type=int, default=5, help="calibration repeats per measurement")
    parser.add_argument("--out", type=Path, default=HERE / "out")
    args = parser.parse_args()
    plans = args.plans.split(",")
    if bad := [p for p in plans if p not in PLANS]:
        sys.exit(f"error: --plans {','.join(bad)}; accepted: {', '.join(PLANS)}")
    if args.steps < 3:
        sys.exit(f"error: --steps {args.steps}; accepted: >= 3 (the first two are warm-up)")
    args.out.mkdir(parents=True, exist_ok=True)
    profile = calibrate(args.out, args.repeats)
    rows = [train(p, profile, args.out, args.steps) for p in plans]
    (args.out / "results.json").write_text(json.dumps({"profile": json.loads(profile.read_text()), "runs": rows}, indent=1))
    print(f"{'plan':<8} {'mesh':<18} {'predicted ms':>12} {'measured ms':>12} {'measured/predicted':>19}")
    for r in rows:
        mesh = "x".join(f"{n}={s}" for n, s in zip(r["mesh"]["names"], r["mesh"]["sizes"]))
        measured = r["measured_step_s"]
        ratio = r["measured_over_predicted"]
        print(f"{r['plan']:<8} {mesh:<18} {r['predicted_step_s'] * 1e3:>12.1f} "
              f"{(measured or 0) * 1e3:>12.1f} {ratio if ratio is not None else float('nan'):>19.2f}")
    print(f"results in {args.out / 'results.json'}")
    if args.out == HERE / "out":  # the committed record: results.json and README.md beside this file
        (HERE / "results.json").write_text((args.out / "results.json").read_text())
        (HERE / "README.md").write_text(markdown(json.loads((HERE / "results.json").read_text())))


def _spread(run: dict) -> str:
    steady = [s * 1e3 for s in run.get("step_seconds", [])[2:]]
    return f"({min(steady):.0f}-{max(steady):.0f})" if steady else ""


def markdown(result: dict) -> str:
    p = result["profile"]
    lines = [
        "# Calibrated predictions against measured step times (4 CPU ranks, gloo)",
        "",
        "Made by `.venv/bin/python experiments/calibration/run.py` (calibrate, then train each plan "
        f"{SEQ_LEN} tokens x global batch {GLOBAL_BATCH}; measured: median of the steps after the first two, with their min-max).",
        f"Fitted profile: fp32 {p['peak_tflops']['float32'] * 1e3:.1f} GFLOP/s, memory {p['mem_bandwidth_GBps']:.1f} GB/s, "
        f"kernel overhead {p['kernel_overhead_us']:.1f} us, link {p['intra_node']['bandwidth_GBps']:.2f} GB/s "
        f"with {p['intra_node']['latency_us']:.0f} us latency per hop and {p['intra_node'].get('call_overhead_us', 0):.0f} us "
        f"per call; host {p.get('host_us_per_node', 0):.1f} us per graph node; fresh output memory "
        f"{p.get('alloc_us_per_byte', 0) * 4096:.1f} us per 4 KiB page; optimizer "
        f"{p.get('optimizer_us_per_tensor', 0):.0f} us per tensor + {p.get('optimizer_us_per_element', 0) * 1e3:.1f} ns "
        f"per local element + {p.get('optimizer_fixed_us', 0):.0f} us per step.",
        "Predicted terms are per step, priced on the compiled graph the trainer runs (bucketed collectives, "
        "its node count); plan comm is the planner's own (per-tensor collectives, before bucketing).",
        "",
        "| plan | mesh | compute ms | comm ms | host ms | fresh memory ms | optimizer ms | plan comm ms "
        "| predicted step ms | measured step ms (min-max) | measured / predicted |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["runs"]:
        mesh = "x".join(f"{n}={s}" for n, s in zip(r["mesh"]["names"], r["mesh"]["sizes"]))
        lines.append(
            f"| {r['plan']} | {mesh} | "
            + " | ".join(f"{r[f'predicted_{t}_s'] * 1e3:.1f}" for t in TERMS)
            + f" | {r['plan_comm_s'] * 1e3:.1f} | {r['predicted_step_s'] * 1e3:.1f} | {(r['measured_step_s'] or 0) * 1e3:.1f} "
            f"{_spread(r)}"
            f"| {r['measured_over_predicted'] or float('nan'):.2f} |"
        )
    lines += ["", "Commands:", ""] + [f"- {r['plan']}: `{r['command']}`" for r in result["runs"]]
    notes = HERE / "notes.md"
    return "\n".join(lines + (["", notes.read_text().strip()] if notes.exists() else [])) + "\n"


if __name__ == "__main__":
    main()
