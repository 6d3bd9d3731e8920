"""Lines of Python per folder of the package, before and after the layout in pipeline order (issue 73).

    .venv/bin/python experiments/layout/run.py [--before REV] [--after REV]

Counts every line of every tracked .py file under torchtitan_autoparallel/ at each
git revision (the working tree's HEAD by default for --after), grouped by folder:
the top-level package folders, and the planner's sub-folders one level down.
Writes results.json and results.md beside this file.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKAGE = "torchtitan_autoparallel"
BEFORE = "c95a05f^"  # the last commit before issue 73's changes


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True, cwd=HERE.parents[1]).stdout


def folder(path: str) -> str:
    parts = path.split("/")[1:-1]  # below the package, without the file name
    if not parts:
        return "(package root)"
    return "/".join(parts[:2]) if parts[0] == "planner" and len(parts) > 1 else parts[0]


def count(rev: str) -> dict[str, dict[str, int]]:
    lines: Counter[str] = Counter()
    files: Counter[str] = Counter()
    for path in git("ls-tree", "-r", "--name-only", rev, PACKAGE).split():
        if path.endswith(".py"):
            lines[folder(path)] += git("show", f"{rev}:{path}").count("\n")
            files[folder(path)] += 1
    return {name: {"files": files[name], "lines": lines[name]} for name in sorted(lines)}


def table(before: dict, after: dict, revs: tuple[str, str]) -> str:
    rows = ["| folder | files before | lines before | files after | lines after |", "| --- | ---: | ---: | ---: | ---: |"]
    for name in sorted(set(before) | set(after)):
        b, a = before.get(name, {"files": 0, "lines": 0}), after.get(name, {"files": 0, "lines": 0})
        rows.append(f"| {name} | {b['files']} | {b['lines']} | {a['files']} | {a['lines']} |")
    total = lambda d, k: sum(v[k] for v in d.values())  # noqa: E731
    rows.append(f"| **total** | {total(before, 'files')} | {total(before, 'lines')} | "
                f"{total(after, 'files')} | {total(after, 'lines')} |")
    return f"Lines of Python per folder, `{revs[0]}` (before) and `{revs[1]}` (after).\n\n" + "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default=BEFORE)
    ap.add_argument("--after", default="HEAD")
    args = ap.parse_args()
    revs = tuple(git("rev-parse", "--short", r).strip() for r in (args.before, args.after))
    before, after = count(args.before), count(args.after)
    (HERE / "results.json").write_text(json.dumps({"before": {"rev": revs[0], "folders": before},
                                                   "after": {"rev": revs[1], "folders": after}}, indent=1) + "\n")
    (HERE / "results.md").write_text(table(before, after, revs))
    print(table(before, after, revs))


if __name__ == "__main__":
    main()
