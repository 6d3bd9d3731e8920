"""Strategies + cost model -> the ``Problem`` arrays every solver reads.

* nodes: every tensor-carrying node of the traced step;
* unary[v][s]: compute time of node v under strategy s (roofline on local shards);
* edges: producer -> consumer for every tensor argument, plus one edge from
  each parameter's gradient to the parameter, priced as moving the gradient
  into the parameter's placement (this is where DDP's all-reduce and FSDP's
  reduce-scatter enter the objective);
* pairwise[e][s, t]: redistribution time from the producer's output placement
  under s to the placement the consumer requires under t;
* memory[v][s]: per-device bytes of parameter v under s; the budget defaults to
  the smallest achievable, which is what makes ``dp_shard`` mean FSDP.

Tables are built once per distinct question (shape, dtype, placements) and
gathered with numpy fancy indexing, so repeated layers cost lookups only; edges
that ask the same question share one read-only table (``share_tables``), so a
70B model's problem holds a few hundred tables, not tens of thousands.
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import fx

from torchtitan_autoparallel.planner.cost.cost_model import compute_time_us
from torchtitan_autoparallel.planner.cost.pricer import redistribute_cost_matrix
from torchtitan_autoparallel.planner.cost.profiles import HardwareProfile
from torchtitan_autoparallel.planner.problem.problem import InfeasibleProblem, Problem, share_tables
from torchtitan_autoparallel.planner.strategies.placement import MeshSpec, Placements, is_shard, label, local_shape
from torchtitan_autoparallel.planner.strategies.rules import VIEW_OPS
from torchtitan_autoparallel.planner.strategies.strategy import NodeStrategies, Strategy, StrategyTable, signature
from torchtitan_autoparallel.planner.trace.trace import TracedStep

log = logging.getLogger("torchtitan_autoparallel.planner")

aten = torch.ops.aten
GIB = 1024**3
GRAD_EDGE = -1  # EdgeInfo.arg_index of a gradient -> parameter edge


@dataclass(frozen=True)
class EdgeInfo:
    """One tensor flowing along a problem edge (several may share one edge)."""

    producer: fx.Node
    output_index: int
    consumer: fx.Node
    arg_index: int  # position among the consumer's tensor args, or GRAD_EDGE
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class BuiltProblem:
    problem: Problem
    nodes: list[fx.Node]  # problem node index -> graph node
    table: StrategyTable
    edge_parts: list[list[EdgeInfo]]  # problem edge index -> tensors it carries
    min_param_bytes: float
    profile: HardwareProfile
    _index: dict[fx.Node, int] = field(default_factory=dict)

    def index(self, node: fx.Node) -> int:
        return self._index[node]

    def __contains__(self, node: fx.Node) -> bool:
        """Whether ``node`` is a problem node (ops without strategies are not)."""
        return node in self._index

    def strategies(self, node: fx.Node) -> list[Strategy]:
        return self.table.nodes[node].strategies


def build_problem(
    traced: TracedStep,
    table: StrategyTable,
    profile: HardwareProfile,
    memory_budget_gib: float | None = None,
    ties: list[list[fx.Node]] | None = None,
) -> BuiltProblem:
    nodes = list(table.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    mesh = table.mesh
    seen: dict[tuple, np.ndarray] = {}
    unary = [_unary(table.nodes[n], mesh, profile, seen) for n in nodes]
    parts = _edge_parts(traced, table)
    edges, pairwise, edge_parts = _pairwise(parts, table, index, mesh, profile, traced)
    memory, min_bytes = _memory(traced, table, index, mesh)
    budget = _budget(min_bytes, memory_budget_gib)
    pins = {index[n]: 0 for n, ns in table.nodes.items() if ns.source == "input"}
    problem = Problem(
        node_names=[n.name for n in nodes],
        strategy_labels=_strategy_labels(table, nodes),
        unary=unary,
        edges=np.array(edges, dtype=np.int64).reshape(-1, 2),
        pairwise=share_tables(pairwise),
        memory=memory,
        memory_budget=budget,
        pins=pins,
        ties=[[index[n] for n in group] for group in ties or []],
    )
    log.info(
        "build: %d nodes, %d edges, %d strategies, %d pairwise entries, %d tie groups, "
        "budget %.3f GiB (min %.3f GiB)",
        problem.num_nodes,
        len(edges),
        int(problem.num_strategies.sum()),
        sum(t.size for t in pairwise),
        len(problem.ties),
        budget / GIB,
        min_bytes / GIB,
    )
    return BuiltProblem(problem, nodes, table, edge_parts, min_bytes, profile, index)


# ---------------------------------------------------------------- compute cost

_unary_memo: dict = {}


def clear_caches() -> None:
    """Forget memoised cost tables (they are keyed by shape, placements and profile)."""
    _unary_memo.clear()
    _matrix_memo.clear()


def _unary(
    ns: NodeStrategies, mesh: MeshSpec, profile: HardwareProfile, seen: dict[tuple, np.ndarray]
) -> np.ndarray:
    """Compute times of ``ns``'s strategies. ``seen``: this build's vectors by the ids
    of the Strategy objects (repeated layers share them; all alive for the build),
    which spares hashing their torch placements by value for every layer."""
    node = ns.node
    if node.op != "call_function" or node.target is operator.getitem or node.target in VIEW_OPS:
        return np.zeros(len(ns.strategies))
    shapes = _shapes(node)
    by_id = (node.target, shapes, tuple(map(id, ns.strategies)))
    vector = seen.get(by_id)
    if vector is None:
        key = (node.target, shapes, tuple(ns.strategies), mesh, profile)
        if key not in _unary_memo:
            _unary_memo[key] = np.array([strategy_time_us(node, s, mesh, profile) for s in ns.strategies])
        vector = seen[by_id] = _unary_memo[key]
    return vector


def strategy_time_us(node: fx.Node, s: Strategy, mesh: MeshSpec, profile: HardwareProfile) -> float:
    """Roofline time of the local kernel: FLOPs on local shards, bytes read + written."""
    in_vals = _tensor_vals(node)
    out_vals = _flat_tensors(node.meta["val"])
    ins = [local_shape(v.shape, p, mesh.sizes) if p else tuple(v.shape) for v, p in zip(in_vals, s.inputs)]
    outs = [local_shape(v.shape, p, mesh.sizes) if p else tuple(v.shape) for v, p in zip(out_vals, s.outputs)]
    moved = sum(math.prod(sh) * v.dtype.itemsize for sh, v in zip(ins, in_vals))
    moved += sum(math.prod(sh) * v.dtype.itemsize for sh, v in zip(outs, out_vals) if v is not None)
    dtype = out_vals[0].dtype if out_vals and out_vals[0] is not None else torch.float32
    return compute_time_us(_flops(node, ins), float(moved), dtype, profile)


def _flops(node: fx.Node, ins: list[tuple[int, ...]]) -> float:
    op = node.target
    if op in (aten.mm.default, aten._scaled_mm.default):
        (m, k), (_, n) = ins[0], ins[1]
        return 2.0 * m * k * n
    if op is aten.addmm.default:
        (m, k), (_, n) = ins[1], ins[2]
        return 2.0 * m * k * n
    if op in (aten.bmm.default, aten.baddbmm.default):
        a, b = (ins[1], ins[2]) if op is aten.baddbmm.default else (ins[0], ins[1])
        return 2.0 * a[0] * a[1] * a[2] * b[2]
    if "scaled_dot_product" in str(op):
        backward = "backward" in str(op)
        q, k = (ins[1], ins[2]) if backward else (ins[0], ins[1])
        b, h, lq, d = q
        causal = 0.5 if _is_causal(node) else 1.0
        fwd = 4.0 * b * h * lq * k[2] * d * causal
        # The backward recomputes the scores and runs four more matmuls.
        return 2.5 * fwd if backward else fwd
    return 0.0


def _is_causal(node: fx.Node) -> bool:
    if "is_causal" in node.kwargs:
        return bool(node.kwargs["is_causal"])
    schema = node.target._schema  # type: ignore[union-attr]
    for i, arg in enumerate(schema.arguments):
        if arg.name == "is_causal" and i < len(node.args):
            return bool(node.args[i])
    return False


# ---------------------------------------------------------------- edges


def _edge_parts(traced: TracedStep, table: StrategyTable) -> list[EdgeInfo]:
    parts: list[EdgeInfo] = []
    for node, ns in table.nodes.items():
        for j, (producer, idx) in enumerate(ns.args):
            val = _flat_tensors(producer.meta["val"])[idx] if node.target is operator.getitem else producer.meta["val"]
            parts.append(EdgeInfo(producer, idx, node, j, tuple(val.shape), val.dtype))
    for fqn, grad in traced.grads.items():
        param = traced.params[fqn]
        val = grad.meta["val"]
        parts.append(EdgeInfo(grad, 0, param, GRAD_EDGE, tuple(val.shape), val.dtype))
    return parts


_matrix_memo: dict = {}


def _pairwise(
    parts: list[EdgeInfo],
    table: StrategyTable,
    index: dict[fx.Node, int],
    mesh: MeshSpec,
    profile: HardwareProfile,
    traced: TracedStep,
) -> tuple[list[tuple[int, int]], list[np.ndarray], list[list[EdgeInfo]]]:
    """One table per (producer, consumer) pair; tensors sharing a pair add up."""
    low_tail = _low_precision_gradient_tail(traced) if traced.reduce_dtype != traced.param_dtype else set()
    casts = set(traced.grad_casts.values())
    by_pair: dict[tuple[int, int], int] = {}
    edges: list[tuple[int, int]] = []
    tables: list[np.ndarray] = []
    edge_parts: list[list[EdgeInfo]] = []
    gathered: dict[tuple, np.ndarray] = {}  # one table object per question asked
    for part in parts:
        srcs = [s.outputs[part.output_index] for s in table.nodes[part.producer].strategies]
        if part.arg_index == GRAD_EDGE:
            dsts = [t.outputs[0] for t in table.nodes[part.consumer].strategies]
        else:
            dsts = [t.inputs[part.arg_index] for t in table.nodes[part.consumer].strategies]
        cost = _cost_table(part.shape, part.dtype, srcs, dsts, mesh, profile, gathered)
        if part.producer in low_tail and (part.consumer in low_tail or part.consumer in casts):
            cost = np.where(_reduces_early(srcs, dsts), np.inf, cost)
        pair = (index[part.producer], index[part.consumer])
        if pair in by_pair:
            e = by_pair[pair]
            tables[e] = tables[e] + cost
            edge_parts[e].append(part)
        else:
            by_pair[pair] = len(edges)
            edges.append(pair)
            tables.append(cost)
            edge_parts.append([part])
    return edges, tables, edge_parts


def _cost_table(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    srcs: list[Placements],
    dsts: list[Placements],
    mesh: MeshSpec,
    profile: HardwareProfile,
    gathered: dict[tuple, np.ndarray],
) -> np.ndarray:
    """redistribute_cost_matrix on the distinct placements, expanded by fancy indexing
    (once per question: ``gathered`` keeps the expanded tables of this build).

    Repeated layers ask with the same placement objects (the enumeration's memo),
    so the question is first looked up by their ids (all alive for the build):
    hashing torch placements by value took most of the build on deep models."""
    by_id = (shape, dtype, tuple(map(id, srcs)), tuple(map(id, dsts)))
    table = gathered.get(by_id)
    if table is not None:
        return table
    usrc, src_idx = _uniques(srcs)
    udst, dst_idx = _uniques(dsts)
    key = (shape, dtype, usrc, udst, mesh.sizes, profile)
    full_key = (key, src_idx.tobytes(), dst_idx.tobytes())
    table = gathered.get(full_key)
    if table is None:
        small = _matrix_memo.get(key)
        if small is None:
            small = redistribute_cost_matrix(shape, dtype.itemsize, list(usrc), list(udst), mesh.sizes, profile)
            _matrix_memo[key] = small
        table = gathered[full_key] = small[np.ix_(src_idx, dst_idx)]
    gathered[by_id] = table
    return table


def _uniques(items: list[Placements]) -> tuple[tuple[Placements, ...], np.ndarray]:
    order: dict[Placements, int] = {}
    by_id: dict[int, int] = {}  # each object hashed by value once
    idx = np.empty(len(items), dtype=np.int64)
    for i, p in enumerate(items):
        j = by_id.get(id(p))
        if j is None:
            j = by_id[id(p)] = order.setdefault(p, len(order))
        idx[i] = j
    return tuple(order), idx


def _low_precision_gradient_tail(traced: TracedStep) -> set[fx.Node]:
    """Backward nodes whose only use is a gradient's cast up to the reduce dtype.

    With fp32 reduction of bf16 gradients, no edge inside this tail (nor into
    the cast) may reduce a Partial: the reduction must wait for the cast, so
    it runs in fp32. Activation gradients entering the tail are not affected.
    """
    casts = set(traced.grad_casts.values())
    tail: set[fx.Node] = set()
    for node in reversed(list(traced.graph.graph.nodes)):
        if node.op != "call_function" or node in casts:
            continue
        users = list(node.users)
        if users and all(u in casts or u in tail for u in users):
            tail.add(node)
    return tail


def _reduces_early(srcs: list[Placements], dsts: list[Placements]) -> np.ndarray:
    """[s, t] True where a Partial source would be reduced before the cast up.

    With fp32 reduction of bf16 gradients the cast must see the unreduced
    (Partial) gradient, so the reduce-scatter/all-reduce runs in fp32 after it.
    """
    from torch.distributed.tensor.placement_types import Partial

    def partial_dims(p: Placements) -> frozenset[int]:
        return frozenset(i for i, x in enumerate(p) if isinstance(x, Partial))

    src_p = [partial_dims(p) for p in srcs]
    dst_p = [partial_dims(p) for p in dsts]
    return np.array([[not a <= b for b in dst_p] for a in src_p], dtype=bool).reshape(len(srcs), len(dsts))


# ---------------------------------------------------------------- memory


def _memory(
    traced: TracedStep, table: StrategyTable, index: dict[fx.Node, int], mesh: MeshSpec
) -> tuple[list[np.ndarray | None], float]:
    memory: list[np.ndarray | None] = [None] * len(index)
    smallest = 0.0
    for node in traced.params.values():
        val = node.meta["val"]
        full = float(val.numel() * val.dtype.itemsize)
        per = np.array([full / _pieces(s.outputs[0], mesh) for s in table.nodes[node].strategies])
        memory[index[node]] = per
        smallest += float(per.min())
    return memory, smallest


def _pieces(p: Placements, mesh: MeshSpec) -> int:
    return math.prod(n for x, n in zip(p, mesh.sizes) if is_shard(x))


def _budget(min_bytes: float, budget_gib: float | None) -> float:
    if budget_gib is None:
        return min_bytes
    budget = budget_gib * GIB
    if budget < min_bytes * (1 - 1e-9):
        raise InfeasibleProblem(
            f"memory budget {budget_gib:.4g} GiB of parameters per device is infeasible; "
            f"the smallest feasible budget is {min_bytes / GIB:.4g} GiB"
        )
    return budget


# ---------------------------------------------------------------- helpers


def _strategy_labels(table: StrategyTable, nodes: list[fx.Node]) -> list[list[str]]:
    """Each node's strategy labels. Repeated layers share their Strategy objects
    (the enumeration's memo), so each object is labelled once, found by id (the
    table keeps every one alive meanwhile): LLaMA3-70B on 8x8x8 has 1.26
    million strategies but 10 thousand objects."""
    labels: dict[int, str] = {}

    def of(s: Strategy) -> str:
        text = labels.get(id(s))
        if text is None:
            text = labels[id(s)] = _strategy_label(s)
        return text

    return [[of(s) for s in table.nodes[n].strategies] for n in nodes]


def _strategy_label(s: Strategy) -> str:
    outs = ",".join(label(p) if p else "-" for p in s.outputs)
    ins = ",".join(label(p) if p else "-" for p in s.inputs)
    return f"{outs} <- {ins}" if ins else outs


def _flat_tensors(val) -> list:
    if isinstance(val, torch.Tensor):
        return [val]
    return [v if isinstance(v, torch.Tensor) else None for v in val]


def _tensor_vals(node: fx.Node) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_flatten

    flat, _ = tree_flatten((node.args, dict(node.kwargs)))
    return [a.meta["val"] for a in flat if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]


def _shapes(node: fx.Node) -> tuple:

    return (signature(node.args), signature(node.kwargs), signature(node.meta["val"]))
