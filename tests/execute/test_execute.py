"""The executor runs a plan as planned, with the numerics of one device.

Multi-rank tests launch ``torchtitan_autoparallel.execute.parity`` through the
trainer's launcher (torchrun) on gloo (LLaMA3 debug model, 2 layers, fp32,
batch 4 x seq 32, 3 AdamW steps) and compare its per-step losses with an
unsharded eager run in this process. The unit tests run in this process on a
fake process group.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from torchtitan_autoparallel.execute import kernels
from torchtitan_autoparallel.execute.audit import executed_collectives, expected_collectives
from torchtitan_autoparallel.execute.layout import match_layout, physical_order
from torchtitan_autoparallel.execute.parity import ParityConfig, parse_mesh, reference_losses
from torchtitan_autoparallel.execute.redistribute import redistribute_to
from torchtitan_autoparallel.planner.plan.agree import Fingerprint, first_difference
from torchtitan_autoparallel.planner.plan.plan import Collective, Plan

REL_TOL = 1e-4
RUN_TIMEOUT_S = 420

# ---------------------------------------------------------------- multi-rank parity


_references: dict[str, list[float]] = {}


def reference(family: str) -> list[float]:
    if family not in _references:
        _references[family] = reference_losses(ParityConfig(family=family))
    return _references[family]


_runs: dict[tuple, dict] = {}


def run_parity(mesh: str, *flags: str, tmp: Path) -> dict:
    """rank 0's JSON of a torchrun job (memoised: the FSDP job serves two tests)."""
    key = (mesh, flags)
    if key not in _runs:
        _, sizes = parse_mesh(mesh)
        out = tmp / f"parity_{len(_runs)}.json"
        # run_train.sh's launcher: on CPU its ranks are forked, already holding torch
        cmd = [
            sys.executable, "-m", "torchtitan_autoparallel.launch.launch", "--ngpu", str(math.prod(sizes)),
            "--standalone", "--", "-m", "torchtitan_autoparallel.execute.parity", "--mesh", mesh, "--out", str(out),
            *flags,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        if not out.exists():
            pytest.fail(f"the {mesh} job wrote no result (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
        _runs[key] = json.loads(out.read_text())
    return _runs[key]


MESHES = {
    # Audited, then trained through the re-traced local graph (compiled.py).
    "fsdp2": ("dp_shard=2", ("--audit", "--compile", "1")),
    "tp2": ("tp=2", ()),
    # Each rank fed its own slice of the batch (step_local), as the trainer's dataloader does,
    # through the re-traced local graph.
    "fsdp2_tp2": ("dp_shard=2,tp=2", ("--local-batch", "1", "--compile", "1")),
    # Qwen3 (grouped-query attention) with attention through the stand-ins a GPU runs.
    "qwen3_fsdp2_tp2_portable": ("dp_shard=2,tp=2", ("--family", "qwen3", "--portable-kernels", "1")),
    # Each block's forward recomputed in the backward, the collectives bucketed and overlapped:
    # the gradients reduce-scattered as the backward makes them, beside the recomputation's gathers.
    "fsdp2_ac_full": ("dp_shard=2", ("--activation-checkpoint", "full", "--compile", "1",
                                     "--bucket-collectives", "1", "--overlap-execution", "1")),
    # The 3-D mesh (HSDP x TP on 8 ranks) runs through the launcher in test_auto_parity.py.
}


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(MESHES))
def test_losses_equal_single_device(name, tmp_path_factory):
    mesh, flags = MESHES[name]
    reference_losses_ = reference("qwen3" if "qwen3" in name else "llama3")
    result = run_parity(mesh, *flags, tmp=tmp_path_factory.mktemp(name))
    assert "error" not in result, result["error"]
    print(f"\n{name}: losses {result['losses']} (reference {reference_losses_})")
    print(f"{name}: plan {result['plan_timings']}, steps {result['step_seconds']}")
    assert len(result["losses"]) == len(reference_losses_)
    for step, (got, want) in enumerate(zip(result["losses"], reference_losses_)):
        assert abs(got - want) <= REL_TOL * abs(want), f"step {step}: {got} vs {want}"
    # Only ops DTensor has no (or another) strategy for run on local shards.
    assert set(result["local_ops"]) <= {
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
        "aten.nll_loss_forward.default",
    }


@pytest.mark.multirank
def test_a_plan_fitted_to_a_small_device_trains_as_one_device(tmp_path_factory):
    """FSDP 2 planned for a device holding 0.97 of the unbounded plan's peak: the solve
    keeps weights sharded through the backward (dearer, smaller), and the losses stay
    the 1-rank run's. Sequence 128: at 32 the peak is the parameters' state, which no plan
    shrinks."""
    result = run_parity("dp_shard=2", "--seq-len", "128", "--fit-share", "0.97",
                        tmp=tmp_path_factory.mktemp("fit"))
    assert "error" not in result, result["error"]
    fit = result["fit"]
    print(f"\nfit: {fit}")
    assert fit["peak"] <= fit["usable"] < fit["free_peak"]
    assert fit["objective"] > fit["free_objective"]
    want = reference_losses(ParityConfig(seq_len=128))
    for step, (got, ref) in enumerate(zip(result["losses"], want, strict=True)):
        assert abs(got - ref) <= REL_TOL * abs(ref), f"step {step}: {got} vs {ref}"


@pytest.mark.multirank
def test_a_plan_recomputing_one_block_of_two_trains_as_one_device(tmp_path_factory):
    """activation_checkpoint = "auto" may recompute the first blocks only: block 0 fully,
    block 1 not at all, planned and run over FSDP 2, gives the 1-rank run's losses."""
    result = run_parity("dp_shard=2", "--activation-checkpoint", "full,none", tmp=tmp_path_factory.mktemp("blocks"))
    assert "error" not in result, result["error"]
    want = reference_losses(ParityConfig())
    for step, (got, ref) in enumerate(zip(result["losses"], want, strict=True)):
        assert abs(got - ref) <= REL_TOL * abs(ref), f"step {step}: {got} vs {ref}"


@pytest.mark.multirank
def test_the_recomputation_the_solve_chose_trains_as_one_device(tmp_path_factory):
    """activation_checkpoint = "auto" over DDP 2 (no resharding saves memory there) on a
    device holding 0.85 of the plain step's peak: the solve recomputes some blocks, the
    chosen modes are traced and run, and the losses stay the 1-rank run's."""
    result = run_parity("dp_replicate=2", "--layers", "4", "--seq-len", "256", "--activation-checkpoint", "auto",
                        "--fit-share", "0.85", tmp=tmp_path_factory.mktemp("auto"))
    assert "error" not in result, result["error"]
    assert result["recompute"] not in ("", "none"), result["recompute"]
    fit = result["fit"]
    assert fit["peak"] <= fit["usable"] < fit["free_peak"]
    want = reference_losses(ParityConfig(layers=4, seq_len=256))
    for step, (got, ref) in enumerate(zip(result["losses"], want, strict=True)):
        assert abs(got - ref) <= REL_TOL * abs(ref), f"step {step}: {got} vs {ref}"


@pytest.mark.multirank
def test_audit_fsdp_executes_the_planned_collectives(tmp_path_factory):
    mesh, flags = MESHES["fsdp2"]
    result = run_parity(mesh, *flags, tmp=tmp_path_factory.mktemp("fsdp2"))
    assert "error" not in result, result["error"]
    print(f"\nexpected {result['expected']}\nexecuted {result['executed']}")
    assert result["expected"], "the FSDP plan should communicate"
    assert result["executed"] == result["expected"]
    # The re-traced local graph calls exactly the same collectives.
    assert result["compiled_collectives"] == result["expected"]


@pytest.mark.multirank
def test_ranks_with_different_problems_refuse_to_run(tmp_path_factory):
    result = run_parity("dp_shard=2", "--mismatch", "--steps", "1", tmp=tmp_path_factory.mktemp("mismatch"))
    error = result.get("error", "")
    assert error.startswith("PlanMismatch: rank 1 traced a different problem than rank 0"), error
    assert "node #" in error


# ---------------------------------------------------------------- in-process units


@pytest.fixture(scope="module")
def mesh2():
    """A 2-rank mesh on a fake process group: rank 0's view, collectives are no-ops."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    finally:
        if owned:
            dist.destroy_process_group()


def test_replicate_to_partial_is_local_and_exact(mesh2):
    x = torch.arange(6.0).view(2, 3)
    rep = distribute_tensor(x, mesh2, [Replicate()], src_data_rank=None)
    summed = redistribute_to(rep, mesh2, (Partial("sum"),))
    assert summed.placements == (Partial("sum"),)
    assert torch.equal(summed.to_local(), x)  # rank 0 keeps the value, the others zeros
    avg = redistribute_to(rep, mesh2, (Partial("avg"),))
    assert avg.placements == (Partial("avg"),) and torch.equal(avg.to_local(), x)
    # Shard -> Replicate still goes through DTensor.
    shard = distribute_tensor(x, mesh2, [Shard(0)], src_data_rank=None)
    assert redistribute_to(shard, mesh2, (Shard(0),)) is shard


def test_match_layout_restores_the_traced_dim_order(mesh2):
    traced = torch.empty(2, 4, 3, 5).transpose(1, 2)  # laid out as (2, 3, 4, 5)
    gathered = DTensor.from_local(torch.randn(2, 4, 3, 5), mesh2, [Replicate()], run_check=False)
    fixed = match_layout(gathered, traced)
    assert physical_order(fixed.to_local()) == physical_order(traced)
    assert torch.equal(fixed.to_local(), gathered.to_local())
    fixed.to_local().transpose(1, 2).view(2, 3, 20)  # the traced view is valid again
    already = DTensor.from_local(torch.randn(2, 3, 4, 5).transpose(1, 2), mesh2, [Replicate()], run_check=False)
    assert match_layout(already, traced) is already


def _fp(*entries) -> Fingerprint:
    return Fingerprint(repr(entries), tuple(entries))


def test_first_difference_names_the_node():
    a = _fp(("ps_0", "tok_embeddings.weight", 3, "aa"), ("mm", "aten.mm.default", 4, "bb"))
    b = _fp(("ps_0", "tok_embeddings.weight", 3, "aa"), ("mm", "aten.mm.default", 5, "cc"))
    assert first_difference(a, a) is None
    text = first_difference(a, b)
    assert "node #1" in text and "'mm'" in text and "4 strategies" in text and "5 strategies" in text
    short = _fp(("ps_0", "tok_embeddings.weight", 3, "aa"))
    assert "1 problem nodes here, 2 on rank 0" in first_difference(short, a)


def _plan(collectives: list[Collective]) -> Plan:
    return Plan(
        mesh={"names": ["dp_shard"], "sizes": [2]}, parameters={}, nodes={}, collectives=collectives,
        predicted={}, replicated_ops=[], objective=0.0, lower_bound=0.0, solver="test", status="optimal",
    )  # fmt: skip


def test_collective_kinds_are_compared_by_name():
    plan = _plan(
        [
            Collective("all_gather", "dp_shard", 1.0, 1.0, 3, "parameter"),
            Collective("reduce_scatter", "dp_shard", 1.0, 1.0, 2, "gradient"),
            Collective("all_to_all", "dp_shard", 1.0, 1.0, 1, "activation"),
        ]
    )
    assert expected_collectives(plan, "nccl") == Counter(all_gather=3, reduce_scatter=2, all_to_all=1)
    # gloo has no all-to-all: DTensor gathers and chunks instead.
    assert expected_collectives(plan, "gloo") == Counter(all_gather=4, reduce_scatter=2)
    counts = {
        torch.ops._c10d_functional.all_gather_into_tensor: 4,
        torch.ops._c10d_functional.reduce_scatter_tensor: 2,
        torch.ops._c10d_functional.all_reduce: 0,
    }
    assert executed_collectives(counts) == Counter(all_gather=4, reduce_scatter=2)


def test_portable_attention_matches_the_cpu_kernel():
    torch.manual_seed(0)
    q = torch.randn(2, 4, 8, 16, dtype=torch.float64)
    k, v = torch.randn(2, 2, 8, 16, dtype=torch.float64), torch.randn(2, 2, 8, 16, dtype=torch.float64)
    out, lse = kernels.CPU_FLASH(q, k, v, 0.0, True, scale=0.3)
    mine, _ = kernels.attention_forward(q, k, v, 0.0, True, scale=0.3)
    assert torch.allclose(mine, out) and physical_order(mine) == physical_order(out)
    # torchtitan's query is a transposed (B, L, H, D) tensor: the output follows it.
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert physical_order(kernels.attention_forward(qt, k, v, 0.0, True)[0]) == physical_order(kernels.CPU_FLASH(qt, k, v, 0.0, True)[0])
    grad_out = torch.randn_like(out)
    want = kernels.CPU_FLASH_BACKWARD(grad_out, q, k, v, out, lse, 0.0, True, scale=0.3)
    got = kernels.attention_backward(grad_out, q, k, v, out, torch.zeros_like(lse), 0.0, True, scale=0.3)
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.allclose(g, w)
    assert kernels.substitute(kernels.CPU_FLASH, "cpu") is None
    assert kernels.substitute(kernels.CPU_FLASH, "cuda") is kernels.attention_forward


def test_trace_devices_follow_the_shards():
    kwargs = {"dtype": torch.bfloat16, "device": torch.device("cpu")}
    assert kernels.retarget_device(kwargs, torch.device("cpu")) is kwargs
    moved = kernels.retarget_device(kwargs, torch.device("meta"))
    assert moved == {"dtype": torch.bfloat16, "device": torch.device("meta")}


def test_parameters_are_placed_as_planned_and_bound_to_a_model(mesh2):
    from torchtitan_autoparallel.execute.parity import full_model
    from torchtitan_autoparallel.execute.step import FullValues, build_executable
    from torchtitan_autoparallel.models.registry import build_meta_model
    from torchtitan_autoparallel.planner.cost.profiles import load_profile
    from torchtitan_autoparallel.planner.plan.api import ExecutablePlan
    from torchtitan_autoparallel.planner.plan.plan import plan_from_solution
    from torchtitan_autoparallel.planner.problem.build import build_problem
    from torchtitan_autoparallel.planner.solve import get_solver
    from torchtitan_autoparallel.planner.strategies.placement import placement_str
    from torchtitan_autoparallel.planner.strategies.strategy import enumerate_strategies
    from torchtitan_autoparallel.planner.trace.trace import trace_training_step

    traced = trace_training_step(build_meta_model("llama3", "debugmodel", n_layers=1), 4, 32)
    built = build_problem(traced, enumerate_strategies(traced, mesh2), load_profile("cpu_gloo"))
    solution = get_solver("ilp").solve(built.problem, 120)
    plan = plan_from_solution(solution, built, traced)
    full = full_model(ParityConfig(), layers=1)
    step = build_executable(ExecutablePlan(plan, traced, built, solution), mesh2, FullValues.of(full))
    for fqn, param in step.params.items():
        assert [placement_str(p) for p in param.placements] == plan.parameters[fqn], fqn
        # rank 0 keeps the first slice of the full init: no data moved, values unchanged
        want = full.get_parameter(fqn).detach()
        for p in param.placements:
            if isinstance(p, Shard):
                want = want.narrow(p.dim, 0, want.shape[p.dim] // 2)
        assert torch.equal(param.to_local(), want), fqn
    model = step.bind_to(build_meta_model("llama3", "debugmodel", n_layers=1))
    assert [n for n, _ in model.named_parameters()] == list(step.params)
    assert all(a is b for a, b in zip(model.parameters(), step.parameters()))
    assert step.data_parallel_coords() == (0, 2)
