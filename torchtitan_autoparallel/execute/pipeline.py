"""Plan on every rank, solve on rank 0, and build the executable step: one call for the trainer.

The stages are the planner's (``planner/api.py`` runs the same ones but
returns only the ``Plan``; the executor also needs the traced graph, the
strategy table and the solution). Every rank traces and enumerates; only rank
0 solves; all ranks check they built the same problem before sharing the
solution (``agree.py``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_autoparallel.execute.agree import agree_on_solution
from torchtitan_autoparallel.execute.step import PlannedStep, build_executable
from torchtitan_autoparallel.planner.build import BuiltProblem, build_problem
from torchtitan_autoparallel.planner.plan import Plan, plan_from_solution
from torchtitan_autoparallel.planner.profiles import HardwareProfile
from torchtitan_autoparallel.planner.repeats import repeated_layer_ties
from torchtitan_autoparallel.planner.solvers import get_solver
from torchtitan_autoparallel.planner.solvers.base import Solution
from torchtitan_autoparallel.planner.strategy import enumerate_strategies
from torchtitan_autoparallel.planner.trace import TracedStep, trace_training_step

log = logging.getLogger("torchtitan_autoparallel.execute")


@dataclass
class PlannedTraining:
    plan: Plan
    step: PlannedStep
    traced: TracedStep
    built: BuiltProblem
    solution: Solution


def plan_and_build(
    model: nn.Module,
    mesh: DeviceMesh,
    full_params: dict[str, torch.Tensor],
    full_buffers: dict[str, torch.Tensor],
    *,
    global_batch_size: int,
    seq_len: int,
    profile: HardwareProfile,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    solver: str = "ilp",
    ilp_backend: str = "highs",
    time_limit_s: float | None = 300,
    memory_budget_gib: float | None = None,
    portable_kernels: bool = False,
) -> PlannedTraining:
    """Trace ``model`` (meta device is fine), agree on one solution, and place ``full_params``."""
    timings: dict[str, float] = {}
    clock = start = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[stage] = now - clock
        clock = now

    traced = trace_training_step(
        model, global_batch_size, seq_len, param_dtype=param_dtype, reduce_dtype=reduce_dtype
    )
    lap("trace")
    table = enumerate_strategies(traced, mesh)
    if table.replicated_ops:
        log.warning("ops replicated for lack of a sharding rule: %s", ", ".join(table.replicated_ops))
    lap("strategies")
    built = build_problem(traced, table, profile, memory_budget_gib, repeated_layer_ties(traced, table))
    lap("build")
    solution = agree_on_solution(
        built, lambda: get_solver(solver, ilp_backend).solve(built.problem, time_limit_s)
    )
    lap("solve")
    plan = plan_from_solution(solution, built, traced, timings)
    step = build_executable(
        traced, built, solution, mesh, full_params, full_buffers, portable_kernels=portable_kernels
    )
    lap("place")
    plan.timings.update(timings)
    plan.timings["total"] = time.perf_counter() - start
    log.info("plan agreed and placed in %.2f s (%s)", plan.timings["total"], _fmt(timings))
    return PlannedTraining(plan, step, traced, built, solution)


def _fmt(timings: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f} s" for k, v in timings.items())
