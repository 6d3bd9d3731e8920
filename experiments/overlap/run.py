"""Plans with and without communication/computation overlap (``--autoparallel.overlap``).

Each case plans twice in a fresh process on a fake process group of its world
size (one CPU process, as a ``COMM_MODE=fake_backend`` dry run): overlap off,
then on. The report says what changed (parameter placements, collectives per
step) and the predicted step time of each: the plain sum (compute + comm) and,
with overlap, the effective time (sum minus what the plan hides behind compute).

    .venv/bin/python experiments/overlap/run.py --only debug   # the quick check
    .venv/bin/python experiments/overlap/run.py                # LLaMA3 8B and 70B too

Results go to ``results.json`` and ``README.md`` beside this file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Case:
    name: str
    flavor: str
    n_layers: int | None
    mesh_names: tuple[str, ...]
    mesh_sizes: tuple[int, ...]
    seq_len: int
    local_batch: int = 1  # per data-parallel rank

    @property
    def dp(self) -> int:
        out = 1
        for n, s in zip(self.mesh_names, self.mesh_sizes):
            out *= s if n.startswith("dp") else 1
        return out


CASES = [
    Case("llama3-debug 2 layers 1-D dp_shard=8", "debugmodel", 2, ("dp_shard",), (8,), 256, 1),
    Case("llama3-8B 2-D 8x8 (64 ranks)", "8B", None, ("dp_shard", "tp"), (8, 8), 2048),
    Case("llama3-70B 3-D 8x8x8 (512 ranks)", "70B", None, ("dp_replicate", "dp_shard", "tp"), (8, 8, 8), 2048),
]

# Runs inside the child process: plan one case with overlap off and on, print both as JSON.
_CHILD = r"""
import json, sys
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from torchtitan_autoparallel.models.registry import build_meta_model
from torchtitan_autoparallel.planner.api import plan_training_step
from torchtitan_autoparallel.planner.profiles import load_profile
c, solver, limit = json.loads(sys.argv[1]), sys.argv[2], float(sys.argv[3])
world = 1
for s in c["mesh_sizes"]:
    world *= s
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
mesh = init_device_mesh("cpu", tuple(c["mesh_sizes"]), mesh_dim_names=tuple(c["mesh_names"]))
model = build_meta_model("llama3", c["flavor"], c["n_layers"])
out = {}
for overlap in (False, True):
    plan = plan_training_step(model, mesh, global_batch_size=c["local_batch"] * c["dp"], seq_len=c["seq_len"],
                              profile=load_profile("h100"), solver=solver, time_limit_s=limit, overlap=overlap)
    out["on" if overlap else "off"] = {
        "objective_us": plan.objective, "lower_bound_us": plan.lower_bound, "solver": plan.solver,
        "status": plan.status, "timings": plan.timings, "predicted": plan.predicted,
        "parameters": plan.parameters, "table": plan.table(),
        "collectives": [c.__dict__ for c in plan.collectives],
    }
print("RESULT " + json.dumps(out))
"""


def run_case(case: Case, solver: str, time_limit: float) -> dict:
    spec = json.dumps({**asdict(case), "dp": case.dp})
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, spec, solver, str(time_limit)],
        capture_output=True, text=True, timeout=4 * time_limit + 1800,
    )
    wall = time.perf_counter() - start
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        if proc.returncode < 0:  # SIGKILL here has been the kernel's OOM killer (see dmesg)
            tail = [f"killed by signal {-proc.returncode} after {wall:.0f} s"]
        return {"case": case.name, "error": tail[0], "wall_s": wall}
    return {"case": case.name, "wall_s": wall, "solver": solver, "time_limit_s": time_limit,
            **json.loads(lines[-1][len("RESULT "):])}


def collective_counts(plan: dict) -> dict[str, int]:
    """Collectives per step by 'kind/purpose/mesh dim'."""
    counts: dict[str, int] = {}
    for c in plan["collectives"]:
        key = f"{c['kind']}/{c['purpose']}/{c['mesh_dim']}"
        counts[key] = counts.get(key, 0) + c["count"]
    return counts


def changes(result: dict) -> tuple[list[str], list[str]]:
    """Parameters placed differently, and collective counts that differ (off -> on)."""
    off, on = result["off"], result["on"]
    moved = [f"{fqn}: {''.join(off['parameters'][fqn])} -> {''.join(p)}"
             for fqn, p in on["parameters"].items() if off["parameters"].get(fqn) != p]
    a, b = collective_counts(off), collective_counts(on)
    diff = [f"{k}: {a.get(k, 0)} -> {b.get(k, 0)}" for k in sorted(set(a) | set(b)) if a.get(k, 0) != b.get(k, 0)]
    return moved, diff


NOTES = """\
What the rows say. With overlap on, the savings model is now solved on the
presolved problem (`planner/solvers/overlap_presolve.py`: ties collapsed,
energy-only nodes eliminated, the rest kept with every member's compute and
edges priced at its own step position; exact, see docs/planner.md) and the
reported savings are recomputed on the full problem after expansion.

* debug model: overlap re-shards two weights and turns gradient reductions
  into reduce-scatters the backward can hide; effective step 1421 us -> 802 us
  (the MIP stops at its 0.1% gap: bound 801.6 us). Solve 12 s (23.5 s on the
  full model before; there are no ties, so the presolve removes little).
