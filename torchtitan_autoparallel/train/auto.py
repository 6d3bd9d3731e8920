"""The auto-parallel path of the trainer: knobs -> named mesh -> planner -> plan.json.

The mesh keeps torchtitan's axis names (``dp_replicate``, ``dp_shard``, ``tp``)
and drops size-1 axes; the planner reads each axis' role from its name.
"""

from __future__ import annotations

import functools
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchtitan_autoparallel.config import JobConfig, accumulation_steps
from torchtitan_autoparallel.data.loader import build_data
from torchtitan_autoparallel.errors import ConfigError, UserError
from torchtitan_autoparallel.execute.compiled import graph_collectives
from torchtitan_autoparallel.execute.graph_cache import compile_cached
from torchtitan_autoparallel.execute.graph_cost import graph_cost
from torchtitan_autoparallel.execute.optim import optimizer_step
from torchtitan_autoparallel.execute.pipeline import plan_and_build
from torchtitan_autoparallel.mesh.runtime import Runtime
from torchtitan_autoparallel.planner.cost.profiles import default_profile_name, gpu_profile_name, load_profile
from torchtitan_autoparallel.planner.plan.api import ExecutablePlan, NothingFits, plan_fitting
from torchtitan_autoparallel.planner.plan.options import PlannerOptions
from torchtitan_autoparallel.planner.problem.problem import InfeasibleProblem
from torchtitan_autoparallel.planner.solve.base import SolverTimeout
from torchtitan_autoparallel.report.common import GIB, memory_fit, peak_summary, plan_warnings
from torchtitan_autoparallel.report.executed import MeshGroups, executed_collectives, traced_step_collectives
from torchtitan_autoparallel.report.html import write_html
from torchtitan_autoparallel.report.text import executed_text, words_text
from torchtitan_autoparallel.train import checkpoint
from torchtitan_autoparallel.train.initial import planned_full_values
from torchtitan_autoparallel.train.optim import build_lr_scheduler, build_optimizer
from torchtitan_autoparallel.train.setup import (
    Training,
    build_metrics,
    set_determinism,
)
from torchtitan_autoparallel.train.validate import build_validator

logger = logging.getLogger("torchtitan_autoparallel")

AXES = ("dp_replicate", "dp_shard", "tp")
# A plan-only run traces the executor's step on fake tensors for its report only up to
# this many graph nodes: the debug models (about 1,100 nodes) take 10 s on 2 cores,
# LLaMA3-8B (9,025 nodes, 64 ranks) 163 s, four times its planning.
FAKE_TRACE_MAX_NODES = 3000
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_auto_mesh(runtime: Runtime, degrees: tuple[int, int, int]) -> DeviceMesh:
    kept = [(name, size) for name, size in zip(AXES, degrees) if size > 1]
    if not kept:  # one rank: a trivial data-parallel axis keeps the planner's inputs uniform
        kept = [("dp_shard", 1)]
    names, sizes = zip(*kept)
    return init_device_mesh(runtime.device_type, tuple(sizes), mesh_dim_names=tuple(names))


def resolve_profile(job: JobConfig, runtime: Runtime):

    name = job.autoparallel.cost_profile
    if name == "auto":
        gpu = torch.cuda.get_device_name(runtime.device) if runtime.device_type == "cuda" and not runtime.fake else ""
        name = default_profile_name(runtime.device_type, runtime.fake, gpu)
        if gpu and gpu_profile_name(gpu) is None:
            _warn_unprofiled_gpu(gpu, name)
    try:
        return load_profile(name)
    except ValueError as e:
        raise ConfigError(f"autoparallel.cost_profile: {e}") from None


@functools.cache  # once per run: the profile is resolved for planning, the memory check and the plan check
def _warn_unprofiled_gpu(gpu: str, name: str) -> None:
    logger.warning(f"no built-in cost profile for {gpu}: planning with {name}'s numbers; "
                   "CALIBRATE=1 ./run_train.sh measures this cluster (README: Calibration)")


