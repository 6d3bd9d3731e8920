"""activation_checkpoint = "auto": each block's recomputation chosen by the solve that fits the
device, against resharding, and the chosen modes traced and planned."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from torch.distributed.device_mesh import init_device_mesh

from torchtitan_autoparallel.config import load_config
from torchtitan_autoparallel.errors import ConfigError
from torchtitan_autoparallel.launch.preflight import check
from torchtitan_autoparallel.models.registry import build_meta_model
from torchtitan_autoparallel.planner.cost.profiles import load_profile
from torchtitan_autoparallel.planner.plan.api import (
    FIT_RESERVE,
    RECOMPUTE_TRACES,
    NothingFits,
    plan_stages,
    plan_training_step,
)
from torchtitan_autoparallel.planner.plan.options import PlannerOptions
from torchtitan_autoparallel.planner.plan.peak_rows import StepMemory
from torchtitan_autoparallel.planner.plan.plan import Plan
from torchtitan_autoparallel.planner.plan.recompute_choice import JointMemory, recompute_choice
from torchtitan_autoparallel.planner.problem.problem import InfeasibleProblem
from torchtitan_autoparallel.report.common import fmt_bytes
from torchtitan_autoparallel.report.words import plan_words

GIB = 2**30
pytestmark = pytest.mark.usefixtures("fake_world")


def _planner(mesh_dim: str):
    """Plans of the 4-block debug model over 8 ranks of ``mesh_dim``, by mode and device memory."""
    model = build_meta_model("llama3", "debugmodel", n_layers=4)
    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=(mesh_dim,))

    def plan(mode: str, device_gib: float | None = None) -> Plan:
        return plan_training_step(model, mesh, global_batch_size=8, seq_len=256, profile=load_profile("h100"),
                                  activation_checkpoint=mode, device_memory_gib=device_gib)

    return plan


@pytest.fixture(scope="module")
def plans() -> dict:
    plan = _planner("dp_shard")
    none, full = plan("none"), plan("full")
    # below full recomputation's own peak: no plan without recomputation gets there
    squeezed = 0.9 * full.predicted["peak_bytes_per_device"]
    return {"plan": plan, "none": none, "full": full, "usable": squeezed, "auto": plan("auto", _device_gib(squeezed))}


def _device_gib(usable_bytes: float) -> float:
    """The device memory whose usable part (less the reserve) is ``usable_bytes``."""
    return usable_bytes / (1 - FIT_RESERVE) / GIB


def test_without_pressure_auto_recomputes_nothing(plans) -> None:
    none = plans["none"]
    auto = plans["plan"]("auto", _device_gib(2 * none.predicted["peak_bytes_per_device"]))
    assert auto.activation_checkpoint == "none" and [t["traced"] for t in auto.recompute_choice["tried"]] == ["none"]
    assert auto.objective == pytest.approx(none.objective)


def test_a_device_the_plain_step_overflows_gets_recomputation(plans) -> None:
    none, full = plans["none"].predicted["peak_bytes_per_device"], plans["full"].predicted["peak_bytes_per_device"]
    assert full < none
    usable, auto = plans["usable"], plans["auto"]
    assert set(auto.block_recompute or [auto.activation_checkpoint]) - {"none"}
    # the solve on the plain trace chose the recomputation, and its trace was planned after
    tried = auto.recompute_choice["tried"]
    assert tried[0]["traced"] == "none" and tried[-1]["traced"] == auto.activation_checkpoint
    assert 2 <= len(tried) <= RECOMPUTE_TRACES + 1
    assert auto.recompute_choice["unbounded_peak_bytes"] == pytest.approx(none)
    assert auto.predicted["peak_bytes_per_device"] <= usable
    # recomputation costs step time: the plan is dearer than the one that does not fit
    assert auto.objective > plans["none"].objective


def test_a_device_just_over_full_recomputation_costs_less_than_full_recomputation(plans) -> None:
    """Between full recomputation's peak and the plain step's, the solve keeps fewer copies
    alive or recomputes only some blocks: either is cheaper than recomputing all."""
    none, full = plans["none"], plans["full"]
    usable = 1.02 * full.predicted["peak_bytes_per_device"]
    auto = plans["plan"]("auto", _device_gib(usable))
    assert auto.predicted["peak_bytes_per_device"] <= usable < none.predicted["peak_bytes_per_device"]
    assert none.objective < auto.objective < full.objective


def test_a_device_met_by_resharding_alone_recomputes_nothing(plans) -> None:
    """A quarter of the way from full recomputation's peak to the plain step's, keeping
    weights sharded through the backward fits for less step time than any recomputation."""
    none, full = plans["none"], plans["full"]
    usable = full.predicted["peak_bytes_per_device"] + 0.25 * (
        none.predicted["peak_bytes_per_device"] - full.predicted["peak_bytes_per_device"])
    auto = plans["plan"]("auto", _device_gib(usable))
    assert auto.activation_checkpoint == "none" and auto.memory_fit["fits"] == 1.0
    assert auto.predicted["peak_bytes_per_device"] <= usable and auto.objective < full.objective
    said = " ".join(plan_words(auto))
    assert "Recomputes nothing" in said and "once resharded" in said and "The cheapest plan would peak at" in said


def test_recomputing_some_blocks_only_is_cheaper_than_all() -> None:
    """Over DDP no resharding saves memory: a device just under the plain step's peak is met
    by recomputing some blocks only, for less step time than recomputing all."""
    plan = _planner("dp_replicate")
    none, selective = plan("none"), plan("selective")
    usable = 1.1 * selective.predicted["peak_bytes_per_device"]
    assert usable < none.predicted["peak_bytes_per_device"]
    auto = plan("auto", _device_gib(usable))
    assert "none" in auto.block_recompute and set(auto.block_recompute) - {"none"}
    assert auto.predicted["peak_bytes_per_device"] <= usable and not auto.memory_fit
    assert none.objective < auto.objective < selective.objective
    said = " ".join(plan_words(auto))
    assert "Recomputes " in said and "nothing of block" in said, said
    assert "the solve that fits the step's peak chose this, block by block" in said


@pytest.mark.parametrize("mesh_dim", ["dp_replicate", "dp_shard"])
def test_full_recomputation_priced_on_the_plain_trace_walks_as_its_own_trace(mesh_dim: str) -> None:
    """The solve prices each block's recomputation on the trace without it; at the plain
    plan's placements, recomputing every block fully is predicted to peak as the full
    trace's plan does (DDP: its step time too, within what the full plan re-places)."""
    model = build_meta_model("llama3", "debugmodel", n_layers=4)
    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=(mesh_dim,))
    options = PlannerOptions(global_batch_size=8, seq_len=256, profile=load_profile("h100"))
    plain, full = plan_stages(model, mesh, options), plan_stages(model, mesh, options.replace(activation_checkpoint="full"))
    choice = recompute_choice(plain.built, plain.traced, plain.solution.assignment)
    assert [b.options for b in choice.blocks] == [("none", "selective", "full")] * 4
    all_full = np.concatenate([plain.solution.assignment, np.full(len(choice.blocks), 2)])
    walk = JointMemory(plain.built, plain.traced, all_full, choice)
    predicted = walk.peak
    assert predicted == pytest.approx(full.plan.predicted["peak_bytes_per_device"], rel=0.01)
    assert predicted < plain.plan.predicted["peak_bytes_per_device"]
    # and at the end of the forward, where only the blocks' inputs are kept
    traced_full = StepMemory(full.built, full.traced, full.solution.assignment)
    at_loss = [list(step.graph.graph.nodes).index(step.loss) for step in (plain.traced, full.traced)]
    assert walk.totals[at_loss[0]] == pytest.approx(traced_full.totals[at_loss[1]], rel=0.01)
    assert walk.totals[at_loss[0]] < StepMemory(plain.built, plain.traced, plain.solution.assignment).totals[at_loss[0]]
    if mesh_dim == "dp_replicate":
        priced = sum(cost[2] for cost in choice.cost_us)
        assert priced == pytest.approx(full.plan.objective - plain.plan.objective, rel=0.15)
        # a solve recomputing block 2 is read as the first block priced alike, whose
        # activations live longer: the same step time, less memory at every position
        alike = [i for i, cost in enumerate(choice.cost_us) if np.allclose(cost, choice.cost_us[2])]
        only_block_2 = np.concatenate([plain.solution.assignment, [0, 0, 2, 0]])
        modes = choice.modes(only_block_2, 4, plain.traced)
        assert alike[0] < 2 and modes.index("full") == alike[0] and modes.count("full") == 1


