"""The solved plan: placements, implied collectives, predictions; JSON and a table.

A ``Plan`` is what the rest of the system reads (the executor, the launcher's
start-up print, the cache). It is built from the solver's assignment and the
problem's bookkeeping, and its figures are recomputed from the same cost
tables the solver saw.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import fx

from torchtitan_autoparallel.planner.cost.cost_model import collective_time_us, mesh_dim_links, redistribute_steps
from torchtitan_autoparallel.planner.plan.buckets import runs_on_gloo
from torchtitan_autoparallel.planner.plan.memory import predicted_peak, whole_peak
from torchtitan_autoparallel.planner.problem.build import GRAD_EDGE, BuiltProblem, EdgeInfo
from torchtitan_autoparallel.planner.solve.base import Solution
from torchtitan_autoparallel.planner.strategies.placement import label, placement_str
from torchtitan_autoparallel.planner.strategies.rules import VIEW_OPS
from torchtitan_autoparallel.planner.trace.trace import TracedStep


@dataclass
class Collective:
    """Collectives of one kind, mesh dim, size and purpose, and how many run per step."""

    kind: str  # all_gather | reduce_scatter | all_reduce | all_to_all
    mesh_dim: str
    bytes: float  # per collective, as the cost model counts them
    us: float  # predicted time of one
    count: int
    purpose: str  # "parameter" (weight gather), "gradient", "activation"


@dataclass
class Plan:
    mesh: dict[str, list]  # {"names": [...], "sizes": [...]}
    parameters: dict[str, list[str]]  # FQN -> one placement label per mesh dim
    nodes: dict[str, str]  # graph node -> output placements
    collectives: list[Collective]
    predicted: dict[str, float]  # compute_us, comm_us, total_us, param_bytes_per_device, peak_bytes_per_device, ...
    replicated_ops: list[str]
    objective: float
    lower_bound: float
    solver: str
    status: str
    timings: dict[str, float] = field(default_factory=dict)
    memory_budget_bytes: float | None = None
    # One device's memory, that the plan is checked against (report/common.py, ``memory_fit``):
    # the GPU's own, or for a dry run the cost profile's; None where not known (CPU ranks).
    device_memory_bytes: float | None = None
    peak_rss_gib: dict[str, float] = field(default_factory=dict)  # planner's memory high-water mark after each stage
    # What is live at the predicted activation peak (planner/plan/memory.py ``PeakPart``s as
    # dicts: what, count, bytes; largest first), and the graph node running then.
    peak_contents: list[dict[str, Any]] = field(default_factory=list)
    peak_at: str = ""
    # ``predicted["peak_bytes_per_device"]`` by kind (``memory.whole_peak``): parameters,
    # optimizer_state, gradients, activations, weight_copies, redistribution_buffers,
    # collective_buffers
    peak_parts: dict[str, float] = field(default_factory=dict)
    # The collectives the executor will merge (planner/plan/buckets.py), in issue order: kind,
    # bytes (full size: gathered output, unreduced input), packed_bytes (the shards' side)
    peak_buckets: list[dict[str, Any]] = field(default_factory=list)
    # Each problem node's chosen strategy, by index, in the order of the problem the
    # planner solved (``--autoparallel.export_problem`` writes it; docs/problem_format.md):
    # what re-scores the plan independently of this package.
    assignment: list[int] = field(default_factory=list)
    # The collectives the compiled step issues once bucketed, by kind, mesh dim and size
    # (``report/executed.py`` records as dicts): written by a training run once it compiles
    # its step, or by a plan-only run from the step traced on fake tensors; else empty.
    executed_collectives: list[dict[str, Any]] = field(default_factory=list)
    # The recomputation the step was traced with (activation_checkpoint.mode, or what
    # "auto" chose: a mode, or runs of blocks, "full 0-1, none 2-5"). For "auto":
    # "tried", each trace planned ({"traced", "peak_bytes", "objective_us"}), and where
    # the solve chose recomputation, from the first such solve: "recompute_us" (the step
    # time it priced), "recompute_freed_bytes" (what it frees where the plan without it
    # peaked), and that plan's "unbounded_peak_bytes" and "unbounded_objective"
    activation_checkpoint: str = "none"
    recompute_choice: dict[str, Any] = field(default_factory=dict)
    block_recompute: list[str] = field(default_factory=list)  # each block's mode, when they differ
    # When the cheapest plan overflowed the device and was solved again under memory rows:
    # ``Solution.memory_fit`` (usable and reached peaks, the unbounded plan's peak and cost)
    memory_fit: dict[str, float] = field(default_factory=dict)

    # ------------------------------------------------------------ accessors

    @property
    def compute_us(self) -> float:
        return self.predicted["compute_us"]

    @property
    def comm_us(self) -> float:
        return self.predicted["comm_us"]

    @property
    def param_bytes_per_device(self) -> float:
        return self.predicted["param_bytes_per_device"]

    def collective_kinds(self, purpose: str | None = None) -> set[str]:
        return {c.kind for c in self.collectives if purpose is None or c.purpose == purpose}

    # ------------------------------------------------------------ output

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1, default=_jsonable))

    @classmethod
    def from_json(cls, path: str | Path) -> Plan:
        data = json.loads(Path(path).read_text())
        data["collectives"] = [Collective(**c) for c in data["collectives"]]
        return cls(**data)

    def table(self) -> str:
        """One row per distinct block: layers whose parameters are placed alike share a row."""
        return format_table(self)


def plan_from_solution(
    solution: Solution,
    built: BuiltProblem,
    traced: TracedStep,
    timings: dict[str, float] | None = None,
) -> Plan:
    problem = built.problem
    x = np.asarray(solution.assignment, dtype=np.int64)
    mesh = built.table.mesh
    chosen = {n: built.strategies(n)[int(x[i])] for i, n in enumerate(built.nodes)}
    params = {fqn: [placement_str(p) for p in chosen[node].outputs[0]] for fqn, node in traced.params.items()}
    nodes = {n.name: ",".join(label(p) if p else "-" for p in s.outputs) for n, s in chosen.items()}
    peak = predicted_peak(traced, chosen, built.edge_parts, mesh.sizes, gloo=runs_on_gloo(built.profile.name))
    compute = float(sum(problem.unary[v][x[v]] for v in range(problem.num_nodes)))
    comm = float(sum(t[x[u], x[v]] for t, (u, v) in zip(problem.pairwise, problem.edges)))
    param_bytes = float(problem.memory_used(x))
    parts = whole_peak(peak, param_bytes)
    predicted = {
        "compute_us": compute,
        "comm_us": comm,
        "total_us": compute + comm,
        "param_bytes_per_device": param_bytes,
        # Estimates from live tensor sizes; planner/plan/memory.py says what they count.
        "peak_bytes_per_device": sum(parts.values()),  # the whole step's, parts in ``peak_parts``
        "peak_activation_bytes_per_device": peak.bytes,  # the step's own tensors, of the peak above
        "peak_weight_copy_bytes_per_device": peak.weight_copy_bytes,  # of the line above
    }
    return Plan(
        mesh={"names": list(mesh.names), "sizes": list(mesh.sizes)},
        parameters=params,
        nodes=nodes,
        collectives=_collectives(built, chosen, traced),
        predicted=predicted,
        replicated_ops=list(built.table.replicated_ops),
        objective=float(solution.objective),
        lower_bound=float(solution.lower_bound),
        solver=solution.solver,
        status=solution.status,
        timings=dict(timings or {}),
        memory_budget_bytes=problem.memory_budget,
        peak_contents=[asdict(part) for part in peak.parts],
        peak_at=peak.at,
        peak_parts=parts,
        peak_buckets=[{"kind": k, "bytes": b, "packed_bytes": p} for k, b, p in peak.buckets],
        assignment=x.tolist(),
        activation_checkpoint=traced.activation_checkpoint,
        block_recompute=list(traced.block_recompute),
        memory_fit=dict(solution.memory_fit),
    )


def _collectives(built: BuiltProblem, chosen: dict[fx.Node, Any], traced: TracedStep) -> list[Collective]:
    mesh = built.table.mesh
    links = mesh_dim_links(mesh.sizes, built.profile)
    tail = _gradient_tail(traced)
    params = set(traced.params.values())
    counts: dict[tuple, int] = defaultdict(int)
    for parts in built.edge_parts:
        for part in parts:
            src = chosen[part.producer].outputs[part.output_index]
            s_cons = chosen[part.consumer]
            dst = s_cons.outputs[0] if part.arg_index == GRAD_EDGE else s_cons.inputs[part.arg_index]
            if src == dst:
                continue
            purpose = _purpose(part, tail, params)
            for step in redistribute_steps(part.shape, part.dtype.itemsize, src, dst, mesh.sizes, built.profile):
                us = collective_time_us(step.kind, step.bytes, step.group_size, links[step.mesh_dim])
                counts[(step.kind, mesh.names[step.mesh_dim], float(step.bytes), us, purpose)] += 1
    return [
        Collective(kind, dim, nbytes, us, n, purpose)
        for (kind, dim, nbytes, us, purpose), n in sorted(counts.items(), key=lambda kv: (kv[0][4], kv[0][0], -kv[0][2]))
    ]


def _purpose(part: EdgeInfo, tail: set[fx.Node], params: set[fx.Node]) -> str:
    if part.arg_index == GRAD_EDGE or part.consumer in tail:
        return "gradient"
    src = part.producer
    # A view or a cast of the master weight (mixed precision) is still the weight.
    while src.op == "call_function" and (src.target in VIEW_OPS or src.target is torch.ops.aten._to_copy.default):
        src = src.args[0]
    return "parameter" if src in params else "activation"


def _gradient_tail(traced: TracedStep) -> set[fx.Node]:
    """Nodes whose only purpose is to finish a parameter gradient.

    A gradient is often reduced a few ops before the graph output (on the mm
    that computes it, before a transpose), so "reduces a gradient" means the
    consumer feeds nothing but gradient outputs.
    """
    grads = set(traced.grads.values())
    forward = _ancestors(traced.loss)
    tail: set[fx.Node] = set()
    for node in reversed(list(traced.graph.graph.nodes)):
        users = [u for u in node.users if u.op != "output"]
        if node in forward or node.op == "placeholder":
            continue
        if node in grads or (users and all(u in tail for u in users)):
            tail.add(node)
    return tail


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


# ---------------------------------------------------------------- table

_LAYER = re.compile(r"^(.*?layers)\.(\d+)\.(.+)$")


def _short(rest: str) -> str:
    """'attention.qkv_linear.wqkv.weight' -> 'wqkv'; a bias keeps its suffix."""
    parts = rest.split(".")
    if parts[-1] == "weight" and len(parts) > 1:
        return parts[-2]
    return ".".join(parts[-2:])


def format_table(plan: Plan) -> str:
    blocks: list[tuple[str, list[tuple[str, str]]]] = []
    layers: dict[tuple[str, int], list[tuple[str, str]]] = defaultdict(list)
    others: list[tuple[str, str]] = []
    for fqn, ps in plan.parameters.items():
        m = _LAYER.match(fqn)
        cell = "".join(ps)
        if m:
            layers[(m.group(1), int(m.group(2)))].append((_short(m.group(3)), cell))
        else:
            others.append((fqn.removesuffix(".weight"), cell))
    # Merge runs of consecutive layers whose parameters are placed identically.
    run_start = run_prev = None
    run_sig: list | None = None
    for (prefix, i) in sorted(layers):
        sig = layers[(prefix, i)]
        if run_sig == sig and run_prev is not None and run_prev[0] == prefix and run_prev[1] == i - 1:
            run_prev = (prefix, i)
            continue
        if run_sig is not None:
            blocks.append((_range(run_start, run_prev), run_sig))
        run_start = run_prev = (prefix, i)
        run_sig = sig
    if run_sig is not None:
        blocks.append((_range(run_start, run_prev), run_sig))
    if others:
        blocks.append(("(not in a layer)", others))
    mesh = " x ".join(f"{n}={s}" for n, s in zip(plan.mesh["names"], plan.mesh["sizes"]))
    width = max((len(b) for b, _ in blocks), default=10)
    lines = [
        f"sharding plan on mesh {mesh} (placements per mesh dim, in mesh-dim order)",
        f"  objective {plan.objective:.1f} us (bound {plan.lower_bound:.1f}, {plan.solver}, {plan.status}); "
        f"compute {plan.compute_us:.1f} us, comm {plan.comm_us:.1f} us, "
        f"params {plan.param_bytes_per_device / 2**20:.2f} MiB/device",
    ]
    if "overlap_savings_us" in plan.predicted:  # only plans solved with overlap on
        lines[-1] += (
            f"; overlap saves {plan.predicted['overlap_savings_us']:.1f} us of the "
            f"{plan.predicted['total_us']:.1f} us sum, effective {plan.predicted['effective_us']:.1f} us"
        )
    for name, cells in blocks:
        lines.append(f"  {name:<{width}} | " + " | ".join(f"{p} {c}" for p, c in cells))
    if plan.replicated_ops:
        lines.append(f"  replicated for lack of a rule: {', '.join(plan.replicated_ops)}")
    return "\n".join(lines)


def _range(start: tuple[str, int], end: tuple[str, int]) -> str:
    return f"{start[0]}.{start[1]}" if start == end else f"{start[0]}.{start[1]}-{end[1]}"


def _jsonable(x: Any) -> Any:
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, float) and not np.isfinite(x):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")

