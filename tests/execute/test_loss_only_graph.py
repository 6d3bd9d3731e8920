"""``compiled.loss_only_graph``: the compiled step less what only the gradients need.

Built by hand: a graph with a forward all-gather and a gradient reduce-scatter,
each with its wait, as the compiled step holds them. The graphs are only
pruned and checked here, never run (no process group needed)."""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives  # noqa: F401  (registers _c10d_functional)
from torch import fx

from torchtitan_autoparallel.execute.compiled import graph_collectives, loss_only_graph

C10D = torch.ops._c10d_functional


def _step_graph() -> fx.GraphModule:
    g = fx.Graph()
    weight, tokens = g.placeholder("weight"), g.placeholder("tokens")
    gathered = g.call_function(C10D.wait_tensor.default, (g.call_function(C10D.all_gather_into_tensor.default, (weight, 2, "0")),))
    loss = g.call_function(torch.ops.aten.sum.default, (g.call_function(torch.ops.aten.mul.Tensor, (gathered, tokens)),))
    grad_full = g.call_function(torch.ops.aten.mul.Tensor, (tokens, 2.0))
    grad = g.call_function(C10D.wait_tensor.default, (g.call_function(C10D.reduce_scatter_tensor.default, (grad_full, "sum", 2, "0")),))
    g.output((loss, grad))
    return fx.GraphModule(torch.nn.Module(), g)


def _targets(gm: fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_the_backward_and_its_collective_go() -> None:
    full = _step_graph()
    before = _targets(full)
    forward = loss_only_graph(full)
    assert dict(graph_collectives(forward)) == {"all_gather": 1}
    assert _targets(forward) == [
        "_c10d_functional.all_gather_into_tensor.default", "_c10d_functional.wait_tensor.default",
        "aten.mul.Tensor", "aten.sum.default",
    ]
    output = next(n for n in forward.graph.nodes if n.op == "output")
    assert len(output.args[0]) == 1  # the loss alone
    assert _targets(full) == before and len(before) == 7  # the step's own graph is left as it was


def test_a_collective_another_rank_keeps_is_kept_here() -> None:
    """The ranks agree on the union of what each keeps (position 1: the reduce-scatter),
    and the agreement is asked until it stops growing."""
    asked: list[frozenset[int]] = []

    def other_rank_keeps_the_reduce_scatter(kept: frozenset[int]) -> frozenset[int]:
        asked.append(kept)
        return kept | {1}

    forward = loss_only_graph(_step_graph(), other_rank_keeps_the_reduce_scatter)
    assert dict(graph_collectives(forward)) == {"all_gather": 1, "reduce_scatter": 1}
    # the reduce-scatter, its wait and its input stay; the output is still the loss alone
    assert _targets(forward).count("_c10d_functional.wait_tensor.default") == 2
    assert "aten.mul.Tensor" in _targets(forward)
    assert asked == [frozenset({0}), frozenset({0, 1})]
