"""``plan.html``: one self-contained page (inline CSS, the figure as a data URI, no scripts).

Every number shown carries its exact value in a ``data-*`` attribute, so a
test (or a script) can read the page back and compare it with plan.json.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

from torchtitan_autoparallel.planner.plan.plan import Collective, Plan
from torchtitan_autoparallel.report.common import (
    DEFAULT_WARN_GIB,
    GIB,
    SECONDS,
    Block,
    TimeUnit,
    fmt_bytes,
    group_blocks,
    large_buffers,
    memory_fit,
    peak_activation_bytes,
    placement_colors,
    predicted_step_us,
    time_unit,
)
from torchtitan_autoparallel.report.executed import ExecutedCollective, from_dicts
from torchtitan_autoparallel.report.figures import plan_png
from torchtitan_autoparallel.report.words import plan_words

_CSS = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-top: 1.6em; }
table { border-collapse: collapse; } td, th { border: 1px solid #bbb; padding: 3px 8px; }
th { background: #eee; text-align: left; } td.num { text-align: right; font-family: monospace; }
td.cell { font-family: monospace; font-size: 0.9em; }
.warning { background: #fde0dc; border-left: 5px solid #d62728; padding: 6px 10px; margin: 4px 0; }
.ok { background: #e0f2e0; border-left: 5px solid #2ca02c; padding: 6px 10px; }
.bar { display: flex; width: 600px; height: 18px; border: 1px solid #888; }
.bar div { height: 100%; } .muted { color: #666; font-size: 0.9em; }
"""


def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


def _num(key: str, value: float, shown: str) -> str:
    return f'<td class="num" data-key="{_e(key)}" data-value="{value!r}">{_e(shown)}</td>'


def render_html(plan: Plan, warn_bytes: float = DEFAULT_WARN_GIB * GIB, title: str = "plan") -> str:
    mesh = " x ".join(f"{n}={s}" for n, s in zip(plan.mesh["names"], plan.mesh["sizes"]))
    parts = [
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>',
        f"<style>{_CSS}</style></head><body>",
        f'<h1>Sharding plan on mesh <span id="mesh">{_e(mesh)}</span></h1>',
        _words_section(plan),
        f'<p class="muted">solver {_e(plan.solver)} ({_e(plan.status)}), objective {plan.objective / 1e3:.3f} ms, '
        f"lower bound {plan.lower_bound / 1e3:.3f} ms; placements list one entry per mesh dim, "
        f"{_e(', '.join(plan.mesh['names']))} in that order. S(d): sharded on tensor dim d, R: replicated, "
        "P: partial sums.</p>",
        _warnings_section(plan, warn_bytes),
        _cost_section(plan),
        _memory_section(plan),
        _placements_section(plan),
        _executed_section(plan),
        _collectives_section(plan),
        _figure_section(plan),
        _timings_section(plan),
        "</body></html>",
    ]
    return "\n".join(parts)


def write_html(plan: Plan, path: str | Path, warn_bytes: float = DEFAULT_WARN_GIB * GIB) -> Path:
    out = Path(path)
    out.write_text(render_html(plan, warn_bytes, title=f"plan: {out.parent.name or out.stem}"))
    return out


def _words_section(plan: Plan) -> str:
    sentences = "".join(f"<li>{_e(s)}</li>" for s in plan_words(plan))
    return f'<h2>What this plan is</h2><ul id="words">{sentences}</ul>'


def _warnings_section(plan: Plan, warn_bytes: float) -> str:
    found = large_buffers(plan, warn_bytes)
    rows = [f'<h2>Warnings</h2><div id="warnings" data-threshold-bytes="{float(warn_bytes)!r}">']
    fit = memory_fit(plan)
    if fit is not None and not fit.fits:
        rows.append(f'<div class="warning" id="memory-fit" data-bytes="{fit.total_bytes!r}">{_e(fit.message())}</div>')
    if not found:
        rows.append(f'<div class="ok">No collective materialises more than {_e(fmt_bytes(warn_bytes))} per device.</div>')
    for b in found:
        rows.append(
            f'<div class="warning" data-kind="{_e(b.kind)}" data-mesh-dim="{_e(b.mesh_dim)}" '
            f'data-bytes="{b.bytes!r}">{_e(b.message(warn_bytes))}</div>'
        )
    rows.append("</div>")
    return "\n".join(rows)


