"""The plan's predicted step time beside the measured one, and the plan in TensorBoard.

A unit test of ``MetricsLogger`` with a plan attached, and one 2-rank training
run of the automatic model through ``./run_train.sh`` that must write
plan.html, the plan-check fields in metrics.jsonl and the TensorBoard plan.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _run import CONFIGS, check_records, read_metrics, run_launcher
from torch import fx

from torchtitan_autoparallel.execute.graph_cost import GraphCost, graph_cost
from torchtitan_autoparallel.planner.cost.cost_model import collective_time_us
from torchtitan_autoparallel.planner.cost.profiles import Link, load_profile
from torchtitan_autoparallel.planner.cost.step_terms import add_step_terms
from torchtitan_autoparallel.planner.plan.plan import Collective, Plan
from torchtitan_autoparallel.report.common import predicted_step_us
from torchtitan_autoparallel.train.metrics import MetricsLogger, Peak
from torchtitan_autoparallel.train.plan_check import CALIBRATE_HINT, WARMUP_STEPS, PlanCheck

PLAN_TAGS = {"plan/predicted_compute_ms", "plan/predicted_comm_ms", "plan/predicted_overlap_ms", "plan/predicted_step_ms",
             "plan/predicted_host_ms", "plan/predicted_alloc_ms", "plan/predicted_optimizer_ms"}
TERM_KEYS = ("predicted_compute_s", "predicted_comm_s", "predicted_host_s", "predicted_alloc_s", "predicted_optimizer_s")
# A calibrated-looking profile: 10 us per node; 100 us per tensor + 1 ns per element + 2 ms per step.
STEP_PROFILE = replace(load_profile("cpu_gloo"), host_us_per_node=10.0, alloc_us_per_byte=1e-3, optimizer_us_per_tensor=100.0,
                       optimizer_us_per_element=1e-3, optimizer_fixed_us=2000.0,
                       intra_node=Link(latency_us=100.0, bandwidth_GBps=1.0, call_overhead_us=3000.0))


def _toy_plan() -> Plan:
    return Plan(
        mesh={"names": ["dp_shard"], "sizes": [2]},
        parameters={"layers.0.attention.wq.weight": ["S(0)"], "layers.1.attention.wq.weight": ["S(0)"], "norm.weight": ["R"]},
        nodes={},
        collectives=[Collective("all_gather", "dp_shard", 4096.0, 30.0, 2, "parameter")],
        predicted={"compute_us": 1500.0, "comm_us": 500.0, "total_us": 2000.0, "param_bytes_per_device": 8192.0,
                   "peak_activation_bytes_per_device": 65536.0},
        replicated_ops=[],
        objective=2000.0,
        lower_bound=2000.0,
        solver="ilp-highs",
        status="optimal",
    )


def test_measured_is_the_median_after_the_warm_up_steps() -> None:
    check = PlanCheck.of(_toy_plan())
    assert check.predicted_step_s == pytest.approx(2e-3)
    for seconds in (9.0, 5.0):
        check.add_step(seconds)
        assert "measured_step_s" not in check.fields()
    assert "no steady state" in check.summary()
    for seconds in (0.003, 0.005):
        check.add_step(seconds)
    f = check.fields()
    assert WARMUP_STEPS == 2 and f["measured_step_s"] == pytest.approx(0.004)
    assert f["measured_over_predicted"] == pytest.approx(2.0)
    assert "median of steps 3-4" in check.summary() and "measured/predicted 2.00" in check.summary()
    check.add_step(0.9)  # one step slowed by other work moves the median, not to 0.303 s as a mean would
    assert check.fields()["measured_step_s"] == pytest.approx(0.005)


@pytest.mark.parametrize("step_s,hinted", [(0.004, False), (0.001, False), (0.0041, True), (0.00099, True)])
def test_a_step_far_from_the_plan_names_the_calibrator(step_s: float, hinted: bool) -> None:
    # within 2x either way of the 2 ms prediction the summary is the plain ratio
    check = PlanCheck.of(_toy_plan())
    for seconds in (9.0, 5.0, step_s):
        check.add_step(seconds)
    summary = check.summary()
    assert (CALIBRATE_HINT in summary) == hinted, summary
    assert summary.endswith(f"measured/predicted {step_s / 2e-3:.2f}" + (f"; {CALIBRATE_HINT}" if hinted else ""))


def test_gradient_accumulation_repeats_all_but_the_optimizer() -> None:
    plan = _toy_plan()
    shapes = {"layers.0.attention.wq.weight": (64, 32), "layers.1.attention.wq.weight": (64, 32), "norm.weight": (32,)}
    add_step_terms(plan, shapes, graph_nodes=500, profile=STEP_PROFILE)
    one, three = PlanCheck.of(plan), PlanCheck.of(plan, micro_batches=3)
    optimizer_s = one.terms.optimizer_us / 1e6
    assert optimizer_s > 0
    assert three.predicted_step_s == pytest.approx(3 * (one.predicted_step_s - optimizer_s) + optimizer_s)
    assert "3 micro-batches x (compute" in three.terms_text() and "micro-batches" not in one.terms_text()
    assert three.fields()["micro_batches"] == 3 and "micro_batches" not in one.fields()


def test_plan_predicts_host_and_optimizer_time_from_its_placements() -> None:
    plan = _toy_plan()
    shapes = {"layers.0.attention.wq.weight": (64, 32), "layers.1.attention.wq.weight": (64, 32), "norm.weight": (32,)}
    add_step_terms(plan, shapes, graph_nodes=500, profile=STEP_PROFILE)
    p = plan.predicted
    elements = 2 * 64 * 32 / 2 + 32  # two weights sharded over 2 ranks, the norm replicated
    assert p["optimizer_elements"] == elements and p["optimizer_tensors"] == 3
    assert p["optimizer_us"] == pytest.approx(3 * 100.0 + elements * 1e-3 + 2000.0)
    assert p["host_us"] == pytest.approx(500 * 10.0)
    assert predicted_step_us(plan) == pytest.approx(2000.0 + p["host_us"] + p["optimizer_us"])
    check = PlanCheck.of(plan)
    assert check.predicted_step_s == pytest.approx(predicted_step_us(plan) / 1e6)
    f = check.fields()
    assert f["predicted_step_s"] == pytest.approx(sum(f[k] for k in TERM_KEYS))
    # The compiled graph's cost replaces the plan's communication and host estimates, not the rest.
    check.use_graph(GraphCost(nodes=2000, collectives={"all_gather": 2}, comm_us=7000.0, fresh_bytes=1e6), STEP_PROFILE)
    f = check.fields()
    assert f["predicted_comm_s"] == pytest.approx(7e-3) and f["predicted_host_s"] == pytest.approx(2000 * 10e-6)
    assert f["predicted_alloc_s"] == pytest.approx(1e6 * 1e-3 / 1e6)  # first touch of 1 MB of fresh outputs
    assert f["predicted_step_s"] == pytest.approx(sum(f[k] for k in TERM_KEYS))
    assert f["predicted_compute_s"] == pytest.approx(1.5e-3) and f["predicted_optimizer_s"] == pytest.approx(p["optimizer_us"] / 1e6)
    assert "from the compiled graph" in check.summary()


def _fake_mesh(group_name: str, size: int):
    return SimpleNamespace(mesh=torch.empty(size), ndim=1, size=lambda dim: size,
                           get_group=lambda dim: SimpleNamespace(group_name=group_name))


def test_graph_cost_prices_the_collectives_and_counts_the_nodes_the_executor_runs() -> None:
    """A bucketed all-gather of 1024 floats over 4 ranks, a wait, a view, a split, a getitem (no call), a mul."""
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(256)
    gathered = g.call_function(torch.ops._c10d_functional.all_gather_into_tensor.default, (x, 4, "g0"))
    gathered.meta["val"] = torch.empty(1024)
    done = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (gathered,))
    view = g.call_function(torch.ops.aten.view.default, (done, [32, 32]))
    pair = g.call_function(torch.ops.aten.split.Tensor, (view, 16))
    half = g.call_function(operator.getitem, (pair, 0))
    scaled = g.call_function(torch.ops.aten.mul.Scalar, (half, 2.0))
    scaled.meta["val"] = torch.empty(16, 32)
    g.output(scaled)
    cost = graph_cost(fx.GraphModule(torch.nn.Module(), g), _fake_mesh("g0", 4), STEP_PROFILE)
    assert cost.nodes == 5 and cost.collectives == {"all_gather": 1}
    # Fresh memory: the gathered buffer and the product; the wait, the view and the split alias their inputs.
    assert cost.fresh_bytes == 4096.0 + 16 * 32 * 4
    assert cost.comm_us == pytest.approx(collective_time_us("all_gather", 4096.0, 4, STEP_PROFILE.intra_node))
    assert cost.comm_us > 3000.0  # the per-call cost is in it
    with pytest.raises(ValueError, match="no dim of the mesh"):
        graph_cost(fx.GraphModule(torch.nn.Module(), g), _fake_mesh("other", 4), STEP_PROFILE)


def _events(folder: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"images": 0, "tensors": 0, "scalars": 0})
    acc.Reload()
    return acc


def _check_tensorboard(folder: Path, plan: Plan, records: list[dict]) -> None:
    acc = _events(folder)
    tags = acc.Tags()
    assert PLAN_TAGS <= set(tags["scalars"]), tags["scalars"]
    step_ms = acc.Scalars("plan/predicted_step_ms")[0].value
    assert step_ms == pytest.approx(predicted_step_us(plan) / 1e3, rel=1e-6)
    # The last value is the prediction the records carry (repriced from the compiled graph in a training run).
    assert acc.Scalars("plan/predicted_step_ms")[-1].value == pytest.approx(records[-1]["predicted_step_s"] * 1e3, rel=1e-5)
    assert acc.Scalars("plan/predicted_overlap_ms")[0].value == 0.0
    assert "plan/table/text_summary" in tags["tensors"], tags
    text = acc.Tensors("plan/table/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "sharding plan on mesh" in text
    assert text.index("what this plan is:") < text.index("sharding plan on mesh")  # the words lead
    assert tags["images"] == ["plan/figure"]
    image = acc.Images("plan/figure")[0]
    assert image.width > 300 and image.height > 100 and image.encoded_image_string.startswith(b"\x89PNG")
    measured = [r["measured_step_s"] for r in records if "measured_step_s" in r]
    assert acc.Scalars("plan/measured_step_ms")[-1].value == pytest.approx(measured[-1] * 1e3, rel=1e-5)
    assert {"train/predicted_step_s", "train/measured_step_s", "train/measured_over_predicted"} <= set(tags["scalars"])


def test_metrics_logger_writes_the_plan_and_the_check(tmp_path: Path, caplog) -> None:
    plan = _toy_plan()
    logger = MetricsLogger(str(tmp_path), flops_per_token=1.0, peak=Peak(1.0, "test"), world_size=1,
                           device=torch.device("cpu"), writes=True, tensorboard_folder=str(tmp_path / "tb"))
    logger.attach_plan(plan)
    with caplog.at_level("INFO", logger="torchtitan_autoparallel"):
        for step in range(1, 5):
            logger.add_tokens(8)
            logger.log(step, 1.0, 1.0, 1e-3)
        logger.close()
    records = read_metrics(tmp_path)
    assert all(r["predicted_step_s"] == pytest.approx(2e-3) for r in records)
    assert ["measured_step_s" in r for r in records] == [False, False, True, True]
    last = records[-1]
    assert last["measured_over_predicted"] == pytest.approx(last["measured_step_s"] / 2e-3)
    assert "plan check: predicted 2.000 ms/step" in caplog.text
    _check_tensorboard(tmp_path / "tb", plan, records)


@pytest.mark.multirank
def test_auto_training_run_checks_its_plan(tmp_path: Path) -> None:
    steps = 5
    args = [
        "--model.name", "llama3_auto_parallel", "--job.dump_folder", tmp_path,
        "--training.steps", steps, "--training.seq_len", 64, "--training.local_batch_size", 2,
        "--metrics.enable_tensorboard", "true", "--metrics.peak_tflops", 1,
    ]
    run = run_launcher(args, ngpu=2, config=CONFIGS["llama3"])
    assert run.returncode == 0, run.tail()
    out = run.stdout + run.stderr
    assert "plan check: predicted" in out and "(median of steps 3-5)" in out, run.tail()
    assert (tmp_path / "plan.html").read_text().startswith("<!doctype html>")
    records = read_metrics(tmp_path)
    check_records(records, steps)
    plan = Plan.from_json(tmp_path / "plan.json")
    # Repriced from the compiled graph in step 1: the plan's compute, the graph's collectives.
    assert "predicted step repriced from the compiled graph" in out, run.tail()
    for r in records:
        assert r["predicted_step_s"] == pytest.approx(sum(r[k] for k in TERM_KEYS), rel=1e-9)
        assert r["predicted_compute_s"] == pytest.approx(plan.predicted["compute_us"] / 1e6, rel=1e-9)
        assert r["predicted_comm_s"] > 0
    assert [r["step"] for r in records if "measured_step_s" in r] == [3, 4, 5]
    assert records[-1]["measured_over_predicted"] > 0
    _check_tensorboard(tmp_path / "tb", plan, records)
    assert json.loads((tmp_path / "plan.json").read_text())["predicted"]["peak_activation_bytes_per_device"] > 0
    _check_executed_collectives(plan, out, run, tmp_path / "plan.html")


def _check_executed_collectives(plan: Plan, out: str, run, page: Path) -> None:
    """plan.json lists, per kind, as many collectives as the compiled step's graph calls
    (its compile log line), and fewer than the plan's one-per-tensor where bucketing merged."""
    logged = re.search(r"compiled into a local-tensor graph in [\d.]+ s \(\d+ nodes; collectives (\{[^}]*\})\)", out)
    assert logged, run.tail()
    in_graph = ast.literal_eval(logged.group(1))
    executed: dict[str, int] = {}
    for c in plan.executed_collectives:
        executed[c["kind"]] = executed.get(c["kind"], 0) + c["count"]
    assert executed == in_graph and executed, (executed, in_graph)
    merged = re.search(r"bucketing: (.*)", out).group(1)
    for kind, before, after in re.findall(r"(\w+) (\d+) -> (\d+)", merged):
        assert executed.get(kind, 0) == int(after) and int(after) <= int(before), merged
    assert "collectives per step as executed, after bucketing" in out
    assert '<table id="executed"' in page.read_text()
