"""The planner through the launcher: a fake-backend dry run, its plan.json, the
exported problem and the one-line errors of bad planning input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _run import run_launcher

from torchtitan_autoparallel.planner.problem.problem import Problem
from torchtitan_autoparallel.planner.solve import get_solver

REQUIRED_KEYS = {
    "objective", "lower_bound", "solver", "timings", "mesh", "parameters",
    "collectives", "predicted", "replicated_ops",
}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("dry")
    problem = folder / "exports" / "problem.npz"  # a folder the planner makes
    run = run_launcher(
        ["--model.name", "llama3_auto_parallel", "--job.dump_folder", folder,
         "--parallelism.tensor_parallel_degree", "2", "--autoparallel.export_problem", problem],
        ngpu=8, comm_mode="fake_backend",
    )
    assert run.returncode == 0, run.tail()
    assert "sharding plan on mesh dp_shard=4 x tp=2" in run.stdout + run.stderr, run.tail()
    # torch's default float32 matmul precision: an H100's FP32 cores, not TF32
    assert "cost profile h100, fp32 matmuls at 67 TFLOP/s peak" in run.stdout + run.stderr, run.tail()
    return folder / "plan.json", problem


def test_plan_json_has_the_documented_fields(dry_run) -> None:
    plan = json.loads(dry_run[0].read_text())
    assert REQUIRED_KEYS <= plan.keys()
    assert plan["mesh"] == {"names": ["dp_shard", "tp"], "sizes": [4, 2]}
    assert set(plan["timings"]) >= {"trace", "strategies", "build", "solve", "total"}
    assert set(plan["predicted"]) >= {"compute_us", "comm_us", "param_bytes_per_device"}
    # a dry run is checked against the memory of the profile's GPU (h100 by default)
    assert plan["device_memory_bytes"] == 81559 * 2**20
    assert plan["replicated_ops"] == []
    assert plan["lower_bound"] <= plan["objective"] * (1 + 1e-9)
    # Every parameter of the debug model, one placement per mesh dim.
    assert len(plan["parameters"]) == 6 * 7 + 3
    assert all(len(p) == 2 for p in plan["parameters"].values())
    # The default budget shards every weight over the data-parallel axis.
    assert all(p[0].startswith("S(") for p in plan["parameters"].values())
    # The collectives the executor would issue (its step traced on fake tensors, bucketed):
    # fewer calls than the plan's one per tensor, compile apart from the planner's stages.
    executed = sum(c["count"] for c in plan["executed_collectives"])
    assert 0 < executed < sum(c["count"] for c in plan["collectives"])
    assert "compile" in plan["timings"]


def test_tf32_matmuls_are_planned_at_tf32_rates(dry_run, tmp_path: Path) -> None:
    """``training.float32_matmul_precision = high``: the same dry run, its fp32 matmuls
    priced on TF32 tensor cores (494.7 TFLOP/s peak against 67), so less compute."""
    run = run_launcher(
        ["--model.name", "llama3_auto_parallel", "--job.dump_folder", tmp_path,
         "--parallelism.tensor_parallel_degree", "2", "--training.float32_matmul_precision", "high"],
        ngpu=8, comm_mode="fake_backend",
    )
    assert run.returncode == 0, run.tail()
    assert "cost profile h100, fp32 matmuls at 494.7 TFLOP/s peak" in run.stdout + run.stderr, run.tail()
    strict = json.loads(dry_run[0].read_text())["predicted"]["compute_us"]
    tf32 = json.loads((tmp_path / "plan.json").read_text())["predicted"]["compute_us"]
    assert tf32 < strict, (tf32, strict)


def test_exported_problem_resolves_to_the_same_objective_with_cbc(dry_run) -> None:
    plan = json.loads(dry_run[0].read_text())
    problem = Problem.load(dry_run[1])
    solution = get_solver("ilp", "cbc").solve(problem, time_limit=120)
    assert solution.status == "optimal"
    assert solution.objective == pytest.approx(plan["objective"], rel=1e-6)


def test_budget_below_the_minimum_names_the_smallest_feasible(tmp_path: Path) -> None:
    run = run_launcher(
        ["--model.name", "llama3_auto_parallel", "--job.dump_folder", tmp_path,
         "--autoparallel.memory_budget_gib", "0.0001"],
        ngpu=8, comm_mode="fake_backend",
    )
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, run.tail()
    assert "memory_budget_gib = 0.0001" in errors[0] and "GiB" in errors[0], errors[0]
    assert "Traceback" not in run.stdout + run.stderr, run.tail()


@pytest.mark.parametrize(
    "override,needle",
    [
        (["--autoparallel.cost_profile", "tpu9"], "tpu9"),
        (["--autoparallel.solver", "magic"], "magic"),
        (["--autoparallel.ilp_backend", "gurobi"], "gurobi"),
    ],
)
def test_bad_planner_settings_are_one_line_errors(tmp_path: Path, override, needle) -> None:
    run = run_launcher(
        ["--model.name", "llama3_auto_parallel", "--job.dump_folder", tmp_path, *override],
        ngpu=8, comm_mode="fake_backend",
    )
    assert run.returncode != 0
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], run.tail()


def test_a_plan_that_outgrows_the_device_is_flagged(tmp_path: Path) -> None:
    """LLaMA3-8B replicated on 64 ranks (DDP): 32 GB of fp32 weights and twice that of
    AdamW state on every H100, whatever the plan. The job is planned, with a warning."""
    run = run_launcher(
        ["--model.name", "llama3_auto_parallel", "--model.flavor", "8B", "--job.dump_folder", tmp_path,
         "--parallelism.data_parallel_replicate_degree", "64", "--parallelism.data_parallel_shard_degree", "1"],
        ngpu=64, comm_mode="fake_backend", timeout=600,
    )
    assert run.returncode == 0, run.tail()
    plan = json.loads((tmp_path / "plan.json").read_text())
    state = 3 * plan["predicted"]["param_bytes_per_device"]
    assert state > plan["device_memory_bytes"] == 81559 * 2**20
    warned = [line for line in run.stderr.splitlines() if "more than the device holds" in line]
    assert len(warned) == 1, run.tail()
    assert f"parameters and AdamW state {state / 2**30:.2f} GiB" in warned[0]
    assert "of 79.65 GiB" in warned[0] and "data_parallel_shard_degree" in warned[0]