def _cost_section(plan: Plan) -> str:
    p = plan.predicted
    overlap = p.get("overlap_savings_us", 0.0)
    step = predicted_step_us(plan)
    rows = [
        ("compute_us", p["compute_us"], "compute"),
        ("comm_us", p["comm_us"], "communication"),
        ("overlap_savings_us", overlap, "saved by overlap"),
        ("total_us", p["total_us"], "compute + communication"),
        ("host_us", p.get("host_us", 0.0), "host time per graph node (calibrated profiles)"),
        ("optimizer_us", p.get("optimizer_us", 0.0), "clipping + AdamW (calibrated profiles)"),
        ("step_us", step, "predicted step time"),
    ]
    unit = time_unit(v for _, v, _ in rows)
    body = "".join(f"<tr><th>{_e(name)}</th>{_num(key, float(v), unit(v))}</tr>" for key, v, name in rows)
    total = max(p["total_us"], 1e-9)
    bar = (
        f'<div class="bar" title="compute vs communication"><div style="width:{100 * p["compute_us"] / total:.2f}%;'
        f'background:#1f77b4"></div><div style="width:{100 * p["comm_us"] / total:.2f}%;background:#ff7f0e"></div></div>'
        '<p class="muted">blue: compute, orange: communication</p>'
    )
    head = f"<tr><th>term</th><th>time ({unit.name})</th></tr>"
    return f'<h2>Predicted cost per step ({unit.name})</h2><table id="cost" data-unit="{unit.name}">{head}{body}</table>{bar}'


def _memory_section(plan: Plan) -> str:
    p = plan.predicted
    params = p["param_bytes_per_device"]
    rows = [f"<tr><th>parameters per device</th>{_num('param_bytes_per_device', params, fmt_bytes(params))}</tr>"]
    peak = peak_activation_bytes(plan)
    if peak is None:
        rows.append("<tr><th>peak activations per device</th><td>not in this plan.json (older planner)</td></tr>")
    else:
        rows.append(f"<tr><th>peak activations per device</th>{_num('peak_activation_bytes_per_device', peak, fmt_bytes(peak))}</tr>")
    if plan.memory_budget_bytes is not None:
        b = plan.memory_budget_bytes
        rows.append(f"<tr><th>parameter budget per device</th>{_num('memory_budget_bytes', float(b), fmt_bytes(b))}</tr>")
    fit = memory_fit(plan)
    if fit is not None:
        rows.append(f"<tr><th>parameters and AdamW state</th>{_num('state_bytes', fit.state_bytes, fmt_bytes(fit.state_bytes))}</tr>")
        rows.append(f"<tr><th>device memory</th>{_num('device_memory_bytes', fit.device_bytes, fmt_bytes(fit.device_bytes))}</tr>")
    note = (
        '<p class="muted">Peak activations: the most bytes of step-produced tensors (activations, temporaries, '
        "redistributed inputs, reduced gradients) live at once on one device, estimated from the traced graph; "
        "parameters and optimizer state are not included.</p>"
    )
    return f'<h2>Memory per device</h2><table id="memory">{"".join(rows)}</table>{note}{_peak_table(plan)}'


def _peak_table(plan: Plan) -> str:
    if not plan.peak_contents:
        return ""
    rows = "".join(
        f'<tr data-what="{_e(c["what"])}"><td>{_e(c["what"])}</td><td class="num">{c["count"]}</td>'
        f'<td class="num" data-bytes="{float(c["bytes"])!r}">{_e(fmt_bytes(c["bytes"]))}</td></tr>'
        for c in plan.peak_contents
    )
    return (
        f"<h3>Live at the peak (while <code>{_e(plan.peak_at)}</code> runs)</h3>"
        f'<table id="peak"><tr><th>tensors (op, dtype, global shape, placements)</th><th>count</th><th>bytes</th></tr>'
        f"{rows}</table>"
    )


def _placements_section(plan: Plan) -> str:
    colors = placement_colors(plan)
    rows = []
    for block in group_blocks(plan.parameters):
        rows.append(f'<tr data-block="{_e(block.name)}"><th>{_e(block.name)}</th>{_cells(block, colors)}</tr>')
    return (
        '<h2>Parameter placements</h2><p class="muted">Consecutive layers placed alike share a row.</p>'
        f'<table id="placements">{"".join(rows)}</table>'
    )


def _cells(block: Block, colors: dict[str, tuple[int, int, int]]) -> str:
    out = []
    for (short, cell), fqn in zip(block.cells, block.first_fqns):
        r, g, b = colors.get(cell, (255, 255, 255))
        out.append(
            f'<td class="cell" style="background:rgb({r},{g},{b})" data-param="{_e(fqn)}" '
            f'data-placement="{_e(cell)}">{_e(short)}<br>{_e(cell)}</td>'
        )
    return "".join(out)