def planner_options(job: JobConfig, runtime: Runtime, degrees: tuple[int, int, int]) -> PlannerOptions:
    """The planner's options, built once from the job."""
    t, a = job.training, job.autoparallel
    gpu = _gpu_memory_bytes(runtime)  # else the planner reads the profile's, as the memory check does
    return PlannerOptions(
        global_batch_size=t.local_batch_size * degrees[0] * degrees[1],
        seq_len=t.seq_len,
        param_dtype=_DTYPES[t.mixed_precision_param],
        reduce_dtype=_DTYPES[t.mixed_precision_reduce],
        activation_checkpoint=job.activation_checkpoint.mode,
        device_memory_gib=gpu / 2**30 if gpu else None,
        profile=resolve_profile(job, runtime),
        solver=a.solver,
        ilp_backend=a.ilp_backend,
        time_limit_s=a.time_limit_s,
        optimality_check=a.optimality_check,
        mip_gap=a.mip_gap,
        memory_budget_gib=a.memory_budget_gib,
        strided_sharding=a.strided_sharding,
        overlap=a.overlap,
        export_problem=a.export_problem or None,
    )


def _cache_settings(job: JobConfig) -> dict:
    """What a plan depends on beyond the traced graph and the planner's options."""
    return {"model": {"name": job.model.name, "flavor": job.model.flavor, "n_layers": job.model.n_layers}}


@contextmanager
def _planning_errors(job: JobConfig) -> Iterator[None]:
    """Turn the planner's expected failures into one-line user errors."""

    a = job.autoparallel
    try:
        yield
    except NothingFits as e:
        raise UserError(f"activation_checkpoint.mode = auto: {e}") from None
    except InfeasibleProblem as e:
        raise UserError(f"autoparallel.memory_budget_gib = {a.memory_budget_gib}: {e}") from None
    except SolverTimeout as e:
        raise UserError(
            f"autoparallel.time_limit_s = {a.time_limit_s}: {e}; accepted: a larger time limit"
        ) from None


def _report_plan(job: JobConfig, runtime: Runtime, plan) -> None:
    if runtime.rank != 0:
        return
    folder = Path(job.job.dump_folder)
    folder.mkdir(parents=True, exist_ok=True)
    plan.device_memory_bytes = _device_memory_bytes(job, runtime)
    plan.to_json(folder / "plan.json")
    logger.info("plan:\n%s\n%s\n%s", words_text(plan), plan.table(), executed_text(plan))
    _write_plan_report(job, plan, folder)
    logger.info(f"plan written to {folder / 'plan.json'} (planning took {plan.timings['total']:.1f} s)")


def _device_memory_bytes(job: JobConfig, runtime: Runtime) -> float | None:
    """One device's memory: the GPU's own, or for a dry run the cost profile's."""
    gpu = _gpu_memory_bytes(runtime)
    if gpu:
        return gpu
    gib = resolve_profile(job, runtime).device_memory_gib
    return gib * 2**30 if gib > 0 else None


def _gpu_memory_bytes(runtime: Runtime) -> float | None:
    """The real GPU's memory; None on CPU ranks and in a dry run."""
    if runtime.device_type == "cuda" and not runtime.fake:
        return float(torch.cuda.get_device_properties(runtime.device).total_memory)
    return None


def _write_plan_report(job: JobConfig, plan, folder: Path) -> None:
    """plan.html beside plan.json; a warning per collective that gathers too much per
    device, and one if the plan's memory estimate outgrows the device."""
    threshold = job.autoparallel.report_warn_gib * GIB
    write_html(plan, folder / "plan.html", threshold)
    for message in plan_warnings(plan, threshold):
        logger.warning("plan: %s", message)
    fit = memory_fit(plan)
    if fit is not None and fit.fits:
        logger.info("plan: %s", fit.summary())
    if fit is not None and (peak := peak_summary(plan)):
        logger.info("plan: %s", peak)
    logger.info(f"plan report written to {folder / 'plan.html'}")


def plan_job(job: JobConfig, runtime: Runtime, model_config, degrees: tuple[int, int, int]):
    """Plan the job's training step and write ``<dump_folder>/plan.json`` (no training)."""
    mesh = build_auto_mesh(runtime, degrees)
    with torch.device("meta"):
        model = model_config.build()
    with _planning_errors(job):
        stages = plan_fitting(model, mesh, planner_options(job, runtime, degrees))
    if runtime.rank == 0:
        _list_executed_collectives(job, runtime, stages, mesh)
    _report_plan(job, runtime, stages.plan)
    return stages.plan


