"""Where the approximate solver's time goes, stage by stage, on the benchmark's problems.

The main table (``run.py``) times whole solves in fresh processes. This
splits one ``approx`` solve into its stages, each timed alone in one warm
process (best of ``--repeats``), to show what a faster solve has to shrink:

* ``collapse``: repeated layers to one node each (``collapse.collapse``, as ``presolve``
  runs it: flat arrays);
* ``reduce``: the rest of the exact presolve (``presolve`` minus ``collapse``);
* ``mrf``: the reduced problem as compact arrays (``mrf.build_mrf``);
* ``search``: TRW-S, local search and the memory price search (``approx.search``);
* ``score``: the plan expanded to the original problem and scored on it.

It needs the problem files ``run.py`` builds (``--problems``). Writes
``stages.json`` and ``stages.md`` beside this file.

    .venv/bin/python experiments/solver_bench/stages.py              # the 2-D rows
    .venv/bin/python experiments/solver_bench/stages.py --only 3-D   # names containing "3-D"
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import LOOSE, case_name, pick  # noqa: E402  (this folder's benchmark)

from torchtitan_autoparallel.planner.problem.problem import Problem  # noqa: E402
from torchtitan_autoparallel.planner.solve.approx.mrf import build_mrf  # noqa: E402
from torchtitan_autoparallel.planner.solve.approx.solver import search  # noqa: E402
from torchtitan_autoparallel.planner.solve.approx.trws import GAP_RTOL  # noqa: E402
from torchtitan_autoparallel.planner.solve.presolve.collapse import collapse  # noqa: E402
from torchtitan_autoparallel.planner.solve.presolve.pipeline import presolve  # noqa: E402

STAGES = ("collapse", "reduce", "mrf", "search", "score")
SHARED = ("collapse", "reduce", "score")  # what the ILP solvers run too, around their solve


def _best(run, repeats: int) -> tuple[float, object]:
    """The fastest of ``repeats`` runs of ``run()`` (after one warm-up), and its result."""
    out = run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = run()
        best = min(best, time.perf_counter() - start)
    return best, out


def measure(problem: Problem, repeats: int) -> dict[str, float]:
    t = {}
    t["collapse"], _ = _best(lambda: collapse(problem), repeats)
    presolve_s, pre = _best(lambda: presolve(problem), repeats)
    t["reduce"] = max(presolve_s - t["collapse"], 0.0)
    t["mrf"], mrf = _best(lambda: build_mrf(pre.reduced), repeats)
    t["search"], outcome = _best(lambda: search(mrf, None, GAP_RTOL), repeats)

    def score() -> float:
        x = pre.expand(mrf.expand(outcome.labels))
        energy = problem.energy(x)
        assert problem.is_feasible(x, energy=energy)
        return energy

    t["score"], _ = _best(score, repeats)
    return {k: round(v, 6) for k, v in t.items()}


def write_markdown(rows: list[dict], path: Path) -> None:
    lines = [
        "# Where approx's time goes",
        "",
        f"Measured on {platform.node()} ({platform.machine()}), each stage timed alone in "
        f"one warm process, best of {rows[0]['repeats'] if rows else '-'} runs. Milliseconds. "
        "Reproduce: `.venv/bin/python experiments/solver_bench/stages.py` (after `run.py` "
        "has built the problems). The stages are listed in the script's docstring; `sum` "
        "is their total, a warm solve's time (a fresh process adds a few ms).",
        "",
        "| case | " + " | ".join(STAGES) + " | sum | shared | HiGHS / 30 | HiGHS / shared |",
        "| --- |" + " --- |" * (len(STAGES) + 4),
    ]
    for r in rows:
        cells = [f"{1000 * r['stages'][s]:.1f}" for s in STAGES]
        total = 1000 * sum(r["stages"].values())
        shared = 1000 * sum(r["stages"][s] for s in SHARED)
        target = r.get("highs_s")
        aim = f"{1000 * target / 30:.1f}" if target else "-"
        cap = f"{1000 * target / shared:.0f}x" if target else "-"
        lines.append(
            f"| {r['case']} | " + " | ".join(cells) + f" | {total:.1f} | {shared:.1f} | {aim} | {cap} |"
        )
    lines += [
        "",
        "`HiGHS / 30`: the time approx must reach for the 30x target, from the HiGHS "
        "cell of `results.json`. `shared`: collapse + reduce + score, the presolve and "
        "the final scoring that the HiGHS solve runs too (its cell includes them), so "
        "`HiGHS / shared` is the most any solver built on them could be faster than "
        "HiGHS, were its own search free.",
        "",
    ]
    path.write_text("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="2-D", help="the cases whose name contains this text")
    parser.add_argument("--problems", default="/tmp/solver_bench_problems", help="where run.py left its problems")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per stage (the best is kept)")
    args = parser.parse_args()
    if args.repeats < 1:
        print(f"error: --repeats must be at least 1, got {args.repeats}", file=sys.stderr)
        return 2
    cases = pick(args.only)
    bench = HERE / "results.json"
    highs = {}
    if bench.exists():
        highs = {r["case"]: r.get("solvers", {}).get("ilp-highs", {}).get("seconds")
                 for r in json.loads(bench.read_text())}
    rows = []
    for model, mesh, budget in cases:
        name = case_name(model, mesh, budget)
        path = Path(args.problems) / f"{model.label}-{mesh.label.replace(' ', '_')}.npz"
        if not path.exists():
            print(f"error: {path} is missing; build it with run.py --only {name!r}", file=sys.stderr)
            return 2
        problem = Problem.load(path)
        if budget == "loose":
            problem.memory_budget *= LOOSE
        stages = measure(problem, args.repeats)
        rows.append({"case": name, "repeats": args.repeats, "stages": stages, "highs_s": highs.get(name)})
        print(name, " ".join(f"{k}={1000 * v:.1f}ms" for k, v in stages.items()), flush=True)
    (HERE / "stages.json").write_text(json.dumps(rows, indent=1))
    write_markdown(rows, HERE / "stages.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
