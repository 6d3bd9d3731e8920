"""``plan_training_step``: model + mesh + knobs -> ``Plan``, stage by stage.

trace -> strategies -> build -> solve -> plan; each stage is timed and logged
on the ``torchtitan_autoparallel.planner`` logger.
"""

from __future__ import annotations

import functools
import logging
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_autoparallel.planner import jit
from torchtitan_autoparallel.planner.build import BuiltProblem, build_problem
from torchtitan_autoparallel.planner.overlap import add_overlap_prediction, overlap_spec
from torchtitan_autoparallel.planner.plan import Plan, plan_from_solution
from torchtitan_autoparallel.planner.problem import Problem
from torchtitan_autoparallel.planner.profiles import HardwareProfile
from torchtitan_autoparallel.planner.repeats import repeated_layer_ties
from torchtitan_autoparallel.planner.solve import get_solver
from torchtitan_autoparallel.planner.solve.base import Solution
from torchtitan_autoparallel.planner.solve.registry import choose, overlap_solver
from torchtitan_autoparallel.planner.strategy import enumerate_strategies
from torchtitan_autoparallel.planner.trace import BatchSpec, LossFn, TracedStep, trace_training_step
from torchtitan_autoparallel.train.loss import cross_entropy_loss

log = logging.getLogger("torchtitan_autoparallel.planner")


@dataclass
class PlannedStages:
    """The plan and what produced it (the executor needs the graph and the solution too)."""

    plan: Plan
    traced: TracedStep
    built: BuiltProblem
    solution: Solution


# Given the built problem and the plain solve, return the solution to use
# (the executor's hook solves on rank 0 and shares the result).
SolveHook = Callable[[BuiltProblem, Callable[[], Solution]], Solution]


def plan_training_step(model: nn.Module, mesh: DeviceMesh, **kwargs) -> Plan:
    """Choose a placement for every tensor of one training step on ``mesh``.

    Keyword arguments as ``plan_stages``; returns only the ``Plan``.
    """
    return plan_stages(model, mesh, **kwargs).plan


def _loops_for_mesh(plan: Callable[..., PlannedStages]) -> Callable[..., PlannedStages]:
    """Run the planner's loops as Python on a mesh with one dim over 1 and compiled on larger ones
    (``jit.py``): a 1-D problem has a few strategies per node, which Python plans in
    seconds, less than compiling the loops takes on a machine's first run (minutes)."""

    @functools.wraps(plan)
    def run(model: nn.Module, mesh: DeviceMesh, **kwargs) -> PlannedStages:
        with jit.compiled(sum(size > 1 for size in mesh.mesh.shape) > 1):  # dims of size 1 add no strategies
            return plan(model, mesh, **kwargs)

    return run


