"""What makes planning fast must not make it worse: block ties and presolve on the debug model."""

from __future__ import annotations

import pytest
from torch.distributed.device_mesh import init_device_mesh

from torchtitan_autoparallel.models.registry import build_meta_model
from torchtitan_autoparallel.planner.cost.profiles import load_profile
from torchtitan_autoparallel.planner.problem.build import build_problem
from torchtitan_autoparallel.planner.solve import get_solver
from torchtitan_autoparallel.planner.strategies.repeats import _phase_layer_groups, repeated_layer_ties
from torchtitan_autoparallel.planner.strategies.strategy import enumerate_strategies
from torchtitan_autoparallel.planner.trace.trace import trace_training_step

N_LAYERS = 4
PROFILE = load_profile("h100")

pytestmark = pytest.mark.usefixtures("fake_world")


@pytest.fixture(scope="module")
def stages():
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp_shard", "tp"))
    traced = trace_training_step(build_meta_model("llama3", "debugmodel", N_LAYERS), 8, 256)
    table = enumerate_strategies(traced, mesh)
    return traced, table


def test_interior_blocks_share_one_solution_and_the_outer_ones_stay_free(stages):
    traced, table = stages
    tied = {n for group in repeated_layer_ties(traced, table) for n in group}
    for (phase, layer), nodes in _phase_layer_groups(traced, table).items():
        choices = [n for n in nodes if len(table.nodes[n].strategies) > 1]
        share = sum(n in tied for n in choices) / len(choices)
        if layer in (0, N_LAYERS - 1):
            assert share == 0, (phase, layer)
        else:
            # every op with a choice in an interior block is tied to its copies
            assert share == 1, (phase, layer, share)


def test_simplification_and_ties_leave_the_debug_model_optimum_unchanged(stages):
    traced, table = stages
    tied = build_problem(traced, table, PROFILE, None, repeated_layer_ties(traced, table)).problem
    free = build_problem(traced, table, PROFILE, None, []).problem
    reference = get_solver("ilp", "highs", presolve=False).solve(free, 300)
    assert reference.status == "optimal"
    for problem in (free, tied):
        fast = get_solver("ilp", "highs", presolve=True).solve(problem, 300)
        assert fast.status == "optimal"
        assert fast.objective == pytest.approx(reference.objective, rel=1e-9)
        assert fast.objective == pytest.approx(problem.energy(fast.assignment), rel=1e-12)


def test_deep_models_tie_their_outer_blocks_too(fake_world):
    from torchtitan_autoparallel.planner.strategies.repeats import TIE_OUTER_BLOCKS_FROM

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp_shard", "tp"))
    depth = TIE_OUTER_BLOCKS_FROM
    traced = trace_training_step(build_meta_model("llama3", "8B", depth), 8, 256)  # fake tensors: no memory
    table = enumerate_strategies(traced, mesh)
    tied = {n for group in repeated_layer_ties(traced, table) for n in group}
    for (phase, layer), nodes in _phase_layer_groups(traced, table).items():
        choices = [n for n in nodes if len(table.nodes[n].strategies) > 1]
        share = sum(n in tied for n in choices) / len(choices)
        # the last block's extra ops (final norm, head) stay free; the rest align
        assert share > (0.85 if layer == depth - 1 else 0.99), (phase, layer, share)


def test_free_nodes_do_not_grow_with_depth(fake_world):
    """Every op of a repeated block is tied, its RoPE table and the ops reading it
    included (they depend on a layer buffer, no parameter): two more blocks add no
    free node, so the tie-collapsed problem does not grow with depth."""
    from torchtitan_autoparallel.planner.strategies.repeats import TIE_OUTER_BLOCKS_FROM

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp_shard", "tp"))

    def free_nodes(depth: int) -> int:
        traced = trace_training_step(build_meta_model("llama3", "8B", depth), 8, 256)
        table = enumerate_strategies(traced, mesh)
        tied = {n for group in repeated_layer_ties(traced, table) for n in group}
        return sum(n not in tied for n in table.nodes)

    assert free_nodes(TIE_OUTER_BLOCKS_FROM + 2) == free_nodes(TIE_OUTER_BLOCKS_FROM)
