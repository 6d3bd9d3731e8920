"""Candidate strategies per graph node: output placements + required input placements.

Sources, in order of preference:

1. our rules (``rules.py``) and torch's single-dimension rules: both list the
   valid combinations over one mesh dim; we expand them to the full mesh
   (cartesian product), keeping combinations whose tensors split evenly;
2. torch's full-mesh strategy functions (views, transposes, expand, ...):
   called with the producer's candidate placements as the input strategy, so
   the view follows whatever its input may be;
3. nothing: the op gets Replicate everywhere and is reported in
   ``replicated_ops`` - never silently.

Enumeration is memoised on (op, argument shapes/dtypes, non-tensor arguments,
input candidates) because the repeated transformer blocks ask the same
questions again and again.
"""

from __future__ import annotations

import functools
import itertools
import logging
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy
from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.utils._pytree import tree_flatten, tree_map

from torchtitan_autoparallel.compat import torch_single_dim_rule
from torchtitan_autoparallel.planner.strategies import strided as strided_rules
from torchtitan_autoparallel.planner.strategies.placement import (
    MeshSpec,
    Placements,
    batch_placement,
    is_evenly_shardable,
    parameter_placements,
    replicated,
)
from torchtitan_autoparallel.planner.strategies.rules import our_rule
from torchtitan_autoparallel.planner.trace.trace import TracedStep

log = logging.getLogger("torchtitan_autoparallel.planner")


@dataclass(frozen=True)
class Strategy:
    """One way to run a node: placements of each output and of each tensor input."""

    outputs: tuple[Placements | None, ...]
    inputs: tuple[Placements | None, ...]


@dataclass
class NodeStrategies:
    node: fx.Node
    # Tensor inputs in flattened argument order: (producer, output index of producer).
    args: list[tuple[fx.Node, int]]
    strategies: list[Strategy]
    source: str  # parameter | buffer | input | ours | torch | follow | constant | replicate


@dataclass
class StrategyTable:
    mesh: MeshSpec
    nodes: dict[fx.Node, NodeStrategies]
    replicated_ops: list[str]
    cache_hits: int = 0
    cache_misses: int = 0

    @property
    def num_strategies(self) -> int:
        return sum(len(ns.strategies) for ns in self.nodes.values())


