"""Find the repeated transformer blocks so they share one solution (problem ties).

The joint graph carries no module structure, so blocks are recovered from
data flow: a forward node belongs to the deepest layer whose parameters it
depends on, a backward node to the deepest layer whose gradients it feeds.
Nodes of one (phase, layer) group, in graph order, line up position by
position with those of another group when the two hold the same op sequence
on the same shapes; such positions are tied. Groups that differ (the first
and last blocks, which border the embedding and the head) stay free, so ties
never change what is representable, only how fast it is found.
"""

from __future__ import annotations

import re
from collections import defaultdict

from torch import fx

from torchtitan_autoparallel.planner.strategy import StrategyTable, signature
from torchtitan_autoparallel.planner.trace import TracedStep

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def repeated_layer_ties(traced: TracedStep, table: StrategyTable) -> list[list[fx.Node]]:
    """Tie groups: each a list of nodes (one per repeated block) that must agree."""
    groups = _phase_layer_groups(traced, table)
    by_shape: dict[tuple, list[list[fx.Node]]] = defaultdict(list)
    for (phase, _layer), nodes in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        sig = tuple(_node_signature(n, table) for n in nodes)
        by_shape[(phase, sig)].append(nodes)
    ties: list[list[fx.Node]] = []
    for blocks in by_shape.values():
        if len(blocks) < 2:
            continue
        for position in zip(*blocks):
            if len(table.nodes[position[0]].strategies) > 1:
                ties.append(list(position))
    return ties


def _phase_layer_groups(traced: TracedStep, table: StrategyTable) -> dict[tuple[str, int], list[fx.Node]]:
    layer_of_param = {node: _layer(fqn) for fqn, node in traced.params.items()}
    grad_layer = {traced.grads[fqn]: _layer(fqn) for fqn in traced.params}
    nodes = list(traced.graph.graph.nodes)
    # Deepest layer among ancestors (forward) and among gradient descendants (backward).
    up: dict[fx.Node, int] = {}
    for n in nodes:
        layers = [up.get(a, -1) for a in n.all_input_nodes]
        up[n] = max([layer_of_param.get(n, -1), *layers])
    down: dict[fx.Node, int] = {}
    reaches_loss: dict[fx.Node, bool] = {}
    for n in reversed(nodes):
        users = list(n.users)
        down[n] = max([grad_layer.get(n, -1), *[down.get(u, -1) for u in users]])
        reaches_loss[n] = n is traced.loss or any(reaches_loss.get(u, False) for u in users)
    groups: dict[tuple[str, int], list[fx.Node]] = defaultdict(list)
    for n in nodes:
        if n not in table.nodes:
            continue
        if n.op == "placeholder":
            if n in layer_of_param and layer_of_param[n] >= 0:
                groups[("param", layer_of_param[n])].append(n)
            continue
        phase, layer = ("fwd", up[n]) if reaches_loss[n] else ("bwd", down[n])
        if layer >= 0:
            groups[(phase, layer)].append(n)
    return groups


def _layer(fqn: str) -> int:
    m = _LAYER.search(fqn)
    return int(m.group(1)) if m else -1


def _node_signature(n: fx.Node, table: StrategyTable) -> tuple:
    ns = table.nodes[n]
    return (
        str(n.target) if n.op == "call_function" else n.op,
        signature(n.meta.get("val")),
        signature([a for a in n.args if not isinstance(a, fx.Node)]),
        len(ns.strategies),
        tuple(ns.strategies) if len(ns.strategies) < 128 else len(ns.strategies),
    )
