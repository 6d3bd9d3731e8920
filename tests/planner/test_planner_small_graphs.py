"""Small graphs whose optimum is known by hand; every solver must find it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from torchtitan_autoparallel.planner.cost.cost_model import collective_time_us, mesh_dim_links
from torchtitan_autoparallel.planner.cost.profiles import load_profile
from torchtitan_autoparallel.planner.plan.plan import Plan, plan_from_solution
from torchtitan_autoparallel.planner.problem.build import build_problem
from torchtitan_autoparallel.planner.problem.problem import Problem
from torchtitan_autoparallel.planner.solve import get_solver
from torchtitan_autoparallel.planner.solve.brute_force import BruteForceSolver
from torchtitan_autoparallel.planner.strategies.strategy import enumerate_strategies
from torchtitan_autoparallel.planner.trace.trace import BatchSpec, trace_training_step

WORLD = 8
PROFILE = load_profile("h100")


pytestmark = pytest.mark.usefixtures("fake_world")


def dot_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return (pred * labels).sum()


def mse_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return ((pred - labels) ** 2).mean()


class Linear(nn.Module):
    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.proj = nn.Linear(d_in, d_out, bias=False, device="meta")

    def forward(self, x):
        return self.proj(x)


class MLP(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(d, hidden, bias=False, device="meta")
        self.down = nn.Linear(hidden, d, bias=False, device="meta")

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.wq = nn.Linear(d, d, bias=False, device="meta")
        self.wk = nn.Linear(d, d, bias=False, device="meta")
        self.wv = nn.Linear(d, d, bias=False, device="meta")
        self.wo = nn.Linear(d, d, bias=False, device="meta")

    def forward(self, x):
        b, s, d = x.shape

        def split(t):
            return t.view(b, s, self.heads, d // self.heads).transpose(1, 2)

        q, k, v = split(self.wq(x)), split(self.wk(x)), split(self.wv(x))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, d))


def _solve_all(model, mesh_shape, names, batch, loss_fn) -> tuple[Problem, dict[str, Plan]]:
    traced = trace_training_step(model, 0, 0, loss_fn=loss_fn, batch=batch)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    built = build_problem(traced, enumerate_strategies(traced, mesh), PROFILE)
    plans = {}
    for backend in ("highs", "cbc"):
        solution = get_solver("ilp", backend).solve(built.problem, 120)
        assert solution.status == "optimal"
        plans[backend] = plan_from_solution(solution, built, traced)
    return built.problem, plans


def _agree(problem: Problem, plans: dict[str, Plan]) -> Plan:
    objectives = [p.objective for p in plans.values()]
    assert max(objectives) - min(objectives) <= 1e-6 * max(1.0, abs(objectives[0])), objectives
    return plans["highs"]


def _brute_force_neighbourhoods(problem: Problem, assignment: np.ndarray, objective: float, size: int = 4) -> None:
    """Brute force over every window of ``size`` consecutive nodes, the rest pinned.

    The whole problem is too large to enumerate (10^8 plans for one Linear),
    but the ILP optimum must also be optimal in each window: brute force may
    not find anything cheaper there.
    """
    solver = BruteForceSolver()
    free_nodes = [v for v in range(problem.num_nodes) if len(problem.unary[v]) > 1 and v not in problem.pins]
    for start in range(0, len(free_nodes), size):
        window = set(free_nodes[start : start + size])
        pins = {v: int(assignment[v]) for v in range(problem.num_nodes) if v not in window}
        sub = Problem(
            problem.node_names,
            problem.strategy_labels,
            problem.unary,
            problem.edges,
            problem.pairwise,
            problem.memory,
            problem.memory_budget,
            pins,
            problem.ties,
        )
        found = solver.solve(sub)
        assert found.objective >= objective - 1e-6 * max(1.0, abs(objective))


def _time(kind: str, nbytes: float, mesh_shape: tuple[int, ...], dim: int = 0) -> float:
    link = mesh_dim_links(mesh_shape, PROFILE)[dim]
    return collective_time_us(kind, nbytes, mesh_shape[dim], link)


# Many tokens per weight: moving activations would cost more than the weights.
BIG_BATCH = BatchSpec((4096, 256), (4096, 512), torch.float32, torch.float32)


def test_linear_on_dp_replicate_is_ddp():
    batch = BIG_BATCH
    problem, plans = _solve_all(Linear(256, 512), (WORLD,), ("dp_replicate",), batch, dot_loss)
    plan = _agree(problem, plans)
    assert plan.parameters["proj.weight"] == ["R"]
    (grad,) = [c for c in plan.collectives]
    assert (grad.kind, grad.purpose, grad.count) == ("all_reduce", "gradient", 1)
    assert grad.bytes == 256 * 512 * 4
    # known optimum: local batch shard, one gradient all-reduce, nothing else
    assert plan.comm_us == pytest.approx(_time("all_reduce", 256 * 512 * 4, (WORLD,)))


def test_linear_on_dp_shard_is_fsdp():
    batch = BIG_BATCH
    problem, plans = _solve_all(Linear(256, 512), (WORLD,), ("dp_shard",), batch, dot_loss)
    plan = _agree(problem, plans)
    assert plan.parameters["proj.weight"] in (["S(0)"], ["S(1)"])
    kinds = {(c.kind, c.purpose) for c in plan.collectives}
    assert kinds == {("all_gather", "parameter"), ("reduce_scatter", "gradient")}
    nbytes = 256 * 512 * 4
    expected = _time("all_gather", nbytes, (WORLD,)) + _time("reduce_scatter", nbytes, (WORLD,))
    assert plan.comm_us == pytest.approx(expected)
    assert plan.param_bytes_per_device == nbytes / WORLD


def test_mlp_on_tp_is_megatron_with_one_all_reduce():
    # one token row, big layers: splitting the weights beats moving them
    batch = BatchSpec((8, 1024), (8, 1024), torch.float32, torch.float32)
    problem, plans = _solve_all(MLP(1024, 4096), (WORLD,), ("tp",), batch, mse_loss)
    plan = _agree(problem, plans)
    assert plan.parameters["up.weight"] == ["S(0)"]  # column parallel
    assert plan.parameters["down.weight"] == ["S(1)"]  # row parallel
    # Megatron's one all-reduce of the output; a ring all-reduce costs exactly
    # a reduce-scatter plus an all-gather, so either form is optimal.
    kinds = sorted(c.kind for c in plan.collectives for _ in range(c.count))
    assert kinds in (["all_reduce"], ["all_gather", "reduce_scatter"])
    assert plan.comm_us == pytest.approx(_time("all_reduce", 8 * 1024 * 4, (WORLD,)))


def test_mlp_on_2d_mesh_solvers_agree_and_shard_both_axes():
    batch = BatchSpec((16, 512), (16, 512), torch.float32, torch.float32)
    problem, plans = _solve_all(MLP(512, 1024), (2, 4), ("dp_shard", "tp"), batch, mse_loss)
    plan = _agree(problem, plans)
    for fqn, placements in plan.parameters.items():
        assert all(p.startswith("S(") for p in placements), (fqn, placements)
    assert plan.predicted["total_us"] == pytest.approx(plan.objective)


def test_attention_block_shards_batch_and_heads():
    batch = BatchSpec((8, 128, 256), (8, 128, 256), torch.float32, torch.float32)
    problem, plans = _solve_all(Attention(256, 8), (2, 4), ("dp_shard", "tp"), batch, mse_loss)
    plan = _agree(problem, plans)
    (sdpa,) = [v for k, v in plan.nodes.items() if k.startswith("_scaled_dot_product_flash_attention_for_cpu") and "backward" not in k]
    assert sdpa == "S(0)S(1),S(0)S(1)"  # batch over dp_shard, heads over tp
    for name in ("wq", "wk", "wv"):  # heads come straight out of column-parallel projections
        assert plan.parameters[f"{name}.weight"][1] == "S(0)"


@pytest.mark.parametrize(
    "make, dim, batch",
    [
        (lambda: Linear(16, 5), "tp", BatchSpec((8, 16), (8, 5), torch.float32, torch.float32)),
        (lambda: Linear(5, 3), "dp_shard", BatchSpec((8, 5), (8, 3), torch.float32, torch.float32)),
    ],
)
def test_brute_force_agrees_on_small_whole_problems(make, dim, batch):
    traced = trace_training_step(make(), 0, 0, loss_fn=mse_loss, batch=batch)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=(dim,))
    problem = build_problem(traced, enumerate_strategies(traced, mesh), PROFILE).problem
    assert math.prod(int(k) for k in problem.num_strategies) <= 1e6
    exact = get_solver("brute-force").solve(problem)
    for backend in ("highs", "cbc"):
        assert get_solver("ilp", backend).solve(problem, 60).objective == pytest.approx(exact.objective)


def test_brute_force_agrees_on_every_window_of_an_mlp_on_a_2d_mesh():
    batch = BatchSpec((16, 64), (16, 64), torch.float32, torch.float32)
    traced = trace_training_step(MLP(64, 128), 0, 0, loss_fn=mse_loss, batch=batch)
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp_shard", "tp"))
    problem = build_problem(traced, enumerate_strategies(traced, mesh), PROFILE).problem
    assert math.prod(float(k) for k in problem.num_strategies) > 1e6  # too big to enumerate whole
    best = get_solver("ilp", "highs").solve(problem, 60)
    _brute_force_neighbourhoods(problem, best.assignment, best.objective, size=3)