@dataclass
class _Enumerator:
    device_mesh: DeviceMesh
    mesh: MeshSpec
    cache: dict = field(default_factory=dict)
    hits: int = 0
    misses: int = 0
    replicated: set[str] = field(default_factory=set)
    # [autoparallel] strided_sharding: matmuls (and t) also take the inputs' strided shards.
    strided: bool = False
    # Repeated layers reuse the same Strategy and placement objects (``cache``), so
    # what derives from lists of them alone is memoised by the lists' identity, and
    # each list made is canonical (one object per sequence of items), so that the
    # next layer, fed the same objects, hits. An entry keeps its keys alive (an id
    # is unique only while its object lives). Hashing torch placements by value
    # took most of the enumeration on deep models.
    by_id: dict[tuple, tuple] = field(default_factory=dict)

    def by_identity(self, kind: object, lists: tuple[list, ...], make: Callable[[], list]) -> list:
        """``make()``, memoised on ``kind`` and the identity of ``lists`` (never written)."""
        key = (kind, *map(id, lists))
        hit = self.by_id.get(key)
        if hit is None:
            hit = self.by_id[key] = (lists, self.canonical(make()))
        return hit[1]

    def canonical(self, items: list) -> list:
        """The one list object of this sequence of item objects."""
        key = ("canonical", *map(id, items))
        hit = self.by_id.get(key)
        if hit is None:
            hit = self.by_id[key] = (items, items)
        return hit[1]

    def output_candidates(self, ns: NodeStrategies, idx: int) -> list[Placements]:
        return self.by_identity(f"outputs{idx}", (ns.strategies,), lambda: _output_candidates(ns, idx))

    def reachable(self, strategies: list[Strategy], candidates: list[list[Placements]]) -> list[Strategy]:
        return self.by_identity("reachable", (strategies, *candidates), lambda: _reachable(strategies, candidates))

    # ------------------------------------------------------------------ nodes

    def for_op(self, node: fx.Node, candidates: list[list[Placements]]) -> tuple[list[Strategy], str]:
        op = node.target
        key = (op, signature(node.args), signature(node.kwargs), signature(node.meta["val"]))
        if our_rule(op) is None and _propagator_kind(op) == "torch" and len(candidates) == 1:
            known = self.by_id.get((key, id(candidates[0])))
            if known is None:
                answer = self._follow_each(node, key, candidates[0])
                known = self.by_id[key, id(candidates[0])] = (candidates, answer)
            else:
                self.hits += 1
            return known[1]
        if self._strided_op(op):
            key = key + strided_rules.memo_key(candidates)
        return self._memo(key, node, candidates)

    def _follow_each(self, node: fx.Node, key: tuple, candidates: list[Placements]) -> tuple[list[Strategy], str]:
        """A view follows its input: ask once per input candidate, so each answer is
        memoised alone and torch never prices every candidate against every other one."""
        merged: dict[Strategy, None] = {}
        for cand in candidates:
            k = key + (cand,)
            if k in self.cache:
                self.hits += 1
            else:
                self.misses += 1
                self.cache[k] = self._follow_one(node, cand)
            merged.update(dict.fromkeys(self.cache[k]))
        if merged:
            return self.canonical(list(merged)), "follow"
        return self._memo(key + ("replicate",), node, [[]])

    def _strided_op(self, op: object) -> bool:
        return self.strided and op in strided_rules.STRIDED_OPS

    def _memo(self, key: tuple, node: fx.Node, candidates: list[list[Placements]]) -> tuple[list[Strategy], str]:
        if key in self.cache:
            self.hits += 1
            return self.cache[key]
        self.misses += 1
        result = self._compute(node, candidates)
        self.cache[key] = result
        return result

    def _compute(self, node: fx.Node, candidates: list[list[Placements]]) -> tuple[list[Strategy], str]:
        op = node.target
        n_in = len(candidates)
        out_metas = _output_metas(node.meta["val"])
        in_metas = [_meta(a.meta["val"]) for a in _tensor_args(node)]
        if n_in == 0:
            # A constant made from nothing (scalar_tensor, zeros, full): every
            # rank creates it whole and slices it for free, so Replicate is
            # exact and cheap, not a fallback worth reporting.
            rep = replicated(self.mesh)
            return [Strategy(tuple(rep if m is not None else None for m in out_metas), ())], "constant"
        rule_fn = our_rule(op)
        source = "ours"
        if rule_fn is None:
            rule_fn = torch_single_dim_rule(op)
            source = "torch"
        if rule_fn is not None:
            args_meta = tree_map(_to_meta, node.args)
            kwargs_meta = tree_map(_to_meta, dict(node.kwargs))
            try:
                rules = rule_fn(op, args_meta, kwargs_meta)
            except (RuntimeError, AssertionError, ValueError, NotImplementedError, TypeError) as err:
                # A rule that cannot handle these arguments is no rule: report it.
                log.warning("sharding rule of %s failed (%s); replicating it", op, err)
                rules = None
            if rules is not None:
                rules = list(rules)  # read twice when strided variants are added
                extra = self._strided_variants(op, rules, candidates, out_metas, in_metas)
                strategies = expand_rules(rules, len(out_metas), out_metas, in_metas, self.mesh, extra)
                if extra is not None:
                    strategies = strided_rules.keep_offered(strategies, candidates)
                if strategies:
                    return strategies, source
        elif _propagator_kind(op) == "torch" and all(candidates):
            strategies = self._follow(node, candidates, out_metas, in_metas)
            if strategies:
                return strategies, "follow"
        self.replicated.add(str(op))
        rep = replicated(self.mesh)
        outs = tuple(rep if m is not None else None for m in out_metas)
        return [Strategy(outs, tuple(rep for _ in range(n_in)))], "replicate"

    def _strided_variants(self, op, rules, candidates, out_metas, in_metas) -> list[list] | None:
        """Per mesh dim, the strided rules of a matmul or t (None when the option is off)."""
        if not self._strided_op(op):
            return None
        offers = strided_rules.offers(candidates, in_metas, self.mesh.ndim)
        return strided_rules.strided_rules(rules, offers, [*out_metas, *in_metas], len(out_metas))

    def _follow_one(self, node: fx.Node, cand: Placements) -> list[Strategy]:
        out_metas = _output_metas(node.meta["val"])
        in_metas = [_meta(a.meta["val"]) for a in _tensor_args(node)]
        return self._follow(node, [[cand]], out_metas, in_metas)

    def _follow(
        self,
        node: fx.Node,
        candidates: list[list[Placements]],
        out_metas: list[TensorMeta | None],
        in_metas: list[TensorMeta],
    ) -> list[Strategy]:
        """Ask torch's full-mesh strategy function, the input offering every candidate."""
        sp = DTensor._op_dispatcher.sharding_propagator
        it = iter(zip(candidates, in_metas))

        def wrap(a):
            if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
                cands, meta = next(it)
                specs = [OpSpec(DTensorSpec(self.device_mesh, p, tensor_meta=meta)) for p in cands]
                return OpStrategy(specs)
            return a

        args = tree_map(wrap, node.args, is_leaf=lambda a: isinstance(a, fx.Node))
        # a list of tensors (cat's) is one TupleStrategy argument, as DTensor's dispatch passes it
        args = [TupleStrategy(list(a)) if _strategy_list(a) else a for a in args]
        kwargs = tree_map(wrap, dict(node.kwargs), is_leaf=lambda a: isinstance(a, fx.Node))
        schema = OpSchema(node.target, tuple(args), kwargs, schema_info=sp.op_to_schema_info.get(node.target))
        try:
            result = sp.op_strategy_funcs[node.target](schema)
        except (RuntimeError, AssertionError, ValueError, NotImplementedError, KeyError):
            # torch refuses this input placement (e.g. a view that would
            # unflatten an uneven shard; on a size-1 mesh dim, expand of a
            # Shard on a broadcast size-1 dim raises KeyError): not a candidate.
            return []
        if not isinstance(result, OpStrategy):
            return []
        out: list[Strategy] = []
        for spec in result.strategies:
            outs = spec.output_specs if isinstance(spec.output_specs, tuple) else (spec.output_specs,)
            out_p = tuple(s.placements if s is not None else None for s in outs)
            ins = spec.input_specs if spec.input_specs is not None else [outs[0]] * len(in_metas)
            in_p = tuple(s.placements for s in ins[: len(in_metas)])
            out.append(Strategy(out_p, in_p))
        return _valid(out, out_metas, in_metas, self.mesh)


