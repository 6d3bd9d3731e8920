"""Before/after table of two solver_bench runs made in turn, row by row.

The "before" tree is a worktree of the commit before the change (``git worktree add
--detach /tmp/old <commit>``); each row ran there and then here, one after the other,
so a busy spell of the shared machine falls on both:

    for each row: (cd /tmp/old && PYTHONPATH=/tmp/old .venv/bin/python experiments/solver_bench/run.py \\
                       --only ROW --solvers ilp-highs,approx --time-limit 120)
                  (cd .        && PYTHONPATH=.      .venv/bin/python experiments/solver_bench/run.py \\
                       --only ROW --solvers ilp-highs,approx,lp-bound --time-limit 120)
    .venv/bin/python experiments/solver_bench/compare.py /tmp/old/experiments/solver_bench/results.json \\
        experiments/solver_bench/results.json ROW... > experiments/solver_bench/before_after.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SOLVERS = ("ilp-highs", "approx")


def rows(path: str) -> dict[str, dict]:
    return {r["case"]: r for r in json.loads(Path(path).read_text()) if "solvers" in r}


def main(before_path: str, after_path: str, cases: list[str], solvers: tuple[str, ...] = SOLVERS) -> int:
    before, after = rows(before_path), rows(after_path)
    print("| case | solver | objective us | same objective | s before | s after | after / before |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for case in cases:
        for solver in solvers:
            old = before[case]["solvers"].get(solver, {})
            new = after[case]["solvers"].get(solver, {})
            if "objective" not in new or "objective" not in old:
                continue
            same = "yes" if old["objective"] == new["objective"] else f"no ({old['objective']:.3f})"
            print(f"| {case} | {solver} | {new['objective']:.3f} | {same} | {old['seconds']:.2f} "
                  f"| {new['seconds']:.2f} | {new['seconds'] / old['seconds']:.2f} |")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("cases", nargs="+")
    parser.add_argument("--solvers", default=",".join(SOLVERS), help="comma-separated, as in results.json")
    args = parser.parse_args()
    sys.exit(main(args.before, args.after, args.cases, tuple(args.solvers.split(","))))
