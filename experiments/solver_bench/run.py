"""Solver benchmark: exact ILP (HiGHS, CBC), TRW-S and the LP bound on the same problems.

Each (model, mesh) problem is built once, in a fresh process on a fake
process group of its world size, and saved (``Problem.save``). Every solver
then runs in its own process on that saved problem, once with the default
(tightest) memory budget and once with a loose one (``LOOSE`` times it), under
a per-solver time limit. Each solver's time covers its whole ``solve`` call
(presolve included), not loading the file. Results go to ``results.json`` and
``README.md`` beside this file (the notes below the table, from ``NOTES_MARK``
on, are kept when the table is rewritten).

    .venv/bin/python experiments/solver_bench/run.py                 # every case
    .venv/bin/python experiments/solver_bench/run.py --only debug    # names containing "debug"
    .venv/bin/python experiments/solver_bench/run.py --solvers ilp-cbc  # rerun one solver, keep the rest
    .venv/bin/python experiments/solver_bench/run.py --report-only   # README.md from results.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from torchtitan_autoparallel.planner.problem.problem import READABLE_VERSIONS

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench_args import add_case_args, kept_notes, rewrite_report  # noqa: E402  (experiments/)

LOOSE = 4.0  # the loose budget, as a multiple of the tightest
SOLVERS = ("ilp-highs", "ilp-cbc", "approx")
LP_BOUND = "lp-bound"  # not a solver: the LP relaxation's value alone, on the presolved problem
GRACE_S = 600  # beyond the time limit before a solver's process is killed
REPEAT_UNDER_S = 5.0  # runs shorter than this are repeated ...
REPEATS = 3  # ... this many times in all, and the median time kept
D2 = ("dp_shard", "tp")
D3 = ("dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class Model:
    label: str
    family: str
    flavor: str
    seq_len: int


@dataclass(frozen=True)
class Mesh:
    label: str
    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def world(self) -> int:
        return _prod(self.sizes)

    @property
    def dp(self) -> int:
        return _prod(s for n, s in zip(self.names, self.sizes) if n.startswith("dp"))


MODELS = [
    Model("llama3-debug", "llama3", "debugmodel", 256),
    Model("llama3-1B", "llama3", "1B", 2048),
    Model("llama3-8B", "llama3", "8B", 2048),
    Model("llama3-70B", "llama3", "70B", 2048),
    Model("qwen3-8B", "qwen3", "8B", 2048),
]
MESHES = [
    Mesh("2-D 8x8", D2, (8, 8)),
    Mesh("3-D 2x4x8", D3, (2, 4, 8)),
    Mesh("3-D 8x8x8", D3, (8, 8, 8)),
]
BUDGETS = ("tight", "loose")


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def case_name(model: Model, mesh: Mesh, budget: str) -> str:
    return f"{model.label} {mesh.label} {budget}"


# Child: plan once (the fast solver; the plan itself is not used) to export the problem.
_BUILD = r"""
import json, sys, time
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from torchtitan_autoparallel.models.registry import build_meta_model
from torchtitan_autoparallel.planner.plan.api import plan_stages
from torchtitan_autoparallel.planner.plan.options import PlannerOptions
# fp32 matmuls at TF32 rates, as when the committed tables were measured (docs/cost_model.md)
from torchtitan_autoparallel.planner.cost.profiles import for_matmul_precision, load_profile
c = json.loads(sys.argv[1])
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=c["world"])
mesh = init_device_mesh("cpu", tuple(c["sizes"]), mesh_dim_names=tuple(c["names"]))
model = build_meta_model(c["family"], c["flavor"], None)
stages = plan_stages(model, mesh, PlannerOptions(
    global_batch_size=c["dp"], seq_len=c["seq_len"], profile=for_matmul_precision(load_profile("h100"), "high"),
    solver="approx", time_limit_s=600, export_problem=c["path"]))
