"""The auto-parallel path of the trainer: knobs -> named mesh -> planner -> plan.json.

The mesh keeps torchtitan's axis names (``dp_replicate``, ``dp_shard``, ``tp``)
and drops size-1 axes; the planner reads each axis' role from its name.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchtitan_autoparallel.config import JobConfig
from torchtitan_autoparallel.distributed.runtime import Runtime
from torchtitan_autoparallel.errors import ConfigError, UserError

logger = logging.getLogger("torchtitan_autoparallel")

AXES = ("dp_replicate", "dp_shard", "tp")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_auto_mesh(runtime: Runtime, degrees: tuple[int, int, int]) -> DeviceMesh:
    kept = [(name, size) for name, size in zip(AXES, degrees) if size > 1]
    if not kept:  # one rank: a trivial data-parallel axis keeps the planner's inputs uniform
        kept = [("dp_shard", 1)]
    names, sizes = zip(*kept)
    return init_device_mesh(runtime.device_type, tuple(sizes), mesh_dim_names=tuple(names))


def resolve_profile(job: JobConfig, runtime: Runtime):
    from torchtitan_autoparallel.planner.profiles import default_profile_name, load_profile

    name = job.autoparallel.cost_profile
    if name == "auto":
        name = default_profile_name(runtime.device_type, runtime.fake)
    try:
        return load_profile(name)
    except ValueError as e:
        raise ConfigError(f"autoparallel.cost_profile: {e}") from None


def plan_job(job: JobConfig, runtime: Runtime, model_config, degrees: tuple[int, int, int]):
    """Plan the job's training step and write ``<dump_folder>/plan.json``."""
    from torchtitan_autoparallel.planner.api import plan_training_step
    from torchtitan_autoparallel.planner.problem import InfeasibleProblem
    from torchtitan_autoparallel.planner.solvers.ilp import SolverTimeout

    mesh = build_auto_mesh(runtime, degrees)
    with torch.device("meta"):
        model = model_config.build()
    t, a = job.training, job.autoparallel
    try:
        plan = plan_training_step(
            model,
            mesh,
            global_batch_size=t.local_batch_size * degrees[0] * degrees[1],
            seq_len=t.seq_len,
            param_dtype=_DTYPES[t.mixed_precision_param],
            reduce_dtype=_DTYPES[t.mixed_precision_reduce],
            profile=resolve_profile(job, runtime),
            solver=a.solver,
            ilp_backend=a.ilp_backend,
            time_limit_s=a.time_limit_s,
            memory_budget_gib=a.memory_budget_gib,
            export_problem=a.export_problem or None,
        )
    except InfeasibleProblem as e:
        raise UserError(f"autoparallel.memory_budget_gib = {a.memory_budget_gib}: {e}") from None
    except SolverTimeout as e:
        raise UserError(
            f"autoparallel.time_limit_s = {a.time_limit_s}: {e}; accepted: a larger time limit"
        ) from None
    if runtime.rank == 0:
        folder = Path(job.job.dump_folder)
        folder.mkdir(parents=True, exist_ok=True)
        plan.to_json(folder / "plan.json")
        logger.info("plan:\n%s", plan.table())
        logger.info(f"plan written to {folder / 'plan.json'} (planning took {plan.timings['total']:.1f} s)")
    return plan
