#!/usr/bin/env python
"""Where the compile's re-trace spends its time on a 2-D and a 3-D mesh, and what a
memo of DTensor's ``redistribute_cost`` would save (a measurement, not shipped code).

One process per measurement, on a fake process group: the LLaMA3 debug model cut to
2 blocks at batch 8 x 64, planned by the approx solver, then ``step.compile`` timed
alone (the test suite's 3-D parity job, ``hsdp_tp``, compiles the same step on each of
its 8 ranks). ``--profile`` adds the share of that time inside DTensor's full-mesh
strategy expansion (``expand_to_full_mesh_op_strategy``), from cProfile.

    .venv/bin/python experiments/startup/compile_profile.py [--repeats 3]

Writes ``compile_profile.json`` and ``compile_profile.md`` beside this file. Run on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MESHES = {"2x2": (2, 2), "2x2x2": (2, 2, 2)}
NAMES = {2: ("dp_shard", "tp"), 3: ("dp_replicate", "dp_shard", "tp")}
ARMS = ("torch", "memo")


def measure(mesh: str, arm: str, profile: bool) -> dict:
    """One compile in this process; ``memo``: ``redistribute_cost`` answers repeats from a dict."""
    import cProfile
    import math
    import pstats

    import torch.distributed as dist
    import torch.distributed.tensor._ops.utils as op_utils
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torchtitan_autoparallel.execute.parity import ParityConfig, batch, full_model, plan_parity

    calls = {"all": 0}
    if arm == "memo":
        memo: dict = {}
        original = op_utils.redistribute_cost

        def remembered(current, target):
            calls["all"] += 1
            if (current, target) not in memo:
                memo[current, target] = original(current, target)
            return memo[current, target]

        op_utils.redistribute_cost = remembered
    sizes = MESHES[mesh]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.prod(sizes))
    cfg = ParityConfig(layers=2, batch=8, seq_len=64, solver="approx")
    full = full_model(cfg)
    planned = plan_parity(cfg, init_device_mesh("cpu", sizes, mesh_dim_names=NAMES[len(sizes)]), full)
    tokens, labels = batch(cfg, 0, full.tok_embeddings.weight.shape[0])
    calls["all"] = 0  # the compile's calls only, against an empty memo
    if arm == "memo":
        memo.clear()
    profiler = cProfile.Profile() if profile else None
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    planned.step.compile(tokens, labels)
    seconds = time.perf_counter() - start
    result = {"mesh": mesh, "arm": arm, "seconds": round(seconds, 2),
              "graph_nodes": len(planned.step.local_graph.graph.nodes)}  # fmt: skip
    if arm == "memo":
        result.update(cost_calls=calls["all"], distinct=len(memo))
    if profiler:
        profiler.disable()
        stats = pstats.Stats(profiler).stats
        expand = [v for k, v in stats.items() if k[2] == "expand_to_full_mesh_op_strategy"]
        total = sum(v[3] for k, v in stats.items() if k[2] == "compile" and "execute/step.py" in k[0])
        result["expansion_share"] = round(sum(v[3] for v in expand) / total, 3)
    return result


def child(mesh: str, arm: str, profile: bool) -> dict:
    cmd = [sys.executable, __file__, "--one", mesh, arm] + (["--profile"] if profile else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", nargs=2, metavar=("MESH", "ARM"), help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one, args.profile)))
        return
    rows = []
    for mesh in MESHES:
        runs = {arm: [] for arm in ARMS}
        for _ in range(args.repeats):
            for arm in ARMS:  # alternating, so a drifting machine affects both alike
                runs[arm].append(child(mesh, arm, profile=False))
        share = child(mesh, "torch", profile=True)["expansion_share"]
        for arm in ARMS:
            last = runs[arm][-1]
            rows.append({**last, "seconds": statistics.median(r["seconds"] for r in runs[arm]),
                         "each": [r["seconds"] for r in runs[arm]], "expansion_share": share})  # fmt: skip
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    (HERE / "compile_profile.json").write_text(json.dumps({"made": stamp, "rows": rows}, indent=1) + "\n")
    lines = [
        "# The compile's re-trace on 2-D and 3-D meshes: DTensor's strategy expansion",
        "",
        f"Made by `experiments/startup/compile_profile.py --repeats {args.repeats}` on {stamp} (2-core machine). "
        "LLaMA3 debug model, 2 blocks, batch 8 x 64, approx solver, fake process group; `step.compile` alone. "
        "`torch`: DTensor as shipped; `memo`: the strategy expansion's `redistribute_cost` calls answering "
        "repeated (source, target) spec pairs from a dict, empty when the compile starts. Expansion share: the part of an unmemoized compile inside DTensor's "
        "`expand_to_full_mesh_op_strategy` (cProfile, one run).",
        "",
        "| mesh | arm | median s | each s | graph nodes | cost calls | distinct pairs | expansion share |",
        "|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['mesh']} | {r['arm']} | {r['seconds']} | {', '.join(map(str, r['each']))} | "
                     f"{r['graph_nodes']} | {r.get('cost_calls', '')} | {r.get('distinct', '')} | "
                     f"{r['expansion_share']:.0%} |")  # fmt: skip
    (HERE / "compile_profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