def test_when_nothing_fits_the_error_names_the_smallest_peak_and_the_knobs(plans) -> None:
    full = plans["full"].predicted["peak_bytes_per_device"]
    with pytest.raises(NothingFits) as e:
        plans["plan"]("auto", _device_gib(full / 3))
    message = str(e.value)
    least = float(re.search(r"with full recomputation the step peaks at ([0-9.]+) GiB", message).group(1))
    assert full / 3 / GIB < least <= full / GIB + 0.005 and "\n" not in message
    for knob in ("more ranks", "training.local_batch_size", "data_parallel_replicate_degree"):
        assert knob in message


def test_auto_is_refused_for_a_hand_written_plan(tmp_path: Path) -> None:
    job = load_config(["--job.dump_folder", str(tmp_path), "--model.name", "llama3",
                       "--activation_checkpoint.mode", "auto"])
    with pytest.raises(ConfigError, match="activation_checkpoint.mode = 'auto'.*accepted for it: none, full, selective"):
        check(job, 1)


def test_the_plan_says_what_it_recomputes_and_why(plans) -> None:
    said = " ".join(plan_words(plans["auto"]))
    assert "the cheapest plan without recomputation peaks at" in said
    assert fmt_bytes(plans["none"].predicted["peak_bytes_per_device"]) in said
    assert "priced the recomputation at" in said and "trace(s) planned" in said
    assert not any("Recomputes" in s for s in plan_words(plans["none"]))  # asked for nothing, nothing said
    assert "(activation_checkpoint.mode = full)" in " ".join(plan_words(plans["full"]))


