"""``python -m torchtitan_autoparallel.report``: read and compare plans.

    python -m torchtitan_autoparallel.report html RUN/plan.json [-o OUT.html] [--warn-gib 1.0]
    python -m torchtitan_autoparallel.report diff A/plan.json B/plan.json
    python -m torchtitan_autoparallel.report text RUN/plan.json

``html`` writes the page a training run writes as ``plan.html`` (default:
beside the plan); ``diff`` prints what changed from plan A to plan B;
``text`` prints the plan as the trainer logs it (what it is in words, the
placements, the collectives as executed, the planner's timings). Bad
input ends in one ``error:`` line and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torchtitan_autoparallel.errors import UserError
from torchtitan_autoparallel.report.common import DEFAULT_WARN_GIB, GIB, load_plan, plan_warnings
from torchtitan_autoparallel.report.diff import diff_plans, format_diff
from torchtitan_autoparallel.report.html import write_html
from torchtitan_autoparallel.report.text import report_text


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's usage dump is not one line
        raise UserError(f"{message}; accepted: html PLAN [-o OUT] [--warn-gib G] | diff PLAN_A PLAN_B | text PLAN")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m torchtitan_autoparallel.report", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    html = sub.add_parser("html", help="write the HTML report of a plan.json")
    html.add_argument("plan")
    html.add_argument("-o", "--output", help="default: plan.html beside the plan")
    html.add_argument("--warn-gib", type=float, default=DEFAULT_WARN_GIB,
                      help="warn of collectives materialising more than this per device")
    diff = sub.add_parser("diff", help="print what changed between two plan.json files")
    diff.add_argument("before")
    diff.add_argument("after")
    text = sub.add_parser("text", help="print the plan in words and tables")
    text.add_argument("plan")
    return parser


def _html(args: argparse.Namespace) -> None:

    if not args.warn_gib > 0:
        raise UserError(f"--warn-gib {args.warn_gib}; accepted: a number of GiB > 0")
    plan = load_plan(args.plan)
    out = Path(args.output) if args.output else Path(args.plan).with_name("plan.html")
    threshold = args.warn_gib * GIB
    write_html(plan, out, threshold)
    for message in plan_warnings(plan, threshold):
        print(f"warning: {message}")
    print(f"wrote {out}")


def _diff(args: argparse.Namespace) -> None:

    before, after = load_plan(args.before), load_plan(args.after)
    print(format_diff(diff_plans(before, after), (args.before, args.after)))


def _text(args: argparse.Namespace) -> None:
    print(report_text(load_plan(args.plan)))


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
        {"html": _html, "diff": _diff, "text": _text}[args.command](args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