def enumerate_strategies(
    traced: TracedStep, device_mesh: DeviceMesh, strided_sharding: bool = False
) -> StrategyTable:
    """Strategies for every tensor-carrying node of the traced step.

    With ``strided_sharding`` the matmul family also gets ``_StridedShard``
    variants for the strided shards its inputs can carry (``strided.py``).
    """
    mesh = MeshSpec.from_device_mesh(device_mesh)
    en = _Enumerator(device_mesh, mesh, strided=strided_sharding)
    roles = _placeholder_roles(traced)
    table: dict[fx.Node, NodeStrategies] = {}
    for node in traced.graph.graph.nodes:
        if node.op == "placeholder":
            table[node] = _placeholder(node, roles[node], mesh)
        elif node.op == "call_function" and _carries_tensor(node):
            args = [(a, 0) for a in _tensor_args(node)]
            if node.target is operator.getitem:
                table[node] = _getitem(node, table, en)
                continue
            cands = [en.output_candidates(table[a], 0) for a, _ in args]
            strategies, source = en.for_op(node, cands)
            table[node] = NodeStrategies(node, args, en.reachable(strategies, cands), source)
    log.info(
        "strategies: %d nodes, %d strategies, memo %d hits / %d misses, %d replicated ops",
        len(table),
        sum(len(ns.strategies) for ns in table.values()),
        en.hits,
        en.misses,
        len(en.replicated),
    )
    return StrategyTable(mesh, table, sorted(en.replicated), en.hits, en.misses)


