"""The plan as text, for the console and ``python -m torchtitan_autoparallel.report text``.

What the plan is in words first, then the placements (``Plan.table``), the
collectives as executed when a training run has recorded them, and the
planner's timings; each table shows its times in one unit, named in its header.
"""

from __future__ import annotations

import textwrap

from torchtitan_autoparallel.planner.plan.plan import Plan
from torchtitan_autoparallel.report.common import SECONDS, fmt_bytes, time_unit
from torchtitan_autoparallel.report.executed import from_dicts
from torchtitan_autoparallel.report.words import plan_words

_WIDTH = 100


def words_text(plan: Plan) -> str:
    """The "what this plan is" paragraph, wrapped, one item per mesh dim and one for the reason."""
    items = [textwrap.fill(s, _WIDTH, initial_indent="  - ", subsequent_indent="    ",
                           break_on_hyphens=False) for s in plan_words(plan)]
    return "\n".join(["what this plan is:", *items])


def executed_text(plan: Plan) -> str:
    executed = from_dicts(plan.executed_collectives)
    if not executed:
        return ("collectives as executed: not listed (a training run records them once it compiles its step; "
                "a plan-only run traces them for small models only)")
    unit = time_unit([sum(c.us * c.count for c in executed)])  # the largest figure: their sum
    calls = sum(c.count for c in executed)
    lines = [f"collectives per step as executed, after bucketing ({calls} calls; times in {unit.name}):",
             f"  {'kind':<15}{'mesh dim':<14}{'bytes':>12}{'each':>10}{'count':>7}{'total':>10}"]
    for c in executed:
        lines.append(f"  {c.kind:<15}{c.mesh_dim:<14}{fmt_bytes(c.bytes):>12}{unit(c.us):>10}{c.count:>7}"
                     f"{unit(c.us * c.count):>10}")
    return "\n".join(lines)


def timings_text(plan: Plan) -> str:
    if not plan.timings:
        return "planner timings: none recorded"
    cells = ", ".join(f"{k} {SECONDS(v * 1e6)}" for k, v in plan.timings.items())
    return f"planner timings (s; compile is numba's, apart from the stages): {cells}"


def report_text(plan: Plan) -> str:
    return "\n".join([words_text(plan), plan.table(), executed_text(plan), timings_text(plan)])