def test_a_budget_of_six_tenths_of_the_free_peak_is_met(plans) -> None:
    """memory_budget_gib bounds the whole peak: at 0.6 of the default plan's the plan fits,
    without recomputation. (A given budget also frees the parameters from being sharded
    fully, so the plan may be cheaper than the default's: here it is.)"""
    none = plans["none"]
    budget = 0.6 * none.predicted["peak_bytes_per_device"]
    fitted = plan_training_step(build_meta_model("llama3", "debugmodel", n_layers=4),
                                init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",)),
                                global_batch_size=8, seq_len=256, profile=load_profile("h100"),
                                memory_budget_gib=budget / GIB)
    assert fitted.predicted["peak_bytes_per_device"] <= budget
    assert fitted.activation_checkpoint == "none"


def test_a_budget_no_plan_meets_is_one_line_naming_the_lowest_peak(plans) -> None:
    full = plans["full"].predicted["peak_bytes_per_device"]
    with pytest.raises(InfeasibleProblem) as e:
        plan_training_step(build_meta_model("llama3", "debugmodel", n_layers=4),
                           init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",)),
                           global_batch_size=8, seq_len=256, profile=load_profile("h100"),
                           memory_budget_gib=full / 3 / GIB)
    message = str(e.value)
    assert "\n" not in message and f"within the memory budget of {full / 3 / GIB:.2f} GiB" in message
    assert "the lowest found peaks at" in message and "activation_checkpoint.mode = full or auto" in message


def test_an_overlap_plan_is_fitted_too() -> None:
    """With [autoparallel] overlap the cheapest plan is fitted to the device as well; the
    rows' solves price the step without the overlap (the price is read from the tables)."""
    model = build_meta_model("llama3", "debugmodel", n_layers=2)
    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",))
    options = dict(global_batch_size=8, seq_len=256, profile=load_profile("h100"), overlap=True)
    free = plan_training_step(model, mesh, **options)
    usable = 0.8 * free.predicted["peak_bytes_per_device"]
    fitted = plan_training_step(model, mesh, device_memory_gib=_device_gib(usable), **options)
    assert fitted.predicted["peak_bytes_per_device"] <= usable and fitted.memory_fit["fits"] == 1.0
    assert fitted.memory_fit["unbounded_peak_bytes"] == pytest.approx(free.predicted["peak_bytes_per_device"])
    assert fitted.objective > fitted.memory_fit["unbounded_objective"]  # fitting costs step time
    assert "effective_us" in fitted.predicted  # the overlap is still predicted for the plan kept
