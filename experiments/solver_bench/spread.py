"""How far approx's speed-up over the HiGHS ILP moves from one measurement to the next.

``run.py`` gives each case one ratio: HiGHS's median time over approx's, three
fresh processes each, taken in turn. On a shared VM that ratio moves by a
third between reruns of the same code, so one reading says little about
whether a case clears the 30x target. This takes the same measurement
``--rounds`` times per case (``run.run_case`` with HiGHS and approx only) and
writes each round's ratio, and their spread, to ``spread.json`` and
``spread.md`` beside this file. The solvers' results are not written to
``results.json``.

    .venv/bin/python experiments/solver_bench/spread.py                         # the 2-D rows
    .venv/bin/python experiments/solver_bench/spread.py --only "70B 2-D 8x8 tight" --rounds 9
    .venv/bin/python experiments/solver_bench/spread.py --only "2-D 8x8 tight" --collapsed

``--collapsed`` measures each case's problem with every tie group already one
node (``collapse_ties``, saved beside the problem) and writes
``spread_collapsed.json`` and ``.md`` instead: both solvers then skip the
collapse and score fewer nodes, the most that storing a repeated layer once in
the problem file could save them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import build, case_name, pick, run_case, summarise  # noqa: E402  (this folder's benchmark)

TARGET = 30.0  # issue 6: approx at least this many times faster than HiGHS
SOLVERS = ("ilp-highs", "approx")


def _cpu() -> str:
    """The cores' model name (VMs of one name differ in speed, and the ratio with them)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown cores"


class SolveFailed(Exception):
    """A solver gave no plan in a round, so that round has no ratio."""


def measure(path: Path, budget: str, rounds: int, time_limit: float) -> dict:
    """``rounds`` of ``run_case``: each round's median times and their ratio."""
    out = []
    for _ in range(rounds):
        raw = run_case(path, budget, SOLVERS, time_limit)
        failed = [n for n in SOLVERS if "objective" not in raw[n]]
        if failed:
            raise SolveFailed(f"{failed[0]} failed on {path.name}: {raw[failed[0]].get('error')}")
        highs, approx = raw["ilp-highs"], raw["approx"]
        out.append({
            "highs_s": highs["seconds"], "highs_runs": highs.get("seconds_runs", [highs["seconds"]]),
            "approx_s": approx["seconds"], "approx_runs": approx.get("seconds_runs", [approx["seconds"]]),
            "ratio": summarise(raw)["approx_speedup_over_highs"],
            "load_average": os.getloadavg()[0],
        })
    ratios = [r["ratio"] for r in out]
    return {
        "rounds": out,
        "ratio_min": min(ratios), "ratio_median": statistics.median(ratios), "ratio_max": max(ratios),
        "rounds_below_target": sum(r < TARGET for r in ratios),
    }


def collapsed_copy(path: Path) -> Path:
    """``path``'s problem with its tie groups collapsed, saved beside it (again
    whenever the problem is newer than the copy)."""
    out = path.with_name(path.stem + "-collapsed.npz")
    if not out.exists() or out.stat().st_mtime < path.stat().st_mtime:
        from torchtitan_autoparallel.planner.problem.problem import Problem
        from torchtitan_autoparallel.planner.solve.presolve.collapse import collapse_ties

        collapse_ties(Problem.load(path))[0].save(out)
    return out


def write_markdown(rows: list[dict], meta: dict, path: Path) -> None:
    title = "# approx's speed-up over HiGHS, round after round"
    if meta.get("collapsed"):
        title += ", on the tie-collapsed problems"
    lines = [
        title,
        "",
        f"Measured on {meta['host']} ({meta['cpu']}, {meta['cores']} cores), {meta['date']}. "
        f"Each round is one `run.py` measurement of the case (HiGHS, approx, HiGHS, ... in "
        f"fresh processes, three each; the ratio of their medians). Reproduce: `{meta['command']}`.",
        "",
        f"| case | rounds | speed-up min / median / max | rounds under {TARGET:g}x "
        "| HiGHS s (median) | approx ms (median) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        highs = statistics.median(x["highs_s"] for x in r["rounds"])
        approx = statistics.median(x["approx_s"] for x in r["rounds"])
        lines.append(
            f"| {r['case']} | {len(r['rounds'])} | {r['ratio_min']:.1f}x / {r['ratio_median']:.1f}x / "
            f"{r['ratio_max']:.1f}x | {r['rounds_below_target']} | {highs:.3f} | {1000 * approx:.2f} |"
        )
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="2-D", help="the cases whose name contains this text")
    parser.add_argument("--rounds", type=int, default=3, help="measurements per case")
    parser.add_argument("--time-limit", type=float, default=120.0, help="seconds per solve")
    parser.add_argument("--problems", default="/tmp/solver_bench_problems", help="where built problems are kept")
    parser.add_argument(
        "--collapsed", action="store_true",
        help="measure each problem with its tie groups collapsed; writes spread_collapsed.json/.md",
    )
    args = parser.parse_args()
    if args.rounds < 1:
        print(f"error: --rounds must be at least 1, got {args.rounds}", file=sys.stderr)
        return 2
    cases = pick(args.only)
    folder = Path(args.problems)
    folder.mkdir(parents=True, exist_ok=True)
    meta = {
        "host": platform.node(), "cpu": _cpu(), "cores": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": ".venv/bin/python experiments/solver_bench/spread.py "
        + " ".join(f"'{a}'" if " " in a else a for a in sys.argv[1:]),
        "collapsed": args.collapsed,
    }
    stem = "spread_collapsed" if args.collapsed else "spread"
    rows = []
    for model, mesh, budget in cases:
        name = case_name(model, mesh, budget)
        path, built = build(model, mesh, folder)
        if "error" in built:
            print(f"error: building {name} failed: {built['error']}", file=sys.stderr)
            return 1
        if args.collapsed:
            path = collapsed_copy(path)
        print(f"measuring {name} ({args.rounds} rounds) ...", flush=True)
        try:
            rows.append({"case": name, **measure(path, budget, args.rounds, args.time_limit)})
        except SolveFailed as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        # after every case, so that a failure later keeps the cases measured so far
        (HERE / f"{stem}.json").write_text(json.dumps({"meta": meta, "cases": rows}, indent=1))
        write_markdown(rows, meta, HERE / f"{stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
