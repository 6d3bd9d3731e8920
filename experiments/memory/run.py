#!/usr/bin/env python
"""The plan's predicted per-device peak against each CPU rank's measured peak of tensor memory.

Each case launches ``run_train.sh`` as a user would, with
``--metrics.tensor_memory_step`` measuring one steady step on every rank
(``train/tensor_memory.py``: the CPU tensor storages live at the step's start
plus the running maximum of the allocator's traffic during it, replayed by
address). Predicted is plan.json's whole peak
(``report.common.predicted_peak_bytes``: parameters and AdamW state plus the
step's peak of activations, gradients and the executed collectives' buffers,
``peak_parts``). Measured is the
largest rank's peak. ``start`` is the largest rank's tensor memory at the
step's start (parameters, gradients kept from the step before, optimizer
state, buffers such as RoPE's table), the part the prediction calls state.

    .venv/bin/python experiments/memory/run.py [--only llama3] [--ranks 2] [--mesh FSDP,TP] [--ac none,full,auto]

``auto`` rows plan ``activation_checkpoint.mode = auto`` under a
``memory_budget_gib`` halfway between the same mesh's ``full`` and ``none``
rows' predicted peaks (``AUTO_POINT``; run those rows first): the planner
picks the recomputation, and how much to reshard, that fits it; the row says
which mode it chose.

Writes ``results.json`` (``{"rows": [{"case", "mesh_kind", "ranks", "ac",
"predicted_peak_bytes", "measured_peak_bytes", ...}]}``) and ``results.md``
beside this file. A filtered run replaces the rows it ran (same case, mesh,
ranks and ac) and keeps the others.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))

from torchtitan_autoparallel.planner.plan.plan import Plan  # noqa: E402
from torchtitan_autoparallel.report.common import predicted_peak_bytes, state_bytes  # noqa: E402

MIB = 2**20
# mesh kind -> (replicate, shard, tp) for a number of ranks
MESHES = {
    "DDP": lambda n: (n, 1, 1),
    "FSDP": lambda n: (1, n, 1),
    "TP": lambda n: (1, 1, n),
    "FSDPxTP": lambda n: (1, n // 2, 2),
}
CASES = [  # (model, flavor, ranks, mesh kinds)
    ("llama3", "debugmodel", 2, ("DDP", "FSDP", "TP")),
    ("llama3", "debugmodel", 4, ("DDP", "FSDP", "TP", "FSDPxTP")),
    ("qwen3", "debugmodel", 2, ("DDP", "FSDP", "TP")),
    ("qwen3", "debugmodel", 4, ("DDP", "FSDP", "TP", "FSDPxTP")),
    # 0.6B on a 24 GiB host: its fp32 weights, gradients and AdamW state are 9.6 GB whole,
    # so only meshes that shard them fit beside the ranks' activations (DDP would hold 19 GB on 2).
    ("qwen3", "0.6B", 2, ("FSDP", "TP")),
    ("qwen3", "0.6B", 4, ("FSDP", "FSDPxTP")),
]
# A real model's step on CPU ranks takes minutes at the debug batch: one sequence of 128 tokens.
FLAVOR_ARGS = {"0.6B": ["--training.local_batch_size", "1", "--training.seq_len", "128"]}
AUTO_POINT = 0.5  # an auto row's budget: this far from the full row's prediction to the none row's
AUTO_FLOOR = 1.01  # and at least this much of the full row's (none and full may peak alike)


def auto_budget(rows: list[dict], model: str, flavor: str, ranks: int, kind: str) -> float:
    """The memory budget (bytes) of an auto row: ``AUTO_POINT`` of the way from its mesh's
    full row's predicted peak up to its none row's, and at least ``AUTO_FLOOR`` of the
    full one: where recomputing moves the peak, the planner has to recompute or reshard;
    where it does not (the state's peak), the budget is just over it."""
    peaks = {}
    for r in rows:
        if _key(r)[:3] == (f"{model} {flavor}", kind, ranks) and "predicted_peak_bytes" in r:
            peaks[r["ac"]] = r["predicted_peak_bytes"]
    if "none" not in peaks or "full" not in peaks:
        raise SystemExit(f"error: no ac=none and ac=full rows for {model} {flavor} {kind} on {ranks} ranks; "
                         f"run them before its auto row (--ac none,full,auto)")
    return max(peaks["full"] + AUTO_POINT * (peaks["none"] - peaks["full"]), AUTO_FLOOR * peaks["full"])


def run_case(
    model: str, flavor: str, ranks: int, kind: str, ac: str, steps: int, timeout: float, budget: float | None = None
) -> dict:
    rep, shard, tp = MESHES[kind](ranks)
    with tempfile.TemporaryDirectory(prefix="memory_") as folder:
        args = [
            "--model.name", f"{model}_auto_parallel", "--model.flavor", flavor, *FLAVOR_ARGS.get(flavor, []),
            "--job.dump_folder", folder,
            "--training.steps", str(steps), "--metrics.tensor_memory_step", str(steps),
            "--metrics.enable_tensorboard", "false", "--activation_checkpoint.mode", ac,
            "--parallelism.data_parallel_replicate_degree", str(rep),
            "--parallelism.data_parallel_shard_degree", str(shard), "--parallelism.tensor_parallel_degree", str(tp),
        ]  # fmt: skip
        if budget is not None:
            args += ["--autoparallel.memory_budget_gib", repr(budget / 2**30)]
        env = {"NGPU": str(ranks), "CONFIG_FILE": f"train_configs/{model}_debugmodel.toml", "OMP_NUM_THREADS": "1"}
        start = time.perf_counter()
        proc = subprocess.run(["./run_train.sh", *args], cwd=REPO, env={**os.environ, **env},
                              capture_output=True, text=True, timeout=timeout)
        row = {"case": f"{model} {flavor}", "mesh_kind": kind, "ranks": ranks, "ac": ac,
               "wall_s": round(time.perf_counter() - start, 1)}
        if budget is not None:
            row["budget_bytes"] = budget
        measured = [json.loads(p.read_text()) for p in sorted(Path(folder).glob("tensor_memory_rank*.json"))]
        if proc.returncode != 0 or len(measured) != ranks:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            return {**row, "error": tail[0][:300]}
        plan = Plan.from_json(Path(folder) / "plan.json")
    return {
        **row,
        "predicted_peak_bytes": predicted_peak_bytes(plan),
        "measured_peak_bytes": max(m["peak_bytes"] for m in measured),
        "predicted_state_bytes": state_bytes(plan),
        "measured_start_bytes": max(m["start_bytes"] for m in measured),
        "predicted_activation_bytes": plan.predicted.get("peak_activation_bytes_per_device"),
        "ac_planned": plan.activation_checkpoint,
        "memory_fit": plan.memory_fit,
    }


def _key(row: dict) -> tuple:
    return row["case"], row["mesh_kind"], row["ranks"], row["ac"]


def merged(rows: list[dict], row: dict) -> list[dict]:
    """``rows`` with ``row`` in place of the one of its key, in the table's order
    (model, ranks, ac, mesh as ``CASES`` and ``MESHES`` list them)."""
    out = [r for r in rows if _key(r) != _key(row)] + [row]
    kinds = list(MESHES)
    order = ["none", "full", "auto"]
    return sorted(out, key=lambda r: (r["case"], r["ranks"], order.index(r["ac"]), kinds.index(r["mesh_kind"])))


def markdown(rows: list[dict]) -> str:
    out = ["| case | mesh | ranks | ac | predicted MiB | measured MiB | measured / predicted | "
           "state predicted MiB | start measured MiB | budget MiB |", "|" + " --- |" * 10]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['case']} | {r['mesh_kind']} | {r['ranks']} | {r['ac']} | error: {r['error']} |||||")
            continue
        p, m = r["predicted_peak_bytes"], r["measured_peak_bytes"]
        ac = f"auto: {r['ac_planned']}{' resharded' if r.get('memory_fit') else ''}" if r["ac"] == "auto" else r["ac"]
        budget = f"{r['budget_bytes'] / MIB:.1f}" if "budget_bytes" in r else "-"
        out.append(f"| {r['case']} | {r['mesh_kind']} | {r['ranks']} | {ac} | {p / MIB:.1f} | {m / MIB:.1f} | "
                   f"{m / p:.2f} | {r['predicted_state_bytes'] / MIB:.1f} | {r['measured_start_bytes'] / MIB:.1f} | "
                   f"{budget} |")
    return "\n".join(out) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help="run the cases whose model or flavor is this (llama3, qwen3, debugmodel, 0.6B)")
    p.add_argument("--steps", type=int, default=3, help="steps per run; the last one is measured")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--ac", default="none,full,auto", help="activation_checkpoint.mode values to run, comma-separated")
    p.add_argument("--ranks", help="run only these rank counts, comma-separated")
    p.add_argument("--mesh", help="run only these mesh kinds (DDP, FSDP, TP, FSDPxTP), comma-separated")
    a = p.parse_args()
    results = HERE / "results.json"
    rows = json.loads(results.read_text())["rows"] if results.exists() else []
    for (model, flavor, ranks, kinds), ac in itertools.product(CASES, a.ac.split(",")):
        if (a.only and a.only not in (model, flavor)) or (a.ranks and str(ranks) not in a.ranks.split(",")):
            continue
        for kind in kinds:
            if a.mesh and kind not in a.mesh.split(","):
                continue
            budget = auto_budget(rows, model, flavor, ranks, kind) if ac == "auto" else None
            row = run_case(model, flavor, ranks, kind, ac, a.steps, a.timeout, budget)
            rows = merged(rows, row)
            print(json.dumps(row), flush=True)
            results.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    (HERE / "results.md").write_text(markdown(rows))
    print(markdown(rows), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
