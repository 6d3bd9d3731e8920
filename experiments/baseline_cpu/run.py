#!/usr/bin/env python
"""CPU baseline of the hand-written parallelisms: s/step, tps and MFU per plan.

For the llama3 and qwen3 debug models, on 1, 2 and 4 CPU ranks (gloo), each
hand-written plan is launched through ``./run_train.sh`` exactly as a user
would, and the step records of ``metrics.jsonl`` are averaged.

Plans (data-parallel replicate x shard x tensor):
  1 rank : single                (1 x 1 x 1)
  2 ranks: DDP (2 x 1 x 1), FSDP (1 x 2 x 1), TP (1 x 1 x 2)
  4 ranks: FSDP 4 (1 x 4 x 1), FSDP2xTP2 (1 x 2 x 2), HSDP 2x2 (2 x 2 x 1)

Fixed settings (full run; ``--quick`` in brackets):
  * seq_len 128, global batch 8 sequences per step (local batch = 8 / dp
    degree), so every row trains on the same 1,024 tokens per step;
  * 8 steps [2], the first 3 [1] excluded as warm-up; reported numbers are
    means over the remaining steps;
  * fp32 params and reductions, AdamW, activation checkpointing off,
    TensorBoard off, the shipped corpus and tokenizer;
  * OMP_NUM_THREADS = nproc // ranks (run_train.sh's default on CPU);
  * MFU peak: measured once per thread budget by this script before the
    runs (best of 5 x 0.5 s of 1024x1024 fp32 matmuls with OMP_NUM_THREADS =
    nproc // ranks) and passed as ``--metrics.peak_tflops``, so that every
    row of a rank count uses the same peak. (The trainer's own start-up
    benchmark, 0.5 s of 512x512 matmuls, runs while the other ranks start and
    can read low on a shared machine: it gave MFU > 100 % here.) MFU is per
    rank against that rank's share of the machine.
  * ``--quick``: 2 steps, one plan per model (1 rank, single) to prove that
    the script works; it writes ``results_quick.json`` and ``quick.md`` here
    instead of the real outputs.

Outputs: ``experiments/baseline_cpu/results.json`` and
``experiments/baseline_cpu.md`` (table, exact command per row, machine).
Run one benchmark at a time on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "tests"))

from _run import CONFIGS, PYTHON, read_metrics, run_launcher  # noqa: E402

SEQ_LEN = 128
GLOBAL_BATCH = 8

# (ranks, plan name, replicate, shard, tensor)
PLANS = [
    (1, "single", 1, 1, 1),
    (2, "DDP", 2, 1, 1),
    (2, "FSDP", 1, 2, 1),
    (2, "TP", 1, 1, 2),
    (4, "FSDP 4", 1, 4, 1),
    (4, "FSDP2xTP2", 1, 2, 2),
    (4, "HSDP 2x2", 2, 2, 1),
]
MODELS = ["llama3", "qwen3"]


def machine() -> dict:
    def sh(cmd: str) -> str:
        try:
            return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=60).stdout.rstrip()
        except Exception as e:  # noqa: BLE001 - description only
            return f"({cmd}: {e})"

    torch_version = sh(f"{shlex.quote(str(PYTHON))} -c 'import torch; print(torch.__version__)'")
    return {
        "nproc": sh("nproc"),
        "free_g": sh("free -g"),
        "cpu": sh("lscpu | grep -m1 'Model name' | sed 's/.*: *//'"),
        "torch": torch_version,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "load_average_at_start": sh("cat /proc/loadavg"),
    }


PEAK_SNIPPET = """
import time, torch
n = 1024
a, b = torch.randn(n, n), torch.randn(n, n)
torch.mm(a, b)
best = 0.0
for _ in range(5):
    reps, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < 0.5:
        torch.mm(a, b)
        reps += 1
    best = max(best, 2 * n**3 * reps / elapsed / 1e12)
