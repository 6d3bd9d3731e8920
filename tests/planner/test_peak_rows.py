"""Memory rows read from a plan's walk: node terms carry the live bytes, and a row
tells plans apart as the walk does."""

from __future__ import annotations

import numpy as np
import pytest
from torch.distributed.device_mesh import init_device_mesh

from torchtitan_autoparallel.models.registry import build_meta_model
from torchtitan_autoparallel.planner.cost.profiles import load_profile
from torchtitan_autoparallel.planner.plan.api import plan_stages
from torchtitan_autoparallel.planner.plan.options import PlannerOptions
from torchtitan_autoparallel.planner.plan.peak_rows import StepMemory, over_limit

pytestmark = pytest.mark.usefixtures("fake_world")


@pytest.fixture(scope="module", params=["none", "full"])
def walked(request) -> StepMemory:
    model = build_meta_model("llama3", "debugmodel", n_layers=2)
    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",))
    options = PlannerOptions(global_batch_size=8, seq_len=128, profile=load_profile("h100"),
                             activation_checkpoint=request.param)
    executable = plan_stages(model, mesh, options)
    return StepMemory(executable.built, executable.traced, executable.solution.assignment)


def test_the_whole_peak_is_the_plans(walked) -> None:
    executable_peak = walked.totals.max()
    assert walked.peak == executable_peak and walked.totals[walked.at] == walked.peak
    assert walked.state > 0  # parameters and AdamW state ride on every position


def test_node_terms_carry_the_live_bytes(walked) -> None:
    """At the worst positions the row's constant (what no choice moves) is a sliver:
    the collectives' buffers are charged to the nodes whose placements make them."""
    for at in np.argsort(-walked.totals)[:8].tolist():
        row = walked.row(at, limit=walked.peak)
        assert row.value(walked.x) == pytest.approx(walked.totals[at], rel=1e-9)
        assert abs(row.const) <= 0.05 * walked.totals[at], (row.where, row.const, walked.totals[at])
        assert row.least() <= walked.totals[at]


def test_a_row_prices_the_other_strategies_by_their_bytes(walked) -> None:
    """Replicating a sharded parameter's placement raises the row by its extra bytes at least."""
    row = walked.row(walked.at, limit=walked.peak)
    problem = walked.built.problem
    params = [walked.built.index(p) for p in walked.traced.params.values()]
    v = next(v for v in params if v in row.terms and problem.memory[v] is not None and np.ptp(problem.memory[v]) > 0)
    x = walked.x.copy()
    x[v] = int(np.argmax(problem.memory[v]))
    assert row.value(x) - row.value(walked.x) >= 3 * (problem.memory[v].max() - problem.memory[v][walked.x[v]]) - 1


def test_over_limit_picks_the_worst_positions_apart() -> None:
    totals = np.array([0, 5, 9, 8, 1, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0, 0, 6], dtype=float)
    assert over_limit(totals, 4.5) == [2, 12, 21]
    assert over_limit(totals, 100) == []
