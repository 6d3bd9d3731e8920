"""plan_training_step end to end: plan.json, the start-up table, budgets, mixed precision."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from _run import REPO
from torch.distributed.device_mesh import init_device_mesh

from torchtitan_autoparallel.models.registry import build_meta_model
from torchtitan_autoparallel.planner.cost.profiles import load_profile
from torchtitan_autoparallel.planner.plan.api import plan_stages, plan_training_step
from torchtitan_autoparallel.planner.plan.options import PlannerOptions
from torchtitan_autoparallel.planner.plan.plan import Plan
from torchtitan_autoparallel.planner.problem.problem import InfeasibleProblem, Problem

WORLD = 8
PROFILE = load_profile("h100")
GIB = 1024**3


pytestmark = pytest.mark.usefixtures("fake_world")


@pytest.fixture(scope="module")
def model():
    return build_meta_model("llama3", "debugmodel", n_layers=4)  # two interior blocks to tie


@pytest.fixture(scope="module")
def mesh_2d():
    return init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp_shard", "tp"))


@pytest.fixture(scope="module")
def plan_2d(model, mesh_2d, tmp_path_factory) -> tuple[Plan, str]:
    path = str(tmp_path_factory.mktemp("problem") / "problem.npz")
    plan = plan_training_step(
        model, mesh_2d, global_batch_size=8, seq_len=256, profile=PROFILE, export_problem=path
    )
    return plan, path


def test_plan_json_has_the_documented_keys(plan_2d, tmp_path):
    plan, _ = plan_2d
    out = tmp_path / "plan.json"
    plan.to_json(out)
    data = json.loads(out.read_text())
    for key in ("objective", "lower_bound", "solver", "timings", "mesh", "parameters", "collectives", "predicted", "replicated_ops"):
        assert key in data, key
    assert data["mesh"] == {"names": ["dp_shard", "tp"], "sizes": [2, 4]}
    assert set(data["timings"]) >= {"trace", "strategies", "build", "solve", "total"}
    assert data["solver"] == "ilp-highs"
    assert data["replicated_ops"] == []
    wqkv = data["parameters"]["layers.0.attention.qkv_linear.wqkv.weight"]
    assert len(wqkv) == 2 and all(isinstance(p, str) for p in wqkv)
    for c in data["collectives"]:
        assert set(c) >= {"kind", "mesh_dim", "bytes", "us", "count"}
        assert c["mesh_dim"] in ("dp_shard", "tp")
    assert Plan.from_json(out).parameters == plan.parameters


def test_predictions_add_up(plan_2d):
    plan, _ = plan_2d
    assert plan.objective == pytest.approx(plan.compute_us + plan.comm_us)
    assert plan.lower_bound <= plan.objective + 1e-6
    assert plan.param_bytes_per_device <= plan.memory_budget_bytes * (1 + 1e-6)


def test_exported_problem_reloads_and_scores_the_same(plan_2d):
    plan, path = plan_2d
    problem = Problem.load(path)
    assert problem.num_nodes > 100 and len(problem.ties) > 0
    assert problem.memory_budget == pytest.approx(plan.memory_budget_bytes)


def test_repeated_layers_share_their_tables(model, mesh_2d):
    stages = plan_stages(model, mesh_2d, PlannerOptions(global_batch_size=8, seq_len=256, profile=PROFILE))
    problem = stages.built.problem
    distinct = {id(t): t for t in problem.pairwise}
    # four blocks ask the same questions: far fewer tables than edges, none writable
    assert len(distinct) < len(problem.edges) / 2
    assert not any(t.flags.writeable for t in distinct.values())
    contents = {(t.shape, t.tobytes()) for t in distinct.values()}
    assert len(contents) == len(distinct)  # and no two of them are equal


def test_table_has_one_row_per_distinct_block(plan_2d):
    plan, _ = plan_2d
    text = plan.table()
    rows = [line for line in text.splitlines() if "|" in line]
    layer_rows = [r for r in rows if r.strip().startswith("layers.")]
    # repeated blocks share one solution, so the middle layers collapse into one row
    assert 1 <= len(layer_rows) <= 3
    assert any("wqkv" in r and "w2" in r for r in layer_rows)
    assert sum(1 for r in rows if "tok_embeddings" in r) == 1


def test_infeasible_budget_names_the_smallest_feasible_one(model, mesh_2d):
    with pytest.raises(InfeasibleProblem, match=r"smallest feasible budget is [0-9.]+ GiB"):
        plan_training_step(
            model, mesh_2d, global_batch_size=8, seq_len=64, profile=PROFILE, memory_budget_gib=1e-6
        )


@pytest.fixture(scope="module")
def fsdp_plan(model) -> Plan:
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp_shard",))
    return plan_training_step(model, mesh, global_batch_size=64, seq_len=512, profile=PROFILE)


def test_the_whole_peak_is_listed_by_part(fsdp_plan, model):
    parts = fsdp_plan.peak_parts
    assert set(parts) == {
        "parameters", "optimizer_state", "gradients", "activations", "weight_copies", "redistribution_buffers",
        "collective_buffers",
    }
    assert fsdp_plan.predicted["peak_bytes_per_device"] == pytest.approx(sum(parts.values()))
    assert parts["parameters"] == pytest.approx(fsdp_plan.param_bytes_per_device)
    assert parts["optimizer_state"] == pytest.approx(2 * parts["parameters"])  # AdamW's two moments
    assert min(parts.values()) >= 0 and parts["activations"] > 0  # gradients: 0 when the peak opens the backward


def test_weights_gathered_for_the_forward_and_kept_for_the_backward_are_counted(fsdp_plan, model):
    # FSDP gathers w.t() once and the backward's matmul reads the same gathered copy:
    # that buffer lives from one to the other (measured on CPU ranks, experiments/memory).
    full = sum(p.numel() * 4 for p in model.parameters())
    assert 0 < fsdp_plan.peak_parts["weight_copies"] <= full
    assert fsdp_plan.predicted["peak_weight_copy_bytes_per_device"] == fsdp_plan.peak_parts["weight_copies"]


def test_a_generous_budget_lets_the_solver_replicate(model, fsdp_plan):
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp_shard",))
    tight = fsdp_plan
    loose = plan_training_step(
        model, mesh, global_batch_size=64, seq_len=512, profile=PROFILE, memory_budget_gib=1.0
    )
    assert loose.objective <= tight.objective + 1e-6
    assert loose.param_bytes_per_device >= tight.param_bytes_per_device
    total = sum(p.numel() * 4 for p in model.parameters())
    assert tight.param_bytes_per_device == pytest.approx(total / WORLD)


def test_mixed_precision_gathers_bf16_and_reduces_fp32(model):
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp_shard",))
    plan = plan_training_step(
        model,
        mesh,
        global_batch_size=64,
        seq_len=1024,
        profile=PROFILE,
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
    )
    sizes = {p.numel() for p in model.parameters()}
    gathers = [c for c in plan.collectives if c.kind == "all_gather" and c.purpose == "parameter"]
    scatters = [c for c in plan.collectives if c.kind == "reduce_scatter" and c.purpose == "gradient"]
    assert gathers and scatters
    # Weight matrices (norm weights are too small for the order to matter):
    # gathered after the cast down (bf16), reduced after the cast up (fp32).
    big = 4096
    assert all(c.bytes / 2 in sizes for c in gathers if c.bytes > big)
    assert all(c.bytes / 4 in sizes for c in scatters if c.bytes > big)
    assert any(c.bytes > big for c in gathers) and any(c.bytes > big for c in scatters)


def test_progress_is_logged(model, mesh_2d, caplog):
    with caplog.at_level(logging.INFO, logger="torchtitan_autoparallel.planner"):
        plan_training_step(model, mesh_2d, global_batch_size=8, seq_len=64, profile=PROFILE)
    text = caplog.text
    for stage in ("trace", "strategies", "build", "solve", "total"):
        assert stage in text


def test_the_documented_reader_rescores_the_plan_without_this_package(plan_2d, tmp_path, monkeypatch):
    """docs/problem_format.md's numpy reader, run as written on a fresh export and its
    plan.json: the plan's cost from the tables alone is the plan's objective."""
    plan, path = plan_2d
    plan.to_json(tmp_path / "plan.json")
    (tmp_path / "problem.npz").write_bytes(Path(path).read_bytes())
    (reader,) = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "problem_format.md").read_text(), flags=re.S)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(reader, "problem_format.md", "exec"), scope)
    problem = Problem.load(path)
    assert [len(lab) for lab in scope["labels"]] == [len(u) for u in problem.unary]
    assert len(scope["pairwise"]) == len(problem.edges)
    assert all((a == b).all() for a, b in zip(scope["pairwise"], problem.pairwise))
    assert scope["cost_us"] == pytest.approx(plan.objective, rel=1e-9)