print(best)
"""


def measure_peak_tflops(threads: int) -> float:
    """fp32 matmul TFLOPs of one process with ``threads`` threads (best of 5)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run([str(PYTHON), "-c", PEAK_SNIPPET], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def run_row(model: str, ranks: int, plan: str, rep: int, shard: int, tp: int, steps: int, warmup: int, root: Path,
            peak: float, model_name: str | None = None, extra: tuple[str, ...] = (), tag: str = "") -> dict:
    """Launch one plan and average its steady-state steps; ``model_name`` picks a registry entry
    other than ``model`` itself (e.g. ``llama3_auto_parallel``); ``extra`` are further overrides,
    ``tag`` tells apart the dump folders of runs that differ only in them."""
    dp = rep * shard
    local_batch = GLOBAL_BATCH // dp
    dump = root / f"{model_name or model}-{ranks}-{plan.replace(' ', '_')}{tag}"
    args = [
        "--job.dump_folder", str(dump),
        "--training.steps", str(steps),
        "--training.seq_len", str(SEQ_LEN),
        "--training.local_batch_size", str(local_batch),
        "--metrics.enable_tensorboard", "false",
        "--parallelism.data_parallel_replicate_degree", str(rep),
        "--parallelism.data_parallel_shard_degree", str(shard),
        "--parallelism.tensor_parallel_degree", str(tp),
        "--metrics.peak_tflops", f"{peak:.6g}",
    ]
    # always named: the shipped llama3 file trains the planner's plan, ``model`` is torchtitan's
    args += ["--model.name", model_name or model]
    args += list(extra)
    config = CONFIGS[model].relative_to(REPO)
    command = f"NGPU={ranks} CONFIG_FILE={config} ./run_train.sh " + " ".join(
        a if not a.startswith(str(root)) else "<dump>" for a in args
    )
    row = {"model": model_name or model, "ranks": ranks, "plan": plan, "degrees": [rep, shard, tp], "local_batch_size": local_batch,
           "command": command, "dump": str(dump)}
    print(f"[{time.strftime('%H:%M:%S')}] {command}", flush=True)
    run = run_launcher(args, ngpu=ranks, config=config, timeout=1800)
    row["wall_s"] = round(run.seconds, 1)
    if run.returncode != 0:
        row["error"] = run.tail(20)
        print(f"  FAILED (exit {run.returncode})\n{run.tail(20)}", flush=True)
        return row
    records = read_metrics(dump)
    measured = [r for r in records if r["step"] > warmup]
    row.update(
        steps_measured=len(measured),
        s_per_step=statistics.mean(r["step_time_s"] for r in measured),
        tps=statistics.mean(r["tps"] for r in measured),
        mfu_pct=statistics.mean(r["mfu"] for r in measured),
        memory_gib=max(r["memory_gib"] for r in measured),
        final_loss=records[-1]["loss"],
    )
    print(f"  {row['s_per_step']:.3f} s/step  {row['tps']:.0f} tps  {row['mfu_pct']:.2f}% MFU", flush=True)
    return row


def markdown(result: dict) -> str:
    m, s = result["machine"], result["settings"]
    lines = [
        "# CPU baseline: hand-written parallelisms" + (" (QUICK smoke run, not a benchmark)" if s["quick"] else ""),
        "",
        f"Made by `experiments/baseline_cpu/run.py{' --quick' if s['quick'] else ''}` on {result['date']}.",
        "",
        f"Settings: seq_len {s['seq_len']}, global batch {s['global_batch']} sequences per step "
        f"(local batch = global / data-parallel degree), {s['steps']} steps of which the first "
        f"{s['warmup_steps']} are excluded as warm-up; numbers are means over the rest. fp32, AdamW, "
        "no activation checkpointing, TensorBoard off, shipped corpus. tps is tokens/s per rank; "
        "MFU is per rank, against the fp32 matmul peak of one process with OMP_NUM_THREADS = nproc / ranks, "
        "measured by the script before the runs: "
        + ", ".join(f"{k} rank(s): {v:.4f} TFLOPs" for k, v in sorted(result["peak_tflops"].items())) + ".",
        "",
        "| model | ranks | plan | s/step | tps | MFU % |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['ranks']} | {r['plan']} | failed | | |")
        else:
            lines.append(
                f"| {r['model']} | {r['ranks']} | {r['plan']} | {r['s_per_step']:.3f} | {r['tps']:.0f} | {r['mfu_pct']:.2f} |"
            )
    lines += ["", "## Commands", ""]
    for r in result["rows"]:
        lines.append(f"- {r['model']}, {r['ranks']} rank(s), {r['plan']}: `{r['command']}`")
    lines += [
        "",
        "## Machine",
        "",
        f"- CPU: {m['cpu']}; `nproc`: {m['nproc']}",
        f"- torch {m['torch']}, Python {m['python']}, kernel {m['kernel']}",
        f"- load average at start: {m['load_average_at_start']}",
        "",
        "`free -g`:",
        "",
        "```",
        m["free_g"],
        "```",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 steps, one plan (1 rank) per model")
    ap.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    ap.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4], choices=[1, 2, 4])
    ap.add_argument("--out-json", type=Path, default=None)
    ap.add_argument("--out-md", type=Path, default=None)
    a = ap.parse_args(argv)

    steps, warmup = (2, 1) if a.quick else (8, 3)
    plans = [p for p in PLANS if p[0] in a.ranks]
    if a.quick:
        plans = plans[:1]
    out_json = a.out_json or (HERE / ("results_quick.json" if a.quick else "results.json"))
    out_md = a.out_md or (HERE / "quick.md" if a.quick else HERE.parent / "baseline_cpu.md")

    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "settings": {"quick": a.quick, "seq_len": SEQ_LEN, "global_batch": GLOBAL_BATCH, "steps": steps,
                     "warmup_steps": warmup, "omp_num_threads": "nproc // ranks"},
        "rows": [],
    }
    nproc = len(os.sched_getaffinity(0))  # what `nproc` prints
    result["peak_tflops"] = {
        str(r): measure_peak_tflops(max(nproc // r, 1)) for r in sorted({p[0] for p in plans})
    }
    print(f"fp32 matmul peak per rank: {result['peak_tflops']}", flush=True)
    with tempfile.TemporaryDirectory(prefix="baseline_cpu_") as tmp:
        for model in a.models:
            for ranks, plan, rep, shard, tp in plans:
                result["rows"].append(
                    run_row(model, ranks, plan, rep, shard, tp, steps, warmup, Path(tmp), result["peak_tflops"][str(ranks)])
                )
    out_json.write_text(json.dumps(result, indent=2) + "\n")
    out_md.write_text(markdown(result))
    print(f"wrote {out_json} and {out_md}")
    return 1 if any("error" in r for r in result["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
