#!/usr/bin/env python
"""activation_checkpoint = "auto" (each block's recomputation chosen in the solve) against
the best uniform mode.

Each case plans one model on 8 ranks (DDP, FSDP, FSDP 2 x TP 4; a fake process
group, the ``h100`` profile; global batch 8 of 2048 tokens) under device memories
between full recomputation's and no recomputation's predicted peaks: a point ``t``
gives the planner ``full + t * (none - full)`` usable bytes. Per point, each
uniform mode (none, selective, full) is planned and fitted to the device
(resharded under memory rows where its cheapest plan is over), and the cheapest
that fits is ``uniform``; ``auto`` is one ``activation_checkpoint = "auto"`` plan,
which chooses each block's mode in the solve that fits the peak. The rows give
each choice, its predicted step time and peak, and the plans traced.

    .venv/bin/python experiments/recompute_blocks/run.py

Writes ``results.json`` and ``results.md`` beside this file.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from torchtitan_autoparallel.models.registry import build_meta_model  # noqa: E402
from torchtitan_autoparallel.planner.cost.profiles import load_profile  # noqa: E402
from torchtitan_autoparallel.planner.plan import api  # noqa: E402

MIB, GIB = 2**20, 2**30
RANKS = 8
MESHES = {"DDP": (("dp_replicate",), (8,)), "FSDP": (("dp_shard",), (8,)), "FSDPxTP": (("dp_shard", "tp"), (2, 4))}
CASES = [("llama3", "debugmodel", mesh, 8, 2048) for mesh in MESHES]
POINTS = (0.25, 0.5, 0.75)


def plan(model, mesh, batch: int, seq: int, mode: str, usable: float | None = None):  # noqa: ANN001
    device_gib = usable / (1 - api.FIT_RESERVE) / GIB if usable else None
    return api.plan_training_step(model, mesh, global_batch_size=batch, seq_len=seq, profile=load_profile("h100"),
                                  activation_checkpoint=mode, device_memory_gib=device_gib)


def summary(p, start: float, plans: int) -> dict:  # noqa: ANN001
    return {"chosen": p.activation_checkpoint + (" resharded" if p.memory_fit else ""), "step_us": p.objective,
            "peak_bytes": p.predicted["peak_bytes_per_device"], "plans": plans,
            "plan_s": round(time.perf_counter() - start, 1)}


def uniform(model, mesh, batch: int, seq: int, usable: float) -> dict:  # noqa: ANN001
    """The cheapest uniform mode whose fitted plan fits ``usable``."""
    start = time.perf_counter()
    fitting = [p for p in (plan(model, mesh, batch, seq, mode, usable) for mode in ("none", "selective", "full"))
               if p.predicted["peak_bytes_per_device"] <= usable]
    return summary(min(fitting, key=lambda p: p.objective), start, 3)


def auto(model, mesh, batch: int, seq: int, usable: float) -> dict:  # noqa: ANN001
    start = time.perf_counter()
    p = plan(model, mesh, batch, seq, "auto", usable)
    return summary(p, start, len(p.recompute_choice["tried"]))


def main() -> int:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=RANKS)
    rows = []
    for family, flavor, kind, batch, seq in CASES:
        model = build_meta_model(family, flavor)
        names, shape = MESHES[kind]
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        none, full = (plan(model, mesh, batch, seq, m).predicted["peak_bytes_per_device"] for m in ("none", "full"))
        for t in POINTS:
            usable = full + t * (none - full)
            row = {"case": f"{family} {flavor}", "mesh": f"{kind} {' x '.join(map(str, shape))}", "batch": batch, "seq": seq, "point": t,
                   "usable_bytes": usable, "none_peak_bytes": none, "full_peak_bytes": full,
                   "uniform": uniform(model, mesh, batch, seq, usable),
                   "auto": auto(model, mesh, batch, seq, usable)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    (HERE / "results.json").write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    (HERE / "results.md").write_text(markdown(rows))
    print(markdown(rows), end="")
    return 0


def markdown(rows: list[dict]) -> str:
    out = ["| case | mesh | usable MiB (t) | uniform: chosen | step ms | peak MiB | auto: chosen | step ms | "
           "peak MiB | plans | step saved |", "|" + " --- |" * 11]
    for r in rows:
        u, b = r["uniform"], r["auto"]
        out.append(f"| {r['case']} | {r['mesh']} | {r['usable_bytes'] / MIB:.1f} ({r['point']}) | {u['chosen']} | "
                   f"{u['step_us'] / 1e3:.2f} | {u['peak_bytes'] / MIB:.1f} | {b['chosen']} | {b['step_us'] / 1e3:.2f} | "
                   f"{b['peak_bytes'] / MIB:.1f} | {u['plans']} -> {b['plans']} | "
                   f"{100 * (1 - b['step_us'] / u['step_us']):.1f}% |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
