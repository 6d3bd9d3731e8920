#!/usr/bin/env python
"""``[compile]`` on CPU: step time, memory and losses, compiled against eager, per plan.

For the LLaMA3 debug model, each plan runs through ``./run_train.sh`` twice, as
a user would: eager, then with ``--compile.enable true`` (Inductor). The
planned model (``llama3_auto_parallel``) gets its whole step built by Inductor;
torchtitan's hand-written plans (``llama3``) get torchtitan's per-block compile
and a compiled loss.

Fixed settings: seq_len 256, local batch 8, 12 steps; s/step is the median of
steps 4-12 (``step_time_s`` of metrics.jsonl), memory the largest
``memory_gib`` any step logged; ``first step s`` includes planning's
compile of the step graph and the backend's build (Inductor's caches start
empty: ``TORCHINDUCTOR_CACHE_DIR`` is a fresh folder per run). ``max loss
rel diff``: over the 12 steps, against the eager run of the same plan.

Outputs: ``results.json`` and ``README.md`` beside this script. Run it on an
otherwise idle machine: ``.venv/bin/python experiments/compile/run.py``.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(HERE.parent))

from _run import LLAMA3_CONFIG, read_metrics, run_launcher  # noqa: E402
from bench_args import kept_notes  # noqa: E402  (experiments/)

STEPS = 12
WARMUP = 3
# (label, model name, ranks, tensor-parallel degree)
PLANS = [
    ("planned, FSDP-like mesh dp_shard=2", "llama3_auto_parallel", 2, 1),
    ("planned, mesh dp_shard=2 x tp=2", "llama3_auto_parallel", 4, 2),
    ("hand-written FSDP 2", "llama3", 2, 1),
    ("hand-written FSDP 2 x TP 2", "llama3", 4, 2),
]
BUILT = re.compile(r"compile: \w+ built the planned step in ([0-9.]+) s")


def run_one(model: str, ranks: int, tp: int, compiled: bool, folder: Path) -> dict:
    args = [
        "--model.name", model, "--training.steps", str(STEPS),
        "--parallelism.tensor_parallel_degree", str(tp), "--job.dump_folder", str(folder / "out"),
        "--metrics.enable_tensorboard", "false", "--compile.enable", "true" if compiled else "false",
    ]
    env = {"TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor_cache")}
    run = run_launcher(args, ngpu=ranks, config=LLAMA3_CONFIG, env=env, timeout=1800)
    if run.returncode != 0:
        raise SystemExit(f"run failed\n{run.tail()}")
    records = [r for r in read_metrics(folder / "out") if "loss" in r]
    built = BUILT.search(run.stdout + run.stderr)
    return {
        "command": run.cmd + " (TORCHINDUCTOR_CACHE_DIR: a fresh folder)",
        "s_per_step": statistics.median(r["step_time_s"] for r in records[WARMUP:]),
        "first_step_s": records[0]["step_time_s"],
        "backend_build_s": float(built.group(1)) if built else None,
        "memory_gib": max(r["memory_gib"] for r in records),
        "losses": [r["loss"] for r in records],
    }


def measure() -> list[dict]:
    rows = []
    for label, model, ranks, tp in PLANS:
        row = {"plan": label, "model": model, "ranks": ranks, "tp": tp}
        for compiled in (False, True):
            with tempfile.TemporaryDirectory() as tmp:
                row["inductor" if compiled else "eager"] = run_one(model, ranks, tp, compiled, Path(tmp))
            print(label, "inductor" if compiled else "eager", row["inductor" if compiled else "eager"]["s_per_step"], flush=True)
        eager, ind = row["eager"]["losses"], row["inductor"]["losses"]
        row["max_loss_rel_diff"] = max(abs(a - b) / abs(a) for a, b in zip(eager, ind))
        row["speed_up"] = row["eager"]["s_per_step"] / row["inductor"]["s_per_step"]
        rows.append(row)
    return rows


def write_markdown(rows: list[dict], path: Path) -> None:
    lines = [
        "# `[compile]` on CPU: Inductor against eager",
        "",
        f"Measured on {platform.node()} ({platform.machine()}, {os.cpu_count()} cores), gloo,",
        f"LLaMA3 debug model, seq_len 256, local batch 8, {STEPS} steps; s/step: median of steps",
        f"{WARMUP + 1}-{STEPS}. Reproduce: `.venv/bin/python experiments/compile/run.py`",
        "(each run's command is in `results.json`).",
        "",
        "| plan | ranks | eager s/step | Inductor s/step | speed-up | eager GiB | Inductor GiB "
        "| first step s (eager / Inductor) | Inductor build s | max loss rel diff |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        e, i = r["eager"], r["inductor"]
        build = f"{i['backend_build_s']:.1f}" if i["backend_build_s"] is not None else "-"
        lines.append(
            f"| {r['plan']} | {r['ranks']} | {e['s_per_step']:.3f} | {i['s_per_step']:.3f} | {r['speed_up']:.2f}x "
            f"| {e['memory_gib']:.2f} | {i['memory_gib']:.2f} | {e['first_step_s']:.1f} / {i['first_step_s']:.1f} "
            f"| {build} | {r['max_loss_rel_diff']:.1e} |"
        )
    path.write_text("\n".join(lines) + "\n\n" + kept_notes(path))


def main() -> int:
    rows = measure()
    (HERE / "results.json").write_text(json.dumps({"steps": STEPS, "warmup": WARMUP, "rows": rows}, indent=1) + "\n")
    write_markdown(rows, HERE / "README.md")
    print((HERE / "README.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
