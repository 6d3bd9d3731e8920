"""The command line the benchmark scripts share: ``--only`` picks cases by name,
``--report-only`` rewrites a folder's README.md from its committed results.json;
and how a partial rerun keeps the other cases' rows, and a rewrite the README's notes.

A script under ``experiments/<name>/`` imports it after putting ``experiments/``
on ``sys.path``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def add_case_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", default="", help="run the cases whose name contains this text")
    parser.add_argument("--report-only", action="store_true", help="rewrite README.md from results.json")


def rewrite_report(folder: Path, write_markdown: Callable[[Any, Path], None]) -> int:
    """README.md again from results.json, with no case run; the exit status."""
    write_markdown(json.loads((folder / "results.json").read_text()), folder / "README.md")
    return 0


def pick_cases(cases: Sequence, only: str) -> list:
    """The cases whose ``name`` holds ``only``; if none, a one-line error and exit status 2."""
    chosen = [c for c in cases if only in c.name]
    if not chosen:
        print(f"error: no case matches {only!r}; cases: {[c.name for c in cases]}", file=sys.stderr)
        raise SystemExit(2)
    return chosen


def previous_rows(folder: Path) -> dict[str, dict]:
    """``results.json``'s rows by case name (none before the first run), so a rerun of
    some cases keeps the others'."""
    out = folder / "results.json"
    return {r["case"]: r for r in json.loads(out.read_text())} if out.exists() else {}


def save_rows(folder: Path, rows: list[dict], write_markdown: Callable[[Any, Path], None]) -> None:
    (folder / "results.json").write_text(json.dumps(rows, indent=1))
    write_markdown(rows, folder / "README.md")


NOTES_MARK = "<!-- notes: kept when the table is rewritten -->"


def kept_notes(readme: Path) -> str:
    """The hand-written notes below a README's table (from ``NOTES_MARK`` on, the mark
    included), so rewriting the table keeps them; the bare mark where there are none."""
    old = readme.read_text() if readme.exists() else ""
    at = old.find(NOTES_MARK)
    return old[at:] if at >= 0 else NOTES_MARK + "\n"