t = stages.plan.timings
print("RESULT " + json.dumps({k: t.get(k) for k in ("trace", "strategies", "build")}))
"""

# Child: one solver on one saved problem; prints its outcome as JSON.
_SOLVE = r"""
import gc, json, math, sys, time
from torchtitan_autoparallel.planner.problem.problem import InfeasibleProblem, Problem
sys.path.insert(0, sys.argv[2])  # this folder, for load_kernels
from load_kernels import load_all
from torchtitan_autoparallel.planner.solve import get_solver
from torchtitan_autoparallel.planner.solve.exact.lp_bound import lp_bound
from torchtitan_autoparallel.planner.solve.registry import pairwise_entries
from torchtitan_autoparallel.planner.solve.presolve.pipeline import presolve, problem_size
c = json.loads(sys.argv[1])
problem = Problem.load(c["path"])
problem.memory_budget *= c["scale"]
spec, check = c["solver"].removesuffix("+check"), c["solver"].endswith("+check")
name, _, backend = spec.partition("-")
solver = None if spec == "lp-bound" else get_solver(name, backend or "highs", optimality_check=check)
# once per process, timed apart: loading the compiled kernels, and importing HiGHS
# (the solvers import it on first use, which would charge it to the HiGHS cells)
loaded = time.perf_counter()
load_all()
kernel_load_s = time.perf_counter() - loaded
loaded = time.perf_counter()
import highspy  # noqa: E402,F401
highs_import_s = time.perf_counter() - loaded
# the loader's objects (hundreds of thousands of labels on the large models) would
# otherwise make the solve's first allocations start a full collection, 0.1 s charged
# to whichever solver runs: collected here, for every solver alike
gc.collect()
start = time.perf_counter()
if solver is None:
    bound = lp_bound(problem, c["time_limit"])
    print("RESULT " + json.dumps({"seconds": time.perf_counter() - start, "lower_bound": bound,
                                  "status": "optimal" if math.isfinite(bound) else "time_limit"}))
    sys.exit(0)
try:
    sol = solver.solve(problem, c["time_limit"])
except InfeasibleProblem as e:
    print("RESULT " + json.dumps({"error": str(e), "seconds": time.perf_counter() - start}))
    sys.exit(0)
seconds = time.perf_counter() - start
out = {"seconds": seconds, "kernel_load_s": kernel_load_s, "highs_import_s": highs_import_s, "objective": sol.objective, "lower_bound": sol.lower_bound,
       "status": sol.status, "solver": sol.solver,
       "memory_fraction": problem.memory_used(sol.assignment) / problem.memory_budget}
if c.get("sizes"):
    out["original"] = problem_size(problem)
    pre = presolve(problem)
    out["reduced"] = problem_size(pre.reduced)
    out["presolve_s"] = pre.seconds
    out["pairwise_entries"] = pairwise_entries(problem)