def _list_executed_collectives(job: JobConfig, runtime: Runtime, stages: ExecutablePlan, mesh: DeviceMesh) -> None:
    """What the executor would issue, for the report of a run that never executes: its
    step traced on fake tensors, bucketed when a training run's compile would bucket it."""
    a = job.autoparallel
    nodes = len(stages.traced.graph.graph.nodes)
    if nodes > FAKE_TRACE_MAX_NODES:
        logger.info(f"plan report: the executor's collectives are not traced for a step of {nodes} graph nodes "
                    f"(over {FAKE_TRACE_MAX_NODES}: minutes on fake tensors); a training run records them "
                    "in plan.json and plan.html once it compiles its step")
        return
    start = time.perf_counter()
    bucket = a.compile and a.bucket_collectives
    try:
        executed = traced_step_collectives(stages, mesh, resolve_profile(job, runtime), bucket=bucket)
    except (RuntimeError, ValueError, NotImplementedError) as e:  # a report must not stop the plan
        logger.warning(f"plan report: the executor's collectives could not be traced on fake tensors: {e}")
        return
    stages.plan.executed_collectives = [c.to_dict() for c in executed]
    logger.info(f"plan report: the executor's step traced on fake tensors in {time.perf_counter() - start:.1f} s "
                f"({'bucketed' if bucket else 'not bucketed: autoparallel.compile or bucket_collectives is off'})")