* LLaMA3-8B 8x8: the overlap presolve takes the problem from 5843 nodes /
  2.82M variables to 202 nodes / 84K variables, and the overlap ILP stops at
  its 0.1% gap in 58 s (bound 156541 us); before, the unreduced model hit the
  300 s limit and returned its warm start (effective 182400 us). The plan is
  new (wqkv, w2, w3 re-sharded): its compute doubles (51.2 -> 106.1 ms) but
  most exposed activation redistributions go (activation all-gathers over
  dp_shard 65 -> 4, activation all-to-alls over tp 99 -> 4), traded for
  parameter all-gathers that hide behind that compute (161 -> 225 over tp). Predicted: sum 262.8 ms, of which 106.1 ms
  hidden, effective 156.7 ms against 233.6 ms with overlap off (-33%). Peak
  activation memory per device doubles (5.7 -> 11.4 GiB); no memory budget
  was set. Peak RSS of the whole run: 1.3 GiB.
* LLaMA3-70B 8x8x8: no longer killed (peak RSS 7.4 GiB, it was OOM-killed at
  24 GiB unreduced). The overlap presolve leaves 203 nodes / 1.91M variables
  (the plain presolve: 97 / 0.79M): nearly every backward node ends a
  gradient-side (overlappable) edge, so it must stay. HiGHS does not finish
  that model's root LP within 240 s, nor within 540 s (the row above; the
  solve stops 6 s past its limit; 25 s past it before the MIP was given only
  what the warm start and presolve leave), so the solve returns its warm
  start, the plain optimum (status time_limit, no useful bound), priced
  exactly: all 377.0 ms of compute hides, effective 1128.2 ms against
  1505.2 ms. Finding a better overlap plan at this size is open.

Commands (each under `flock /tmp/cpu.lock`):
`.venv/bin/python experiments/overlap/run.py --only debug`,
`.venv/bin/python experiments/overlap/run.py --only 8B`,
`.venv/bin/python experiments/overlap/run.py --only 70B --time-limit 540`
(peak RSS from `/usr/bin/time -v`: 7.4 GiB).

Measured execution with the executor's overlap on and off (4 CPU ranks):
`measured.md` beside this file."""


def write_markdown(results: list[dict], path: Path) -> None:
    lines = [
        "# Plans with and without overlap",
        "",
        f"Measured on {platform.node()} ({os.cpu_count()} cores), H100 cost profile, fake process group.",
        "`sum` is compute + communication; `effective` subtracts what the plan hides behind compute",
        "(parameter gathers prefetched ahead of their use, gradient reductions behind later backward",
        "compute). With overlap off, nothing is hidden and the plan is priced by its sum.",
        "",
        "| case | overlap | solver | status | compute us | comm us | sum us | saved us | effective us | solve s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['case']} | failed: {r['error']} |  |  |  |  |  |  |  |  |")
            continue
        for key in ("off", "on"):
            p, plan = r[key]["predicted"], r[key]
            saved = p.get("overlap_savings_us", 0.0)
            lines.append(
                f"| {r['case']} | {key} | {plan['solver']} | {plan['status']} | {p['compute_us']:.0f} "
                f"| {p['comm_us']:.0f} | {p['total_us']:.0f} | {saved:.0f} | {p['total_us'] - saved:.0f} "
                f"| {plan['timings'].get('solve', 0):.1f} |"
            )
    lines += [f"\n{r['case']}: {r['note']}" for r in results if r.get("note")]
    lines += ["", NOTES]
    for r in results:
        if "error" in r:
            continue
        moved, diff = changes(r)
        lines += ["", f"## {r['case']}", "", f"Placements that changed ({len(moved)}):", ""]
        lines += [f"- {m}" for m in moved[:40]] or ["- none"]
        lines += ["", "Collectives per step that changed (kind/purpose/mesh dim: off -> on):", ""]
        lines += [f"- {d}" for d in diff] or ["- none"]
        for key in ("off", "on"):
            lines += ["", f"Overlap {key}:", "", "```", r[key]["table"], "```"]
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="run the cases whose name contains this text")
    parser.add_argument("--solver", default="ilp", choices=("ilp", "lp"))
    parser.add_argument("--time-limit", type=float, default=600.0, help="per solve, seconds")
    parser.add_argument("--report-only", action="store_true", help="rewrite README.md from results.json")
    args = parser.parse_args()
    out = HERE / "results.json"
    if args.report_only:
        write_markdown(json.loads(out.read_text()), HERE / "README.md")
        return 0
    cases = [c for c in CASES if args.only in c.name]
    if not cases:
        print(f"error: no case matches {args.only!r}; cases: {[c.name for c in CASES]}", file=sys.stderr)
        return 2
    previous = {r["case"]: r for r in json.loads(out.read_text())} if out.exists() else {}
    for case in cases:
        print(f"planning {case.name} (overlap off, then on) ...", flush=True)
        result = run_case(case, args.solver, args.time_limit)
        limit = "" if args.time_limit == 600.0 else f" --time-limit {args.time_limit:g}"
        result["command"] = f".venv/bin/python experiments/overlap/run.py --only '{case.name}'{limit}"
        previous[case.name] = result
        print(json.dumps({k: result.get(k) for k in ("case", "wall_s", "error")}), flush=True)
    ordered = [previous[c.name] for c in CASES if c.name in previous]
    out.write_text(json.dumps(ordered, indent=1))
    write_markdown(ordered, HERE / "README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