print("RESULT " + json.dumps(out))
"""


def _child(script: str, spec: dict, timeout: float) -> dict:
    start = time.perf_counter()
    # Its own session, so a timeout also kills what it started (CBC runs as a separate binary;
    # the solver now stops it past its limit, this is the safety net).
    proc = subprocess.Popen(
        [sys.executable, "-c", script, json.dumps(spec), str(HERE)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"error": f"killed after {timeout:.0f} s", "wall_s": time.perf_counter() - start}
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (stderr or stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": tail[0], "wall_s": time.perf_counter() - start}
    return {**json.loads(lines[-1][len("RESULT "):]), "wall_s": time.perf_counter() - start}


def build(model: Model, mesh: Mesh, folder: Path) -> tuple[Path, dict]:
    """The (model, mesh) problem file, built unless a previous run left it."""
    path = folder / f"{model.label}-{mesh.label.replace(' ', '_')}.npz"
    if path.exists() and _readable(path):
        return path, {"reused": str(path)}
    spec = {**asdict(model), **asdict(mesh), "world": mesh.world, "dp": mesh.dp, "path": str(path)}
    print(f"building {model.label} on {mesh.label} ...", flush=True)
    return path, _child(_BUILD, spec, 3600)


def _readable(path: Path) -> bool:
    """False for a file of an older format, which Problem.load refuses: it is built again."""
    with np.load(path, allow_pickle=False) as f:
        return int(f["format_version"]) in READABLE_VERSIONS


def run_case(path: Path, budget: str, solvers: tuple[str, ...], time_limit: float) -> dict:
    """Every solver once, then, for those that took under ``REPEAT_UNDER_S``, further
    rounds in turn (fresh processes) with each one's median time kept: one run of a
    sub-second solve on a shared VM can be off by 2x, and taking the solvers in turn
    lets a slow spell of the machine fall on all of them rather than on one."""
    scale = 1.0 if budget == "tight" else LOOSE
    specs = {
        name: {"path": str(path), "scale": scale, "solver": name, "time_limit": time_limit, "sizes": i == 0}
        for i, name in enumerate(solvers)
    }
    runs = {name: [_child(_SOLVE, spec, time_limit + GRACE_S)] for name, spec in specs.items()}
    again = [n for n, (r,) in runs.items() if r.get("seconds", math.inf) < REPEAT_UNDER_S and "objective" in r]
    for _ in range(REPEATS - 1):
        for name in again:
            runs[name].append(_child(_SOLVE, {**specs[name], "sizes": False}, time_limit + GRACE_S))
    results = {}
    for name in solvers:
        first = runs[name][0]
        if len(runs[name]) > 1:
            times = [r.get("seconds", math.inf) for r in runs[name]]
            first = {**first, "seconds": statistics.median(times), "seconds_runs": times}
        results[name] = {**first, "time_limit_s": time_limit}
        shown = ("seconds", "objective", "lower_bound", "status", "error")
        print(f"  {name}: " + json.dumps({k: results[name].get(k) for k in shown}), flush=True)
    return results


def summarise(results: dict, previous: dict | None = None) -> dict:
    """Gaps of every plan to the best bound any solver proved; the approx speed-up.
    Solvers not run this time keep their ``previous`` results (a CBC-only rerun)."""
    kept = {k: r for k, r in (previous or {}).get("solvers", {}).items()
            if k.removesuffix("+check") in SOLVERS + (LP_BOUND,)}
    results = {**kept, **results}
    ok = {k: r for k, r in results.items() if "objective" in r}
    bounds = [r["lower_bound"] for r in ok.values()] + [results.get(LP_BOUND, {}).get("lower_bound", -math.inf)]
    best_bound = max(bounds) if ok else None
    for r in ok.values():
        r["gap_to_best_bound"] = max(0.0, r["objective"] - best_bound) / max(abs(r["objective"]), 1e-9)
    out: dict = {"solvers": results, "best_lower_bound": best_bound}
    sizes = next((r for r in results.values() if "original" in r), None)
    if sizes:
        keys = ("original", "reduced", "pairwise_entries", "presolve_s")
        out["problem"] = {k: sizes.pop(k) for k in keys if k in sizes}
    elif previous and "problem" in previous:
        out["problem"] = previous["problem"]
    if "ilp-highs" in ok and "approx" in ok:
        out["approx_speedup_over_highs"] = ok["ilp-highs"]["seconds"] / max(ok["approx"]["seconds"], 1e-9)
    lp = results.get(LP_BOUND)
    out["lp_certified"] = bool(lp and lp.get("status") == "optimal")
    return out


def command_for(name: str) -> str:
    return f".venv/bin/python experiments/solver_bench/run.py --only '{name}'"


def _cell(r: dict | None, row_limit: float | None) -> str:
    if r is None:
        return "-"
    if "error" in r:
        return "failed: " + r["error"][:60].replace("|", "/")
    flag = "" if r["status"] == "optimal" else f" ({r['status']})"
    own = r.get("time_limit_s", row_limit)  # a solver rerun with a limit of its own says so
    limit = f" [limit {own:g} s]" if own != row_limit else ""
    return f"{r['seconds']:.2f} s, {100 * r['gap_to_best_bound']:.3f}%{flag}{limit}"


def _speedup(r: dict) -> str:
    highs, approx = r["solvers"].get("ilp-highs", {}), r["solvers"].get("approx", {})
    speed = r.get("approx_speedup_over_highs")
    if not speed:
        return "-"
    # HiGHS stopped by the limit: its time understates what it needs
    at_least = ">= " if highs.get("status") == "time_limit" else ""
    return f"{at_least}{speed:.1f}x" if approx.get("objective") else "-"


def _lp_cell(r: dict) -> str:
    lp = r["solvers"].get(LP_BOUND)
    if lp is None:  # a row last run when the LP came from the deleted lp solver
        return "yes" if r.get("lp_certified") else "no"
    return f"yes, {lp['seconds']:.2f} s" if r["lp_certified"] else f"no ({lp.get('status', lp.get('error'))})"


def write_markdown(results: list[dict], path: Path) -> None:
    head = "| case | limit s | reduced nodes / variables | " + " | ".join(SOLVERS)
    rows = [
        head + " | approx speed-up | presolve s | LP bound |",
        "|" + " --- |" * (len(SOLVERS) + 6),
    ]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['case']} | | failed: {r['error'][:80]} |" + " |" * (len(SOLVERS) + 3))
            continue
        red = r.get("problem", {}).get("reduced", {})
        size = f"{red.get('nodes', '?')} / {red.get('variables', '?')}"
        cells = " | ".join(_cell(r["solvers"].get(s), r.get("time_limit_s")) for s in SOLVERS)
        shared = r.get("problem", {}).get("presolve_s")
        rows.append(
            f"| {r['case']} | {r.get('time_limit_s', '?')} | {size} | {cells} | {_speedup(r)} "
            f"| {'-' if shared is None else f'{shared:.2f}'} "
            f"| {_lp_cell(r)} |"
        )
    text = [
        "# Solver benchmark",
        "",
        f"Measured on {platform.node()} ({platform.processor() or platform.machine()}, {os.cpu_count()} cores),",
        "H100 cost profile, fake process group; each solver in its own process, with the time",
        "limit of the row (`limit s`).",
        f"`tight`: the default (smallest feasible) memory budget; `loose`: {LOOSE:g} times it.",
        "Each cell: solve time (presolve included) and the plan's gap to the best lower bound any",
        "solver proved for that case (the LP value, the ILP's bound or optimum, TRW-S's bound);",
        "a status other than optimal is shown in brackets. `approx speed-up`: HiGHS time / approx time.",
        f"A solve under {REPEAT_UNDER_S:g} s is run {REPEATS} times (fresh processes, in turn with the row's",
        "other solvers) and its median time shown (`seconds_runs` in `results.json`). Loading the compiled solver kernels and",
        "importing HiGHS, once per process, are timed apart (`kernel_load_s`, `highs_import_s`).",
        "`presolve s`: the exact presolve every solver runs first (timed alone, in another process).",
        "`LP bound`: the LP relaxation of the presolved problem finished (and in how long), so every",
        "plan in the row is certified against it.",
        "Reproduce a row with the command under `command` in `results.json`, or all with",
        "`.venv/bin/python experiments/solver_bench/run.py`.",
        "",
    ]
    path.write_text("\n".join(text + rows) + "\n\n" + kept_notes(path))


def _cases(only: str) -> list[tuple[Model, Mesh, str]]:
    return [
        (m, mesh, b) for m in MODELS for mesh in MESHES for b in BUDGETS
        if only in case_name(m, mesh, b)
    ]


def pick(only: str) -> list[tuple[Model, Mesh, str]]:
    """``_cases(only)``; if none, a one-line error naming the cases and exit status 2."""
    cases = _cases(only)
    if not cases:
        models, meshes = [m.label for m in MODELS], [m.label for m in MESHES]
        print(
            f"error: no case matches {only!r}; a case is named '<model> <mesh> <budget>' from "
            f"models {models}, meshes {meshes} and budgets {list(BUDGETS)}", file=sys.stderr,
        )
        raise SystemExit(2)
    return cases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_case_args(parser)
    parser.add_argument(
        "--solvers", default=",".join(SOLVERS + (LP_BOUND,)),
        help="comma-separated subset of " + ", ".join(SOLVERS + (LP_BOUND,)) + "; a name ending in '+check' "
        "runs that solver with optimality_check (kept in results.json, not in the table)",
    )
    parser.add_argument("--time-limit", type=float, default=600.0, help="seconds per solver and case")
    parser.add_argument("--problems", default="/tmp/solver_bench_problems", help="where built problems are kept")
    args = parser.parse_args()
    out = HERE / "results.json"
    if args.report_only:
        return rewrite_report(HERE, write_markdown)
    cases = pick(args.only)
    folder = Path(args.problems)
    folder.mkdir(parents=True, exist_ok=True)
    solvers = tuple(s for s in args.solvers.split(",") if s)
    previous = {r["case"]: r for r in json.loads(out.read_text())} if out.exists() else {}
    for model, mesh, budget in cases:
        name = case_name(model, mesh, budget)
        path, built = build(model, mesh, folder)
        if "error" in built:
            previous[name] = {"case": name, "error": built["error"], "command": command_for(name)}
            continue
        print(f"solving {name} ...", flush=True)
        raw = run_case(path, budget, solvers, args.time_limit)
        result = {"case": name, "budget": budget, "build": built, **summarise(raw, previous.get(name))}
        result["command"] = command_for(name)
        # the row's limit: the one every solver ran under, unless only some were rerun
        result["time_limit_s"] = previous.get(name, {}).get("time_limit_s", args.time_limit)
        if set(SOLVERS) <= set(solvers):
            result["time_limit_s"] = args.time_limit
        result["load_average"] = os.getloadavg()[0]  # other work on the machine skews times
        previous[name] = result
        ordered = [previous[case_name(*c)] for c in _cases("") if case_name(*c) in previous]
        out.write_text(json.dumps(ordered, indent=1))
        write_markdown(ordered, HERE / "README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