def _collectives_section(plan: Plan) -> str:
    ordered: list[Collective] = sorted(plan.collectives, key=lambda c: -c.us * c.count)
    total = sum(c.us * c.count for c in ordered)
    unit = time_unit([total])  # the sum row is the table's largest time
    rows = [_collective_head(unit, "purpose")]
    for c in ordered:
        rows.append(
            f'<tr class="collective" data-kind="{_e(c.kind)}" data-mesh-dim="{_e(c.mesh_dim)}" '
            f'data-purpose="{_e(c.purpose)}" data-bytes="{float(c.bytes)!r}" data-us="{float(c.us)!r}" '
            f'data-count="{int(c.count)}"><td>{_e(c.kind)}</td><td>{_e(c.mesh_dim)}</td><td>{_e(c.purpose)}</td>'
            f"{_collective_cells(c.bytes, c.us, c.count, unit)}</tr>"
        )
    total_cell = _num("collectives_total_us", total, unit(total))
    rows.append(f'<tr><th colspan="6">sum (equals the predicted communication time)</th>{total_cell}</tr>')
    return (
        f"<h2>Collectives per step as planned, one per tensor ({len(ordered)} kinds; {unit.name})</h2>"
        '<p class="muted">What the plan prices, before the executor merges them into buckets. Bytes are the '
        "full buffer on one device (gathered or reduced), the local shard for all_to_all; heaviest first.</p>"
        f'<table id="collectives" data-unit="{unit.name}">{"".join(rows)}</table>'
    )


def _executed_section(plan: Plan) -> str:
    executed: list[ExecutedCollective] = from_dicts(plan.executed_collectives)
    if not executed:
        return (
            '<h2>Collectives per step as executed</h2><p class="muted" id="executed-none">Not listed: the '
            "executor merges the planned collectives into buckets when it compiles the step; a training run "
            "writes what it then issues into this report after its first step, a plan-only run traces the "
            "step on fake tensors for small models only (train/auto.py), and autoparallel.compile = false "
            "runs the planned collectives below one per tensor.</p>"
        )
    total = sum(c.us * c.count for c in executed)
    unit = time_unit([total])
    rows = [_collective_head(unit)]
    for c in executed:
        rows.append(
            f'<tr class="executed" data-kind="{_e(c.kind)}" data-mesh-dim="{_e(c.mesh_dim)}" '
            f'data-bytes="{float(c.bytes)!r}" data-us="{float(c.us)!r}" data-count="{int(c.count)}">'
            f"<td>{_e(c.kind)}</td><td>{_e(c.mesh_dim)}</td>{_collective_cells(c.bytes, c.us, c.count, unit)}</tr>"
        )
    calls = sum(c.count for c in executed)
    rows.append(f'<tr><th colspan="5">sum ({calls} calls)</th>{_num("executed_total_us", total, unit(total))}</tr>')
    return (
        f"<h2>Collectives per step as executed, after bucketing ({calls} calls; {unit.name})</h2>"
        '<p class="muted">Read from the compiled step graph the executor runs, priced by the same cost model; '
        "heaviest first.</p>"
        f'<table id="executed" data-unit="{unit.name}">{"".join(rows)}</table>'
    )


def _collective_head(unit: TimeUnit, *extra: str) -> str:
    named = "".join(f"<th>{_e(x)}</th>" for x in ("kind", "mesh dim", *extra))
    return f"<tr>{named}<th>bytes</th><th>time each ({unit.name})</th><th>count</th><th>total ({unit.name})</th></tr>"


def _collective_cells(nbytes: float, us: float, count: int, unit: TimeUnit) -> str:
    return (
        f'<td class="num">{_e(fmt_bytes(nbytes))}</td><td class="num">{unit(us)}</td>'
        f'<td class="num">{count}</td><td class="num">{unit(us * count)}</td>'
    )


def _figure_section(plan: Plan) -> str:
    data = base64.b64encode(plan_png(plan)).decode("ascii")
    alt = "placements per layer and the heaviest collectives"
    return f'<h2>Figure</h2><img id="figure" alt="{alt}" src="data:image/png;base64,{data}">'


def _timings_section(plan: Plan) -> str:
    rows = "".join(
        f"<tr><th>{_e(_TIMING_NAMES.get(k, k))}</th>{_num('timing_' + k, float(v), SECONDS(v * 1e6))}</tr>"
        for k, v in plan.timings.items()
    )
    head = "<tr><th>stage</th><th>time (s)</th></tr>"
    return f'<h2>Planner timings (s)</h2><table id="timings" data-unit="s">{head}{rows}</table>'


_TIMING_NAMES = {"compile": "compile (numba compiling or loading the planner's loops; apart from the stages)"}
