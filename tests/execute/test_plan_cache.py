"""The plan cache: a repeated start-up skips the solve; a changed key or a bad entry plans again.

One LLaMA3 debug model (2 layers) is planned once on a 2-rank fake mesh; the
tests then call the cache hook on that built problem with a counting solve,
so each test costs a key hash and a JSON file, not a trace.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from torchtitan_autoparallel.models.registry import build_meta_model
from torchtitan_autoparallel.planner.cost.profiles import load_profile
from torchtitan_autoparallel.planner.plan import cache
from torchtitan_autoparallel.planner.plan.api import plan_stages
from torchtitan_autoparallel.planner.plan.cache import cache_key, cached_solve_hook, plan_settings
from torchtitan_autoparallel.planner.plan.options import PlannerOptions
from torchtitan_autoparallel.planner.problem.build import BuiltProblem
from torchtitan_autoparallel.planner.solve.base import Solution

OPTIONS = PlannerOptions(global_batch_size=4, seq_len=32, profile=load_profile("h100"), time_limit_s=60)


@pytest.fixture(scope="module")
def mesh():
    """A 2-rank mesh on a fake process group (rank 0's view); closes only a group it opened."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    finally:
        if owned:
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def planned(mesh, tmp_path_factory):
    """(built problem, its solution, the settings) from one real plan through the cache hook."""
    folder = tmp_path_factory.mktemp("plan_cache")
    settings = plan_settings(mesh, OPTIONS, {"model": "llama3/debugmodel/2"})
    model = build_meta_model("llama3", "debugmodel", n_layers=2)
    stages = plan_stages(model, mesh, OPTIONS, solve_hook=cached_solve_hook(folder, settings))
    assert (folder / f"{cache_key(stages.built, settings)}.json").is_file()  # the first start-up stored it
    return stages.built, stages.solution, settings


class CountingSolve:
    """Stands in for the solver: returns the real solution and counts the calls."""

    def __init__(self, solution: Solution) -> None:
        self.solution = solution
        self.calls = 0

    def __call__(self) -> Solution:
        self.calls += 1
        return dataclasses.replace(self.solution, assignment=self.solution.assignment.copy())


def _run(folder: Path, settings: dict, built: BuiltProblem, solution: Solution) -> tuple[Solution, int]:
    counting = CountingSolve(solution)
    result = cached_solve_hook(folder, settings)(built, counting)
    return result, counting.calls


def _entry(folder: Path, built: BuiltProblem, settings: dict) -> Path:
    return folder / f"{cache_key(built, settings)}.json"


def test_same_key_is_a_hit_and_skips_the_solver(planned, tmp_path, caplog):
    built, solution, settings = planned
    caplog.set_level(logging.INFO, logger="torchtitan_autoparallel")
    first, calls = _run(tmp_path, settings, built, solution)
    assert calls == 1 and "plan cache miss" in caplog.text
    caplog.clear()
    second, calls = _run(tmp_path, settings, built, solution)
    assert calls == 0
    assert "plan cache hit" in caplog.text and "solve skipped" in caplog.text
    np.testing.assert_array_equal(second.assignment, first.assignment)
    assert second.objective == pytest.approx(first.objective, rel=1e-12)
    assert (second.solver, second.status) == (first.solver, first.status)
    assert not list(tmp_path.glob("*.tmp"))  # the atomic write left no temporary behind


def test_the_recomputation_a_solve_chose_comes_back_from_the_cache(planned, tmp_path):
    """activation_checkpoint auto's solve answers each block's mode beside the placements:
    a cache hit must answer the same, or the ranks would trace another step."""
    built, solution, settings = planned
    chose = dataclasses.replace(solution, block_recompute=("full", "none"),
                                memory_fit={"recompute_us": 12.5, "unbounded_peak_bytes": 1e6})
    _run(tmp_path, settings, built, chose)
    hit, calls = _run(tmp_path, settings, built, chose)
    assert calls == 0 and hit.block_recompute == ("full", "none")
    assert hit.memory_fit == {"recompute_us": 12.5, "unbounded_peak_bytes": 1e6}


@pytest.mark.parametrize("change", [{"memory_budget_gib": 40.0}, {"global_batch_size": 8}, {"seq_len": 64}])
def test_a_changed_setting_changes_the_key_and_plans_again(planned, tmp_path, change):
    built, solution, settings = planned
    _run(tmp_path, settings, built, solution)
    changed = {**settings, **change}
    assert cache_key(built, changed) != cache_key(built, settings)
    _, calls = _run(tmp_path, changed, built, solution)
    assert calls == 1
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_settings_are_plain_json_and_profile_is_priced_by_its_numbers(mesh):
    settings = plan_settings(mesh, OPTIONS.replace(param_dtype=torch.bfloat16, export_problem="x.npz"))
    json.dumps(settings)  # a key must hash the same in every process
    assert settings["param_dtype"] == "torch.bfloat16" and "export_problem" not in settings
    assert settings["profile"]["peak_tflops"] == OPTIONS.profile.to_dict()["peak_tflops"]
    assert settings["mesh_shape"] == [dist.get_world_size()] and settings["mesh_dim_names"] == ["dp_shard"]


def _corrupt_bytes(path: Path, built: BuiltProblem) -> str:
    path.write_bytes(b"\x00\xffnot json at all\x9c")
    return "unreadable"


def _wrong_format(path: Path, built: BuiltProblem) -> str:
    entry = json.loads(path.read_text())
    entry["format_version"] = cache.FORMAT_VERSION + 1
    path.write_text(json.dumps(entry))
    return "format_version"


def _other_version(path: Path, built: BuiltProblem) -> str:
    entry = json.loads(path.read_text())
    entry["package_version"] = "0.0.0-elsewhere"
    path.write_text(json.dumps(entry))
    return "written by version"


def _short_assignment(path: Path, built: BuiltProblem) -> str:
    entry = json.loads(path.read_text())
    entry["assignment"] = entry["assignment"][:-1]
    path.write_text(json.dumps(entry))
    return "nodes"


@pytest.mark.parametrize("spoil", [_corrupt_bytes, _wrong_format, _other_version, _short_assignment])
def test_a_bad_entry_is_ignored_with_a_warning_and_replanned(planned, tmp_path, caplog, spoil: Callable):
    built, solution, settings = planned
    _run(tmp_path, settings, built, solution)
    path = _entry(tmp_path, built, settings)
    reason = spoil(path, built)
    with caplog.at_level(logging.WARNING, logger="torchtitan_autoparallel"):
        result, calls = _run(tmp_path, settings, built, solution)
    assert calls == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "ignored" in warnings[0] and "planning again" in warnings[0]
    assert reason in warnings[0] and str(path) in warnings[0]
    np.testing.assert_array_equal(result.assignment, solution.assignment)
    # The fresh solution replaced the bad entry: the next start-up is a hit again.
    _, calls = _run(tmp_path, settings, built, solution)
    assert calls == 0


def test_an_entry_priced_by_other_tables_is_ignored(planned, tmp_path, caplog):
    """Same key, changed cost model: the stored objective no longer matches this run's tables."""
    built, solution, settings = planned
    _run(tmp_path, settings, built, solution)
    problem = built.problem
    repriced = dataclasses.replace(problem, unary=[u * 1.5 + 1.0 for u in problem.unary])
    rebuilt = dataclasses.replace(built, problem=repriced)
    assert cache_key(rebuilt, settings) == cache_key(built, settings)  # costs are not in the key
    new_solution = dataclasses.replace(solution, objective=repriced.energy(solution.assignment))
    with caplog.at_level(logging.WARNING, logger="torchtitan_autoparallel"):
        _, calls = _run(tmp_path, settings, rebuilt, new_solution)
    assert calls == 1
    assert "objective" in caplog.text and "planning again" in caplog.text


def test_no_folder_means_no_cache(planned, tmp_path):
    built, solution, settings = planned
    hook = cached_solve_hook(None, settings)
    counting = CountingSolve(solution)
    hook(built, counting)
    hook(built, counting)
    assert counting.calls == 2 and not list(tmp_path.iterdir())