@dataclass
class AutoTraining(Training):
    """A training run whose step is the planned program (``execute/``)."""

    planned: object = None  # execute.step.PlannedStep
    plan: object = None  # planner.plan.Plan: gains the executed collectives once the step compiles
    validation_graph_logged: bool = False

    def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, float]:

        loss, grads = self._micro_step(batches[0])
        for batch in batches[1:]:
            micro_loss, micro_grads = self._micro_step(batch)
            loss = loss + micro_loss
            for fqn, grad in grads.items():  # each run's gradients are fresh tensors
                grad.to_local().add_(micro_grads[fqn].to_local())
        if len(batches) > 1:
            # the planned step's loss and gradients are each micro-batch's global mean
            loss = loss / len(batches)
            for grad in grads.values():
                grad.to_local().div_(len(batches))
        lr = self.scheduler.get_last_lr()[0]
        grad_norm = optimizer_step(self.planned, self.optimizer, grads, self.job.training.max_norm)
        self.scheduler.step()
        return loss, grad_norm, lr

    def _micro_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        return self.planned.step_local(*self._on_device_compiled(batch))

    def _on_device_compiled(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch on this rank's device; the step compiled on the first one, if asked."""
        inputs, labels = (x.to(self.runtime.device) for x in batch)
        if self.job.autoparallel.compile and self.planned.local_graph is None:
            self._compile(inputs, labels)
        return inputs, labels

    def _compile(self, inputs: torch.Tensor, labels: torch.Tensor) -> None:

        start = time.perf_counter()
        a = self.job.autoparallel
        self.planned.overlap_execution = a.overlap_execution
        self.planned.bucket_collectives = a.bucket_collectives
        cache = Path(self.job.job.dump_folder) / "plan_cache" / "graphs" if a.plan_cache else None
        loaded = compile_cached(self.planned, inputs, labels, cache)
        counts = dict(sorted(graph_collectives(self.planned.local_graph).items()))
        logger.info(
            f"step {'loaded from the compiled-step cache' if loaded else 'compiled into a local-tensor graph'} "
            f"in {time.perf_counter() - start:.1f} s "
            f"({len(self.planned.local_graph.graph.nodes)} nodes; collectives {counts})"
        )
        merged = self.planned.bucket_stats
        logger.info(f"bucketing: {merged.summary() if merged else 'off (one collective per tensor)'}")
        stats = self.planned.overlap_stats
        logger.info(f"overlap_execution: {stats.summary() if stats else 'off (collectives run where traced)'}")
        self._reprice_prediction()
        self._record_executed_collectives()

    def _record_executed_collectives(self) -> None:
        """plan.json and plan.html gain the collectives the compiled step issues (rank 0 writes)."""
        if self.plan is None or self.runtime.rank != 0:
            return
        profile = resolve_profile(self.job, self.runtime)
        try:
            executed = executed_collectives(self.planned.local_graph, MeshGroups.of(self.planned.mesh), profile)
        except ValueError as e:  # a report must not stop training
            logger.warning(f"plan report: the compiled step's collectives cannot be listed: {e}")
            return
        self.plan.executed_collectives = [c.to_dict() for c in executed]
        folder = Path(self.job.job.dump_folder)
        self.plan.to_json(folder / "plan.json")
        write_html(self.plan, folder / "plan.html", self.job.autoparallel.report_warn_gib * GIB)
        logger.info(f"plan: {executed_text(self.plan)}\n(written to plan.json and plan.html)")

    def _reprice_prediction(self) -> None:
        """The plan check prices the compiled graph: its bucketed collectives and its node count."""

        profile = resolve_profile(self.job, self.runtime)
        try:
            cost = graph_cost(self.planned.local_graph, self.planned.mesh, profile)
        except ValueError as e:  # a prediction must not stop training: keep the plan's
            logger.warning(f"plan check: keeps the plan's prediction, the compiled graph cannot be priced: {e}")
            return
        self.metrics.use_compiled_graph(cost, profile)

    def validation_loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The planned step's loss (the global mean), without its backward when compiled."""
        inputs, labels = self._on_device_compiled(batch)
        if self.planned.local_graph is not None and not self.validation_graph_logged:
            self._log_validation_graph()
        return self.planned.loss_local(inputs, labels)

    def _log_validation_graph(self) -> None:

        full, forward = self.planned.local_graph, self.planned.loss_graph()
        logger.info(
            f"validation runs the compiled step without its backward: {len(forward.graph.nodes)} of "
            f"{len(full.graph.nodes)} nodes; collectives {dict(sorted(graph_collectives(forward).items()))}"
        )
        self.validation_graph_logged = True

    def global_loss(self, local_loss: torch.Tensor) -> float:
        return float(local_loss)  # the planned step already reduces the loss


def _compile_backend(job: JobConfig) -> str | None:
    """The torch.compile backend for the planned step's graphs, if ``[compile]`` asks for one."""
    c = job.compile
    if not (c.enable and c.components):
        return None
    if not job.autoparallel.compile:
        logger.info("compile.enable has no effect: autoparallel.compile is off, so the step is interpreted op by op")
        return None
    logger.info(f"compile: the planned step (model and loss, one graph) is built by {c.backend} on its first run")
    return c.backend


def build_auto_training(
    job: JobConfig, runtime: Runtime, family: str, model_config, degrees: tuple[int, int, int]
) -> AutoTraining:
    """Plan on every rank (solve on rank 0), place the weights, and build the loop's parts."""

    set_determinism(job, runtime.device)
    mesh = build_auto_mesh(runtime, degrees)
    with torch.device("meta"):
        model = model_config.build()
    t = job.training
    n_params, flops_per_token = model_config.nparams_and_flops(model, t.seq_len)
    full_values = planned_full_values(model_config, model, t.seed, runtime, t.full_init_max_gib)
    with _planning_errors(job):
        planned = plan_and_build(
            model,
            mesh,
            full_values,
            planner_options(job, runtime, degrees),
            plan_cache_dir=Path(job.job.dump_folder) / "plan_cache" if job.autoparallel.plan_cache else None,
            cache_settings=_cache_settings(job),
        )
    _report_plan(job, runtime, planned.plan)
    step = planned.step
    step.bind_to(model)
    if job.autoparallel.overlap_execution and not job.autoparallel.compile:
        logger.info("autoparallel.overlap_execution has no effect: it reorders the compiled graph and compile is off")
    step.backend = _compile_backend(job)
    dp_rank, dp_degree = step.data_parallel_coords()
    steps = accumulation_steps(job, degrees)
    optimizer = build_optimizer(model, job.optimizer)
    metrics = build_metrics(job, runtime, flops_per_token)
    metrics.attach_plan(planned.plan, steps)
    return AutoTraining(
        job=job,
        runtime=runtime,
        model=model,
        model_id=checkpoint.job_model_id(job, family),
        optimizer=optimizer,
        scheduler=build_lr_scheduler(optimizer, t.steps, job.lr_scheduler),
        dataloader=build_data(job, model_config, dp_rank, dp_degree),
        metrics=metrics,
        validator=build_validator(job, model_config, dp_rank, dp_degree),
        dp_degree=dp_degree,
        dp_group=None,
        n_params=n_params,
        accumulation_steps=steps,
        planned=step,
        plan=planned.plan,
    )
