"""Find the repeated transformer blocks so they share one solution (problem ties).

The joint graph carries no module structure, so blocks are recovered from
data flow: a forward node belongs to the deepest layer whose parameters it
depends on (its buffers count, so each layer's RoPE table and the ops that
read it join it), a backward node to the deepest layer whose gradients it
feeds. Nodes of one (phase, layer) group, in graph order, line up position
by position with those of another group when the two hold the same op
sequence on the same shapes; such positions are tied (single-strategy ones
too: each tie group is one node fewer for the presolve to visit). A block
whose ops differ (the last one also runs the final norm and the head) is
aligned to the common block by its longest matching runs, so only the ops it
does not share stay free. Shallow models keep their first and last blocks
free altogether.
"""

from __future__ import annotations

import difflib
import re
from collections import defaultdict

from torch import fx

from torchtitan_autoparallel.planner.strategies.strategy import StrategyTable, signature
from torchtitan_autoparallel.planner.trace.trace import TracedStep

# From this many blocks on, the first and last blocks are tied to the others too.
TIE_OUTER_BLOCKS_FROM = 8

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def repeated_layer_ties(traced: TracedStep, table: StrategyTable) -> list[list[fx.Node]]:
    """Tie groups: each a list of nodes (one per repeated block) that must agree."""
    by_phase: dict[str, list[list[fx.Node]]] = defaultdict(list)
    for (phase, _layer), nodes in sorted(_phase_layer_groups(traced, table).items()):
        by_phase[phase].append(nodes)
    ties: list[list[fx.Node]] = []
    for blocks in by_phase.values():
        # The first and last blocks border the embedding and the head, and the
        # best plan may treat them differently: on a 4-layer debug model tying
        # them costs 0.2% of the objective. On deep models that boundary effect
        # is spread over many layers (LLaMA3-8B, 8 layers on 8x8: the same
        # optimum tied, interior-tied or untied) while two
        # free blocks double the solved problem (LLaMA3-70B on 8x8x8: its LP
        # goes from seconds to minutes), so they are tied there too.
        tied = blocks if len(blocks) >= TIE_OUTER_BLOCKS_FROM else blocks[1:-1]
        ties.extend(_align_blocks(tied, table))
    return ties


def _align_blocks(blocks: list[list[fx.Node]], table: StrategyTable) -> list[list[fx.Node]]:
    """Tie each position of the most common block to its matches in the others.

    Blocks that hold the common sequence exactly match everywhere; one that
    differs is aligned by longest matching runs, so only its other ops stay
    free.
    """
    if len(blocks) < 2:
        return []
    sigs = [tuple(_node_signature(n, table) for n in nodes) for nodes in blocks]
    ref_sig = max(set(sigs), key=lambda s: (sigs.count(s), len(s)))
    ref = blocks[sigs.index(ref_sig)]
    matched: list[list[fx.Node]] = [[n] for n in ref]
    for nodes, sig in zip(blocks, sigs):
        if nodes is ref:
            continue
        if sig == ref_sig:
            pairs = zip(range(len(ref)), range(len(nodes)))
        else:
            pairs = _matching_positions(ref_sig, sig)
        for i, j in pairs:
            matched[i].append(nodes[j])
    return [g for g in matched if len(g) > 1]


def _matching_positions(a: tuple, b: tuple) -> list[tuple[int, int]]:
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    return [(m.a + k, m.b + k) for m in matcher.get_matching_blocks() for k in range(m.size)]


def _phase_layer_groups(traced: TracedStep, table: StrategyTable) -> dict[tuple[str, int], list[fx.Node]]:
    # A layer's own buffers (its RoPE table) place the ops that read them, as its
    # parameters do: otherwise each layer's copy of that chain stays free.
    inputs = [*traced.buffers.items(), *traced.params.items()]
    layer_of_input = {node: _layer(fqn) for fqn, node in inputs}
    grad_layer = {traced.grads[fqn]: _layer(fqn) for fqn in traced.params}
    nodes = list(traced.graph.graph.nodes)
    # Deepest layer among ancestors (forward) and among gradient descendants (backward).
    up: dict[fx.Node, int] = {}
    for n in nodes:
        layers = [up.get(a, -1) for a in n.all_input_nodes]
        up[n] = max([layer_of_input.get(n, -1), *layers])
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
            if layer_of_input.get(n, -1) >= 0:
                groups[("param", layer_of_input[n])].append(n)
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
