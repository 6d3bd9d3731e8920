#!/usr/bin/env python
"""The compile's re-trace, with DTensor's sharding propagation as torch traces it and as we do.

``execute/compiled.py`` records one interpreted step with ``make_fx``. Under any
tracer DTensor skips its sharding-propagation cache, and a propagation's own
index-tensor work (sizing ``_StridedShard`` chunks) is recorded as dead nodes;
``sharding_propagation_for_trace`` uses the cache and keeps that work out of
the recording. Each measurement is a fresh process (the caches are per
process) on a fake process group of 4, mesh dp_shard 2 x tp 2, planned by the
default ILP, then ``step.compile`` timed alone. Two cases: ``fsdp_tp``, the
LLaMA3 debug model (6 blocks) at batch 4 x 64; ``strided``, 2 blocks at batch
6 x 512 with ``strided_sharding`` (the strided launcher test's job). The arms
alternate, so a drifting machine affects both alike.

    .venv/bin/python experiments/startup/compile_trace.py [--repeats 3]

Writes ``compile_trace.json`` and ``compile_trace.md`` beside this file. Run on an idle machine.
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
ARMS = ("ours", "torch")
CASES = {  # name -> (blocks, global batch, seq len, strided sharding)
    "fsdp_tp": (6, 4, 64, False),
    "strided": (2, 6, 512, True),
}


def measure(case: str, arm: str) -> dict:
    """One compile in this process; ``arm`` says whose sharding propagation traces."""
    import contextlib
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torchtitan_autoparallel.execute import compiled
    from torchtitan_autoparallel.execute.parity import ParityConfig, batch, full_model, plan_parity

    if arm == "torch":
        compiled.sharding_propagation_for_trace = contextlib.nullcontext
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    layers, global_batch, seq_len, strided = CASES[case]
    cfg = ParityConfig(layers=layers, batch=global_batch, seq_len=seq_len, strided_sharding=int(strided))
    full = full_model(cfg)
    planned = plan_parity(cfg, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp")), full)
    tokens, labels = batch(cfg, 0, full.tok_embeddings.weight.shape[0])
    start = time.perf_counter()
    planned.step.compile(tokens, labels)
    seconds = time.perf_counter() - start
    gm = planned.step.local_graph
    live = copy.deepcopy(gm)
    live.graph.eliminate_dead_code()
    dist.destroy_process_group()
    return {"case": case, "arm": arm, "compile_s": seconds, "graph_nodes": len(gm.graph.nodes),
            "live_nodes": len(live.graph.nodes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", nargs=2, metavar=("CASE", "ARM"), help=argparse.SUPPRESS)  # a child's work
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one)))
        return
    runs = []
    for i in range(args.repeats):
        for case in CASES:
            for arm in ARMS:
                cmd = [sys.executable, __file__, "--one", case, arm]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True)
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"round {i + 1} {case} {arm}: {runs[-1]['compile_s']:.2f} s", flush=True)
    write(runs, args.repeats)


def write(runs: list[dict], repeats: int) -> None:
    summary = {}
    for case in CASES:
        for arm in ARMS:
            mine = [r for r in runs if r["case"] == case and r["arm"] == arm]
            summary[f"{case} {arm}"] = {
                "median_s": statistics.median(r["compile_s"] for r in mine),
                "each_s": [round(r["compile_s"], 2) for r in mine],
                "graph_nodes": sorted({r["graph_nodes"] for r in mine}),
                "live_nodes": sorted({r["live_nodes"] for r in mine}),
            }
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    (HERE / "compile_trace.json").write_text(json.dumps({"made": stamp, "runs": runs, "summary": summary}, indent=1))
    rows = [
        f"| {name.split()[0]} | {name.split()[1]} | {s['median_s']:.2f} | {', '.join(map(str, s['each_s']))} "
        f"| {', '.join(map(str, s['graph_nodes']))} | {', '.join(map(str, s['live_nodes']))} |"
        for name, s in summary.items()
    ]
    (HERE / "compile_trace.md").write_text(
        "# The compile's re-trace: DTensor's sharding propagation as torch traces it, and as we do\n\n"
        f"Made by `experiments/startup/compile_trace.py --repeats {repeats}` on {stamp} (2-core machine). "
        "One process per measurement, fake process group of 4, dp_shard 2 x tp 2; `step.compile` alone. "
        "`fsdp_tp`: LLaMA3 debug model (6 blocks), batch 4 x 64. `strided`: 2 blocks, batch 6 x 512, "
        "`strided_sharding` on (the plan uses strided shards). `ours`: `sharding_propagation_for_trace` "
        "(DTensor's cache allowed, its own index-tensor work not recorded); `torch`: as torch traces.\n\n"
        "| case | arm | median s | each s | recorded graph nodes | live nodes |\n|---|---|---:|---|---|---|\n"
        + "\n".join(rows) + "\n\n"
        "Recorded minus live nodes are dead ones (read by nothing), and every step ran them. The live nodes "
        "are the same, node for node: `tests/execute/test_overlap_execution.py::"
        "test_compiling_reuses_dtensors_sharding_cache_and_records_the_same_graph` (fsdp) and "
        "`tests/planner/test_strided.py::test_compiling_a_strided_plan_records_no_sharding_bookkeeping` (strided).\n"
    )


if __name__ == "__main__":
    main()
