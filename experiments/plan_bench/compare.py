"""Before/after table of two plan_bench runs made in turn, case by case.

The "before" tree is a worktree of the commit before the change (``git worktree add
--detach /tmp/old <commit>``); each case ran there and then here, one after the other,
so a busy spell of the shared machine falls on both:

    for each case: (cd /tmp/old && PYTHONPATH=/tmp/old .venv/bin/python experiments/plan_bench/run.py --only CASE)
                   (cd .        && PYTHONPATH=.      .venv/bin/python experiments/plan_bench/run.py --only CASE)
    .venv/bin/python experiments/plan_bench/compare.py /tmp/old/experiments/plan_bench/results.json \\
        experiments/plan_bench/results.json > experiments/plan_bench/before_after.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(path: str) -> dict[str, dict]:
    return {r["case"]: r for r in json.loads(Path(path).read_text()) if "timings" in r}


def main(before_path: str, after_path: str) -> int:
    before, after = rows(before_path), rows(after_path)
    print("| case | objective us | same objective | total s before | total s after | after / before | load before / after |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for case, new in after.items():
        old = before.get(case)
        if old is None or old == new:  # a row neither run rewrote: not measured in turn
            continue
        same = "yes" if old["objective_us"] == new["objective_us"] else f"no ({old['objective_us']:.1f})"
        t_old, t_new = old["timings"]["total"], new["timings"]["total"]
        print(f"| {case} | {new['objective_us']:.1f} | {same} | {t_old:.1f} | {t_new:.1f} | {t_new / t_old:.2f} "
              f"| {old.get('load_before', float('nan')):.1f} / {new.get('load_before', float('nan')):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