# ---------------------------------------------------------------- expansion


def expand_rules(
    rules: Iterable[list],
    n_out: int,
    out_metas: list[TensorMeta | None],
    in_metas: list[TensorMeta],
    mesh: MeshSpec,
    extra: list[list] | None = None,
) -> list[Strategy]:
    """Single-mesh-dim rules -> full-mesh strategies (cartesian product over mesh dims).

    ``extra[i]`` are further rules for mesh dim ``i`` only (strided variants).
    """
    n_in = len(in_metas)
    filled = [_fill(rule) for rule in rules]
    filled = [r for r in filled if len(r) == n_out + n_in]
    if not any(all(p is None or isinstance(p, Replicate) for p in r) for r in filled):
        filled.insert(0, [None if out_metas[i] is None else Replicate() for i in range(n_out)] + [Replicate()] * n_in)
    per_dim = [filled + [r for r in (extra[i] if extra else []) if len(r) == n_out + n_in] for i in range(mesh.ndim)]
    out: list[Strategy] = []
    for combo in itertools.product(*per_dim):
        per_pos = list(zip(*combo))  # position -> placement on each mesh dim
        if any(any(p is None for p in ps) and not all(p is None for p in ps) for ps in per_pos):
            continue
        specs = [None if ps[0] is None else tuple(ps) for ps in per_pos]
        if any(_mixed_partial(s) for s in specs):
            continue
        out.append(Strategy(tuple(specs[:n_out]), tuple(specs[n_out:])))
    return _valid(out, out_metas, in_metas, mesh)


def _fill(rule: list) -> list:
    return [Shard(p.dim) if isinstance(p, _ShardingPlaceholder) else p for p in rule]


def _mixed_partial(spec: Placements | None) -> bool:
    if spec is None:
        return False
    kinds = {(type(p), p.reduce_op) for p in spec if isinstance(p, Partial)}
    return len(kinds) > 1 and not (len({t for t, _ in kinds}) == 1 and {r for _, r in kinds} == {"sum", "avg"})


def _reachable(strategies: list[Strategy], candidates: list[list[Placements]]) -> list[Strategy]:
    """Drop strategies that need a Partial input no producer can emit.

    Turning a Replicate or Shard into a Partial is a free zero-fill, but a
    kernel fed such an input only defers a reduction it could have skipped:
    the same strategy without the Partial is never worse. Pruning them keeps
    the pointwise ops of a 2-D mesh from carrying every Partial combination.
    """
    emitted = [
        {(i, p) for c in cands for i, p in enumerate(c) if isinstance(p, Partial)} for cands in candidates
    ]
    kept = [
        s
        for s in strategies
        if all(
            spec is None or all((i, p) in emitted[j] for i, p in enumerate(spec) if isinstance(p, Partial))
            for j, spec in enumerate(s.inputs)
        )
    ]
    return kept or strategies


def _odd_partial(spec: Placements | None) -> bool:
    return spec is not None and any(isinstance(p, Partial) and p.reduce_op not in ("sum", "avg") for p in spec)


