"""Plan on every rank, solve on rank 0, and build the executable step: one call for the trainer.

The stages are the planner's (``planner/plan/api.py::plan_fitting``). Every rank
traces and enumerates; only rank 0 solves; all ranks check they built the same
problem before sharing the solution (``agree.py``, passed as the solve hook).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_autoparallel.execute.step import FullValues, PlannedStep, build_executable
from torchtitan_autoparallel.planner.plan.api import ExecutablePlan, plan_fitting
from torchtitan_autoparallel.planner.plan.cache import cached_solve_hook, plan_settings
from torchtitan_autoparallel.planner.plan.options import PlannerOptions
from torchtitan_autoparallel.planner.plan.plan import Plan

log = logging.getLogger("torchtitan_autoparallel.execute")


@dataclass
class PlannedTraining:
    plan: Plan
    step: PlannedStep
    executable: ExecutablePlan


def plan_and_build(
    model: nn.Module,
    mesh: DeviceMesh,
    full_values: Callable[[Plan], FullValues],
    options: PlannerOptions,
    *,
    portable_kernels: bool = False,
    plan_cache_dir: str | Path | None = None,
    cache_settings: dict[str, Any] | None = None,
) -> PlannedTraining:
    """Plan ``model`` (meta device is fine) on every rank, agree on rank 0's
    solution, and place the values ``full_values(plan)`` gives. They are asked
    for only once the plan is known, so a plan that cannot fit is reported
    before the whole model is built.

    With ``plan_cache_dir``, rank 0 reuses a stored solution for the same key
    (``planner/plan/cache.py``); ``cache_settings`` adds to the key what the traced
    graph cannot show (model config, knobs)."""
    start = time.perf_counter()
    executable = plan_fitting(
        model, mesh, options,
        hook_for=lambda chosen: cached_solve_hook(plan_cache_dir, plan_settings(mesh, chosen, cache_settings)),
    )  # fmt: skip
    step = build_executable(executable, mesh, full_values(executable.plan), portable_kernels=portable_kernels)
    plan = executable.plan
    plan.timings["place"] = time.perf_counter() - start - plan.timings["total"]
    plan.timings["total"] = time.perf_counter() - start
    log.info("plan agreed and placed in %.2f s", plan.timings["total"])
    return PlannedTraining(plan, step, executable)
