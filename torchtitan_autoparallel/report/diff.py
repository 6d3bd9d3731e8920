"""What changed between two plans: predictions, placements, collectives.

Placement changes that repeat over consecutive layers are shown once with a
layer range (``layers.0-5.attention.wq.weight``), as the plan table groups
layers; collectives are matched on (kind, mesh dim, purpose, bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan_autoparallel.planner.plan.plan import Plan
from torchtitan_autoparallel.report.common import (
    MS,
    TimeUnit,
    fmt_bytes,
    peak_activation_bytes,
    predicted_step_us,
    split_layer,
    time_unit,
)


@dataclass
class NumberDelta:
    label: str
    unit: str  # "us" or "bytes"
    before: float | None
    after: float | None

    def line(self, times: TimeUnit = MS) -> str:
        """Times in ``times`` (named in the block's header, not on the line), bytes with their unit."""
        fmt = times if self.unit == "us" else fmt_bytes
        before = "n/a" if self.before is None else fmt(self.before)
        after = "n/a" if self.after is None else fmt(self.after)
        head = f"  {self.label:<28} {before:>12} -> {after:>12}"
        if self.before is None or self.after is None:
            return head
        delta = self.after - self.before
        if delta == 0:
            return head + "   unchanged"
        pct = f" ({100 * delta / self.before:+.1f}%)" if self.before else ""
        return f"{head}   {'+' if delta > 0 else '-'}{fmt(abs(delta))}{pct}"


@dataclass
class PlacementChange:
    name: str  # a parameter FQN, its layer index possibly a range
    before: str
    after: str


@dataclass
class CollectiveChange:
    kind: str
    mesh_dim: str
    purpose: str
    bytes: float
    count_before: int
    count_after: int
    us_before: float  # time of one, 0 when absent
    us_after: float

    @property
    def totals_us(self) -> tuple[float, float]:
        return self.us_before * self.count_before, self.us_after * self.count_after

    def line(self, times: TimeUnit = MS) -> str:
        what = f"{self.kind} over {self.mesh_dim} ({self.purpose}) of {fmt_bytes(self.bytes)}"
        total_b, total_a = self.totals_us
        if self.count_before == 0:
            return f"  + {what}: {self.count_after} per step, {times(total_a)}"
        if self.count_after == 0:
            return f"  - {what}: {self.count_before} per step, {times(total_b)}"
        return f"  ~ {what}: {self.count_before} -> {self.count_after} per step, {times(total_b)} -> {times(total_a)}"


@dataclass
class PlanDiff:
    mesh: tuple[str, str]
    numbers: list[NumberDelta]
    placements: list[PlacementChange]
    only_before: list[str]  # parameters the second plan lacks
    only_after: list[str]
    collectives: list[CollectiveChange] = field(default_factory=list)

    @property
    def same_placements(self) -> bool:
        return not (self.placements or self.only_before or self.only_after)


def diff_plans(a: Plan, b: Plan) -> PlanDiff:
    return PlanDiff(
        mesh=(_mesh(a), _mesh(b)),
        numbers=_numbers(a, b),
        placements=_placement_changes(a, b),
        only_before=sorted(set(a.parameters) - set(b.parameters)),
        only_after=sorted(set(b.parameters) - set(a.parameters)),
        collectives=_collective_changes(a, b),
    )


def _mesh(plan: Plan) -> str:
    return " x ".join(f"{n}={s}" for n, s in zip(plan.mesh["names"], plan.mesh["sizes"]))


def _numbers(a: Plan, b: Plan) -> list[NumberDelta]:
    def get(plan: Plan, key: str) -> float:
        return plan.predicted.get(key, 0.0)

    return [
        NumberDelta("predicted step time", "us", predicted_step_us(a), predicted_step_us(b)),
        NumberDelta("compute", "us", get(a, "compute_us"), get(b, "compute_us")),
        NumberDelta("communication", "us", get(a, "comm_us"), get(b, "comm_us")),
        NumberDelta("saved by overlap", "us", get(a, "overlap_savings_us"), get(b, "overlap_savings_us")),
        NumberDelta("parameters per device", "bytes", get(a, "param_bytes_per_device"), get(b, "param_bytes_per_device")),
        NumberDelta("peak activations per device", "bytes", peak_activation_bytes(a), peak_activation_bytes(b)),
    ]


def _placement_changes(a: Plan, b: Plan) -> list[PlacementChange]:
    """Changed parameters; a change repeated over consecutive layers becomes one range."""
    runs: dict[tuple[str, str, str, str], list[int]] = {}
    keyed: list[tuple[tuple, PlacementChange]] = []
    order = {fqn: i for i, fqn in enumerate(a.parameters)}
    for fqn, before in a.parameters.items():
        after = b.parameters.get(fqn)
        if after is None or after == before:
            continue
        old, new = "".join(before), "".join(after)
        parts = split_layer(fqn)
        if parts is None:  # after the layers, as in the plan table
            keyed.append(((1, "", 0, order[fqn]), PlacementChange(fqn, old, new)))
        else:
            runs.setdefault((parts[0], parts[2], old, new), []).append(parts[1])
    for (prefix, rest, old, new), layers in runs.items():
        first_fqn = f"{prefix}.{layers[0]}.{rest}"
        for lo, hi in _ranges(sorted(layers)):
            index = str(lo) if lo == hi else f"{lo}-{hi}"
            change = PlacementChange(f"{prefix}.{index}.{rest}", old, new)
            keyed.append(((0, prefix, lo, order[first_fqn]), change))
    return [change for _, change in sorted(keyed, key=lambda kc: kc[0])]


def _ranges(xs: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for x in xs:
        if out and out[-1][1] == x - 1:
            out[-1] = (out[-1][0], x)
        else:
            out.append((x, x))
    return out


def _collective_changes(a: Plan, b: Plan) -> list[CollectiveChange]:
    def table(plan: Plan) -> dict[tuple, tuple[int, float]]:
        out: dict[tuple, tuple[int, float]] = {}
        for c in plan.collectives:
            key = (c.kind, c.mesh_dim, c.purpose, float(c.bytes))
            n, _ = out.get(key, (0, 0.0))
            out[key] = (n + c.count, c.us)
        return out

    ta, tb = table(a), table(b)
    changes = []
    for key in sorted(set(ta) | set(tb), key=lambda k: (k[0], k[1], k[2], -k[3])):
        (na, ua), (nb, ub) = ta.get(key, (0, 0.0)), tb.get(key, (0, 0.0))
        if na != nb or (na and abs(ua - ub) > 1e-9 * max(ua, ub, 1.0)):
            changes.append(CollectiveChange(*key, na, nb, ua, ub))
    return sorted(changes, key=lambda c: -abs(c.us_after * c.count_after - c.us_before * c.count_before))


def format_diff(d: PlanDiff, names: tuple[str, str] = ("A", "B")) -> str:
    lines = [f"plan diff: {names[0]} -> {names[1]}"]
    if d.mesh[0] != d.mesh[1]:
        lines.append(f"mesh: {d.mesh[0]} -> {d.mesh[1]}")
    else:
        lines.append(f"mesh: {d.mesh[0]} (unchanged)")
    timed = [v for n in d.numbers if n.unit == "us" for v in (n.before, n.after) if v is not None]
    unit = time_unit(timed)
    lines.append(f"predicted per step and device (times in {unit.name}):")
    lines += [n.line(unit) for n in d.numbers]
    lines.append(_placement_header(d))
    width = max((len(c.name) for c in d.placements), default=0)
    lines += [f"  {c.name:<{width}}  {c.before} -> {c.after}" for c in d.placements]
    lines += [f"  only in {names[0]}: {p}" for p in d.only_before]
    lines += [f"  only in {names[1]}: {p}" for p in d.only_after]
    unit = time_unit([t for c in d.collectives for t in c.totals_us])
    lines.append(f"collectives: {len(d.collectives)} changed (+ added, - removed, ~ count or time changed; "
                 f"times per step in {unit.name})")
    lines += [c.line(unit) for c in d.collectives]
    return "\n".join(lines)


def _placement_header(d: PlanDiff) -> str:
    if d.same_placements:
        return "parameter placements: unchanged"
    return f"parameter placements: {len(d.placements)} changed (placements per mesh dim, dim 0 first)"