def _valid(
    strategies: list[Strategy], out_metas: list[TensorMeta | None], in_metas: list[TensorMeta], mesh: MeshSpec
) -> list[Strategy]:
    """Keep strategies whose every tensor splits evenly; drop duplicates.

    Partial max/min/product are dropped too: nothing in an LLM training step
    produces them, and carrying them through every pointwise op would double
    the problem for no plan.
    """
    seen: dict[Strategy, None] = {}
    for s in strategies:
        if len(s.outputs) != len(out_metas) or len(s.inputs) != len(in_metas):
            continue
        if any(_odd_partial(p) for p in (*s.outputs, *s.inputs)):
            continue
        pairs = [*zip(s.outputs, out_metas), *zip(s.inputs, in_metas)]
        if all(p is None or m is None or is_evenly_shardable(m.shape, p, mesh.sizes) for p, m in pairs):
            seen.setdefault(s, None)
    return list(seen)


# ---------------------------------------------------------------- placeholders, getitem


def _placeholder_roles(traced: TracedStep) -> dict[fx.Node, str]:
    roles = {n: "parameter" for n in traced.params.values()}
    roles.update({n: "buffer" for n in traced.buffers.values()})
    roles[traced.tokens] = "input"
    roles[traced.labels] = "input"
    return roles


def _placeholder(node: fx.Node, role: str, mesh: MeshSpec) -> NodeStrategies:
    shape = tuple(node.meta["val"].shape)
    return NodeStrategies(node, [], _placeholder_strategies(role, shape, mesh), role)


@functools.lru_cache(maxsize=1024)
def _placeholder_strategies(role: str, shape: tuple[int, ...], mesh: MeshSpec) -> list[Strategy]:
    """One list (never written) per role and shape: the layers' same-shaped
    parameters share it, and with it every memo keyed by identity downstream."""
    if role == "parameter":
        options = parameter_placements(shape, mesh)
    elif role == "input":
        options = [batch_placement(shape, mesh)]
    else:
        # Buffers (RoPE tables) are small constants every rank holds whole.
        options = [replicated(mesh)]
    return [Strategy((p,), ()) for p in options]


def _getitem(node: fx.Node, table: dict[fx.Node, NodeStrategies], en: _Enumerator) -> NodeStrategies:
    parent, idx = node.args[0], node.args[1]
    options = en.output_candidates(table[parent], idx)
    strategies = en.by_identity("getitem", (options,), lambda: [Strategy((p,), (p,)) for p in options])
    return NodeStrategies(node, [(parent, idx)], strategies, "follow")


def _output_candidates(ns: NodeStrategies, idx: int) -> list[Placements]:
    return list(dict.fromkeys(s.outputs[idx] for s in ns.strategies if s.outputs[idx] is not None))


# ---------------------------------------------------------------- helpers


def _propagator_kind(op: object) -> str | None:
    sp = DTensor._op_dispatcher.sharding_propagator
    if op in sp.op_single_dim_strategy_funcs:
        return "single"
    if op in sp.op_strategy_funcs:
        return "torch"
    return None


def _strategy_list(arg: object) -> bool:
    return isinstance(arg, (list, tuple)) and bool(arg) and all(isinstance(a, OpStrategy) for a in arg)


def _carries_tensor(node: fx.Node) -> bool:
    val = node.meta.get("val")
    vals, _ = tree_flatten(val)
    return any(isinstance(v, torch.Tensor) for v in vals)


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    flat, _ = tree_flatten((node.args, dict(node.kwargs)))
    return [a for a in flat if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]


def _meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(t.shape, t.stride(), t.dtype)


def _to_meta(a):
    if isinstance(a, fx.Node):
        return _meta(a.meta["val"])
    return a


def _output_metas(val) -> list[TensorMeta | None]:
    if isinstance(val, torch.Tensor):
        return [_meta(val)]
    return [_meta(v) if isinstance(v, torch.Tensor) else None for v in val]


def signature(x) -> object:
    """A hashable summary: tensors become (shape, stride, dtype), containers tuples."""
    if isinstance(x, fx.Node):
        return signature(x.meta.get("val"))
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), tuple(x.stride()), x.dtype)
    if isinstance(x, (list, tuple)):
        return tuple(signature(v) for v in x)
    if isinstance(x, dict):
        return tuple(sorted((k, signature(v)) for k, v in x.items()))
    return x