@_loops_for_mesh
def plan_stages(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    global_batch_size: int,
    seq_len: int,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    profile: HardwareProfile,
    solver: str = "ilp",
    ilp_backend: str = "highs",
    time_limit_s: float | None = 300,
    optimality_check: bool = False,
    mip_gap: float | None = None,
    memory_budget_gib: float | None = None,
    export_problem: str | None = None,
    loss_fn: LossFn = cross_entropy_loss,
    batch: BatchSpec | None = None,
    solve_hook: SolveHook | None = None,
    activation_checkpoint: str = "none",
    strided_sharding: bool = False,
    overlap: bool = False,
) -> PlannedStages:
    """Trace, enumerate, build, solve and decode one training step on ``mesh``.

    ``model`` may live on the meta device; nothing is allocated. Raises
    ``InfeasibleProblem`` (naming the smallest feasible budget) when
    ``memory_budget_gib`` cannot hold the parameters. ``loss_fn`` and
    ``batch`` replace the token batch and cross-entropy for non-LLM models.
    ``solver`` is ``ilp``, ``approx`` or ``auto`` (``solve/registry.py``);
    ``optimality_check`` adds the LP bound to the plan's ``lower_bound``.
    ``mip_gap`` stops the exact search once the plan is proven within that
    relative gap (None: the ILP proves the optimum, the overlap MIP stops at 0.1%).
    ``activation_checkpoint`` ("none", "full", "selective") traces the step
    with each transformer block recomputed in the backward, so the plan prices
    and the executor runs the recomputation. ``strided_sharding`` lets the
    matmul family take the strided shards views produce (``strided.py``).
    ``overlap`` credits parameter gathers and gradient reductions hidden behind
    compute (``overlap.py``): ``ilp`` solves the overlap MIP (warm-started
    by the theta sweep of ``solve/overlap/lagrange.py``), ``approx`` runs the
    sweep on TRW-S, ``auto`` picks by problem size.
    """
    clock = _StageClock()
    names = tuple(mesh.mesh_dim_names or ())
    log.info("planning on mesh %s %s, batch %d x %d; cost profile %s, fp32 matmuls at %g TFLOP/s peak",
             names, tuple(mesh.mesh.shape), global_batch_size, seq_len, profile.name, profile.peak_tflops["float32"])
    traced = trace_training_step(
        model,
        global_batch_size,
        seq_len,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        loss_fn=loss_fn,
        batch=batch,
        activation_checkpoint=activation_checkpoint,
    )
    clock.lap("trace")
    table = enumerate_strategies(traced, mesh, strided_sharding)
    if table.replicated_ops:
        log.warning("ops replicated for lack of a sharding rule: %s", ", ".join(table.replicated_ops))
    clock.lap("strategies")
    ties = repeated_layer_ties(traced, table)
    built = build_problem(traced, table, profile, memory_budget_gib, ties)
    if export_problem:
        Path(export_problem).parent.mkdir(parents=True, exist_ok=True)
        built.problem.save(export_problem)
        log.info("problem written to %s", export_problem)
    clock.lap("build")
    spec = overlap_spec(built, traced) if overlap else None

    def solve() -> Solution:  # on the solving rank only
        if spec is not None:
            return overlap_solver(solver, ilp_backend, spec, mip_gap=mip_gap).solve(
                built.problem, time_limit_s
            )
        if solver == "ilp":
            _hint_when_exact_is_slow(built.problem)
        chosen = get_solver(solver, ilp_backend, optimality_check=optimality_check, mip_gap=mip_gap)
        return chosen.solve(built.problem, time_limit_s)

    solution = solve_hook(built, solve) if solve_hook else solve()
    _log_solution(solution, time_limit_s)
    clock.lap("solve")
    plan = plan_from_solution(solution, built, traced, clock.timings)
    if spec is not None:
        add_overlap_prediction(plan, built, spec, solution.assignment)
    _add_step_terms(plan, traced, profile)
    clock.lap("plan")
    plan.peak_rss_gib = clock.peak_rss
    plan.timings["total"] = clock.elapsed()
    log.info("planner total %.2f s", plan.timings["total"])
    return PlannedStages(plan, traced, built, solution)


class _StageClock:
    """Each planner stage's seconds and the memory high-water mark after it, logged as it ends."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self.peak_rss: dict[str, float] = {}
        self._start = self._last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.timings[stage] = now - self._last
        self.peak_rss[stage] = _peak_rss_gib()
        self._last = now
        log.info(
            "planner stage %-10s done in %.2f s (%.1f s elapsed, peak RSS %.2f GiB)",
            stage, self.timings[stage], now - self._start, self.peak_rss[stage],
        )

    def elapsed(self) -> float:
        return time.perf_counter() - self._start


def _hint_when_exact_is_slow(problem: Problem) -> None:
    """3-D meshes keep the exact ILP busy for minutes by default; say so, and what is quicker."""
    choice, why = choose(problem)
    if choice == "approx":
        log.info(
            "solver = ilp on a large problem (%s): the proof may take minutes; solver = auto "
            "would plan it with approx in seconds, within a proven gap", why.split(":")[0]
        )


def _log_solution(solution: Solution, time_limit_s: float | None) -> None:
    log.info(
        "solve: %s %s, objective %.1f us, bound %.1f us, gap %.2e",
        solution.solver, solution.status, solution.objective, solution.lower_bound, solution.gap,
    )
    if solution.status == "time_limit":
        log.warning(
            "solve: the time limit (%s s) stopped %s; the plan is proven within %.3g%% of the optimum",
            time_limit_s, solution.solver, 100 * solution.gap,
        )


def _add_step_terms(plan: Plan, traced, profile: HardwareProfile) -> None:
    """Host and optimizer time beside the planned graph's (step_terms.py: not in the objective)."""
    import operator

    from torchtitan_autoparallel.planner.step_terms import add_step_terms

    shapes = {fqn: tuple(node.meta["val"].shape) for fqn, node in traced.params.items()}
    nodes = sum(1 for n in traced.graph.graph.nodes if n.op == "call_function" and n.target is not operator.getitem)
    add_step_terms(plan, shapes, nodes, profile)


def _peak_rss_gib() -> float:
    """This process' memory high-water mark so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**30 if sys.platform == "darwin" else 2**20)
