"""``plan_stages``: model + mesh + ``PlannerOptions`` -> ``ExecutablePlan``, stage by stage.

trace -> strategies -> build -> solve -> plan; each stage is timed and logged
on the ``torchtitan_autoparallel.planner`` logger. The executor takes the
``ExecutablePlan`` whole: the graph, the chosen strategy of each node, the plan.
"""

from __future__ import annotations

import functools
import logging
import operator
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_autoparallel import jit
from torchtitan_autoparallel.planner.cost.profiles import HardwareProfile
from torchtitan_autoparallel.planner.cost.step_terms import add_step_terms
from torchtitan_autoparallel.planner.plan.options import PlannerOptions
from torchtitan_autoparallel.planner.plan.overlap import add_overlap_prediction, effective_us, overlap_spec
from torchtitan_autoparallel.planner.plan.peak_rows import fit_peak
from torchtitan_autoparallel.planner.plan.plan import Plan, plan_from_solution
from torchtitan_autoparallel.planner.plan.recompute_choice import fit_with_recompute
from torchtitan_autoparallel.planner.problem.build import BuiltProblem, build_problem
from torchtitan_autoparallel.planner.problem.problem import InfeasibleProblem, Problem
from torchtitan_autoparallel.planner.solve import get_solver
from torchtitan_autoparallel.planner.solve.base import Solution
from torchtitan_autoparallel.planner.solve.registry import choose, exact_solver, overlap_solver
from torchtitan_autoparallel.planner.strategies.repeats import repeated_layer_ties
from torchtitan_autoparallel.planner.strategies.strategy import Strategy, enumerate_strategies
from torchtitan_autoparallel.planner.trace.recompute import RECOMPUTE_ORDER, describe, transformer_blocks
from torchtitan_autoparallel.planner.trace.trace import TracedStep, trace_training_step

log = logging.getLogger("torchtitan_autoparallel.planner")


@dataclass
class ExecutablePlan:
    """The plan and what the executor runs it from: the traced graph and each node's chosen strategy."""

    plan: Plan
    traced: TracedStep
    built: BuiltProblem
    solution: Solution

    @functools.cached_property
    def chosen(self) -> dict[fx.Node, Strategy]:
        """Graph node -> the strategy the solution picked for it."""
        return chosen_strategies(self.built, self.solution)


def chosen_strategies(built: BuiltProblem, solution: Solution) -> dict[fx.Node, Strategy]:
    x = np.asarray(solution.assignment, dtype=np.int64)
    if len(x) != len(built.nodes):
        raise ValueError(
            f"solution assigns {len(x)} nodes but the problem has {len(built.nodes)}; "
            "was it solved for another trace?"
        )
    chosen: dict[fx.Node, Strategy] = {}
    for i, node in enumerate(built.nodes):
        candidates = built.strategies(node)
        k = int(x[i])
        if not 0 <= k < len(candidates):
            raise ValueError(f"node {node.name}: strategy {k} out of range (it has {len(candidates)})")
        chosen[node] = candidates[k]
    return chosen


# Given the built problem and the plain solve, return the solution to use
# (the executor's hook solves on rank 0 and shares the result).
SolveHook = Callable[[BuiltProblem, Callable[[], Solution]], Solution]


def plan_training_step(model: nn.Module, mesh: DeviceMesh, **options) -> Plan:
    """Choose a placement for every tensor of one training step on ``mesh``.

    Keyword arguments are ``PlannerOptions``' fields; returns only the ``Plan``.
    """
    return plan_fitting(model, mesh, PlannerOptions(**options)).plan


def _loops_for_mesh(plan: Callable[..., ExecutablePlan]) -> Callable[..., ExecutablePlan]:
    """Run the planner's loops as Python on a mesh with one dim over 1 and compiled on larger ones
    (``jit.py``): a 1-D problem has a few strategies per node, which Python plans in
    seconds, less than compiling the loops takes on a machine's first run (minutes)."""

    @functools.wraps(plan)
    def run(model: nn.Module, mesh: DeviceMesh, *args, **kwargs) -> ExecutablePlan:
        with jit.compiled(sum(size > 1 for size in mesh.mesh.shape) > 1):  # dims of size 1 add no strategies
            return plan(model, mesh, *args, **kwargs)

    return run


@_loops_for_mesh
def plan_stages(
    model: nn.Module, mesh: DeviceMesh, options: PlannerOptions, *, solve_hook: SolveHook | None = None
) -> ExecutablePlan:
    """Trace, enumerate, build, solve and decode one training step on ``mesh``.

    ``model`` may live on the meta device; nothing is allocated. Raises
    ``InfeasibleProblem`` (naming the smallest feasible budget) when
    ``options.memory_budget_gib`` cannot hold the parameters. ``solve_hook``
    replaces the plain solve (the trainer's solves on rank 0 and shares it).
    """
    o = options
    clock = _StageClock()
    names = tuple(mesh.mesh_dim_names or ())
    log.info("planning on mesh %s %s, batch %d x %d; cost profile %s, fp32 matmuls at %g TFLOP/s peak",
             names, tuple(mesh.mesh.shape), o.global_batch_size, o.seq_len, o.profile.name,
             o.profile.peak_tflops["float32"])
    traced = trace_training_step(
        model,
        o.global_batch_size,
        o.seq_len,
        param_dtype=o.param_dtype,
        reduce_dtype=o.reduce_dtype,
        loss_fn=o.loss_fn,
        batch=o.batch,
        activation_checkpoint=o.block_recompute or _traced_mode(o.activation_checkpoint),
    )
    clock.lap("trace")
    table = enumerate_strategies(traced, mesh, o.strided_sharding)
    if table.replicated_ops:
        log.warning("ops replicated for lack of a sharding rule: %s", ", ".join(table.replicated_ops))
    clock.lap("strategies")
    ties = repeated_layer_ties(traced, table)
    built = build_problem(traced, table, o.profile, o.memory_budget_gib, ties)
    if o.export_problem:
        Path(o.export_problem).parent.mkdir(parents=True, exist_ok=True)
        built.problem.save(o.export_problem)
        log.info("problem written to %s", o.export_problem)
    clock.lap("build")
    spec = overlap_spec(built, traced) if o.overlap else None

    def solve() -> Solution:  # on the solving rank only
        if spec is not None:
            chosen = overlap_solver(o.solver, o.ilp_backend, spec, mip_gap=o.mip_gap)
        else:
            if o.solver == "ilp":
                _hint_when_exact_is_slow(built.problem)
            chosen = get_solver(o.solver, o.ilp_backend, optimality_check=o.optimality_check, mip_gap=o.mip_gap)
        solution = chosen.solve(built.problem, o.time_limit_s)
        usable = usable_bytes(o)
        if not usable:
            return solution
        fit = dict(time_limit_s=o.time_limit_s, solver=exact_solver(o.ilp_backend, max(o.mip_gap or 0.0, ROWS_MIP_GAP)),
                   price=None if spec is None else functools.partial(effective_us, built, spec))
        if o.activation_checkpoint == "auto":
            return fit_with_recompute(built, traced, solution, usable, len(transformer_blocks(model)), **fit)
        return fit_peak(built, traced, solution, usable, **fit)

    solution = solve_hook(built, solve) if solve_hook else solve()
    _log_solution(solution, o.time_limit_s)
    clock.lap("solve")
    plan = plan_from_solution(solution, built, traced, clock.timings)
    if spec is not None:
        add_overlap_prediction(plan, built, spec, solution.assignment)
    _add_step_terms(plan, traced, o.profile)
    clock.lap("plan")
    plan.peak_rss_gib = clock.peak_rss
    plan.timings = dict(clock.timings)  # "plan" and "compile" too: the lines add up to the total
    plan.timings["total"] = clock.elapsed()
    log.info("planner total %.2f s", plan.timings["total"])
    return ExecutablePlan(plan, traced, built, solution)


# activation_checkpoint = "auto": the traces planned at most, each with the modes the
# solve before chose (modes only get heavier, so the search ends anyway).
RECOMPUTE_TRACES = 3
# Of the device's memory, what "auto" leaves unplanned: the allocator's slack and the
# runtime's own buffers, which the prediction does not count (it reads 0.91-1.09 of the
# measured peak on CPU ranks: experiments/memory).
FIT_RESERVE = 0.10
# The solves under memory rows stop within this relative gap: the rows make the MIP a
# knapsack, whose last 1% costs most of its time; the bound proven is reported.
ROWS_MIP_GAP = 1e-2
GIB = 2**30


class NothingFits(ValueError):
    """activation_checkpoint = "auto" found no recomputation whose plan fits the device."""


def plan_fitting(
    model: nn.Module,
    mesh: DeviceMesh,
    options: PlannerOptions,
    *,
    hook_for: Callable[[PlannerOptions], SolveHook | None] = lambda options: None,
) -> ExecutablePlan:
    """``plan_stages``, with each solve's hook from ``hook_for``. For
    ``activation_checkpoint = "auto"``, each block's recomputation is a choice of the
    solve that fits the device (less ``FIT_RESERVE``): ``recompute_choice``. The step
    is traced without recomputation; when the solve chooses some, the chosen modes are
    traced and planned again (at most ``RECOMPUTE_TRACES`` traces), and that plan is
    the one run. Raises ``NothingFits`` when no plan fits, and ``InfeasibleProblem``
    when a plan of a given mode is over a given ``memory_budget_gib`` (naming its peak)."""
    if options.activation_checkpoint != "auto":
        executable = plan_stages(model, mesh, options, solve_hook=hook_for(options))
        _check_budget(executable.plan, options)
        return executable
    usable = usable_bytes(options)
    if not usable:
        log.info("activation_checkpoint auto: the device's memory is not known (cost profile %s): no recomputation",
                 options.profile.name)
        none = options.replace(activation_checkpoint="none")
        return plan_stages(model, mesh, none, solve_hook=hook_for(none))
    return _RecomputeSearch(model, mesh, options, hook_for, usable).run()


class _RecomputeSearch:
    """The traces ``plan_fitting`` plans for ``activation_checkpoint = "auto"``."""

    def __init__(self, model, mesh, options, hook_for, usable: float) -> None:  # noqa: ANN001
        self.model, self.mesh, self.options, self.hook_for, self.usable = model, mesh, options, hook_for, usable
        self.n_blocks = len(transformer_blocks(model))
        self.tried: list[dict] = []
        self.chosen: dict[str, float] = {}  # the first choice's price (Solution.memory_fit's recompute_ keys)

    def run(self) -> ExecutablePlan:
        modes = ("none",) * self.n_blocks
        for _ in range(RECOMPUTE_TRACES):
            executable = self.plan(modes, choose=True)
            asked = executable.solution.block_recompute or modes
            if asked == modes:
                if self.fits(executable):
                    return self.done(executable)
                break
            if not self.chosen:  # the first choice, made against the plan without recomputation
                fit = executable.solution.memory_fit
                self.chosen = {k: v for k, v in fit.items() if k.startswith("recompute_") or k.startswith("unbounded_")}
            modes = asked
        else:  # the last choice, planned as chosen
            executable = self.plan(modes, choose=False)
            if self.fits(executable):
                return self.done(executable)
        all_full = ("full",) * self.n_blocks
        full = executable if modes == all_full else self.plan(all_full, choose=False)
        if self.fits(full):
            return self.done(full)
        raise NothingFits(
            f"no recomputation fits: with full recomputation the step peaks at "
            f"{full.plan.predicted['peak_bytes_per_device'] / GIB:.2f} GiB per device at the lowest, over "
            f"{_usable_words(self.options)}; {KNOBS}"
        )

    def plan(self, modes: tuple[str, ...], *, choose: bool) -> ExecutablePlan:
        """The plan of the trace of ``modes``; with ``choose``, its solve may ask for more recomputation."""
        heaviest = max(modes, key=RECOMPUTE_ORDER.index)
        chosen = self.options.replace(activation_checkpoint="auto" if choose else heaviest, block_recompute=modes)
        executable = plan_stages(self.model, self.mesh, chosen, solve_hook=self.hook_for(chosen))
        plan, asked = executable.plan, executable.solution.block_recompute
        peak = plan.predicted["peak_bytes_per_device"]
        self.tried.append({"traced": plan.activation_checkpoint, "peak_bytes": peak, "objective_us": plan.objective})
        if asked and asked != modes:
            log.info("activation_checkpoint auto: traced %s: the solve recomputes %s to fit %.2f GiB usable; "
                     "tracing that", plan.activation_checkpoint, describe(asked), self.usable / GIB)
        else:
            log.info("activation_checkpoint auto: traced %s: the step peaks at %.2f GiB per device, %s %.2f GiB "
                     "usable%s; step %.1f us", plan.activation_checkpoint, peak / GIB,
                     "within" if self.fits(executable) else "over", self.usable / GIB,
                     " once resharded" if plan.memory_fit else "", plan.objective)
        return executable

    def fits(self, executable: ExecutablePlan) -> bool:
        return executable.plan.predicted["peak_bytes_per_device"] <= self.usable

    def done(self, executable: ExecutablePlan) -> ExecutablePlan:
        executable.plan.recompute_choice = {"tried": self.tried, **self.chosen}
        return executable


KNOBS = ("use more ranks, a smaller training.local_batch_size or training.seq_len, or HSDP "
         "(parallelism.data_parallel_replicate_degree > 1)")


def _device_gib(options: PlannerOptions) -> float:
    return options.device_memory_gib or options.profile.device_memory_gib


def usable_bytes(options: PlannerOptions) -> float:
    """The bytes per device a plan may peak at: ``memory_budget_gib`` when given, else
    the device's memory less ``FIT_RESERVE`` (0 when not known: CPU ranks)."""
    if options.memory_budget_gib is not None:
        return options.memory_budget_gib * GIB
    return _device_gib(options) * GIB * (1 - FIT_RESERVE)


def _usable_words(options: PlannerOptions) -> str:
    usable = usable_bytes(options) / GIB
    if options.memory_budget_gib is not None:
        return f"the memory budget of {usable:.2f} GiB"
    return f"{usable:.2f} GiB usable ({_device_gib(options):.2f} GiB less the {FIT_RESERVE:.0%} reserve)"


def _check_budget(plan: Plan, options: PlannerOptions) -> None:
    """A budget the user gave is a promise: a plan over it is an error, not a warning
    (over the device's own memory the trainer warns: the peak is an estimate)."""
    peak = plan.predicted["peak_bytes_per_device"]
    if options.memory_budget_gib is None or options.activation_checkpoint == "auto" or peak <= usable_bytes(options):
        return
    raise InfeasibleProblem(
        f"no plan found keeps the step's peak within {_usable_words(options)}: the lowest found peaks at "
        f"{peak / GIB:.2f} GiB per device with activation_checkpoint.mode = {options.activation_checkpoint}; "
        f"{KNOBS}, or more recomputation (activation_checkpoint.mode = full or auto)"
    )


def _traced_mode(mode: str) -> str:
    return "none" if mode == "auto" else mode  # "auto" starts from no recomputation


class _StageClock:
    """Each planner stage's seconds and the memory high-water mark after it, logged as it ends.

    numba's compiles of the planner's loops (``jit.compile_seconds``) are taken out of
    the stage they happened in and summed under "compile": a machine's first plan
    compiles for minutes, which is no stage's own work.
    """

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self.peak_rss: dict[str, float] = {}
        self._start = self._last = time.perf_counter()
        self._compiled = jit.compile_seconds()

    def lap(self, stage: str) -> None:
        now, compiled = time.perf_counter(), jit.compile_seconds()
        compile_s, self._compiled = compiled - self._compiled, compiled
        self.timings[stage] = now - self._last - compile_s
        self.timings["compile"] = self.timings.pop("compile", 0.0) + compile_s  # kept last of the stages
        self.peak_rss[stage] = _peak_rss_gib()
        self._last = now
        log.info(
            "planner stage %-10s done in %.2f s%s (%.1f s elapsed, peak RSS %.2f GiB)",
            stage, self.timings[stage], f" + {compile_s:.2f} s compiling (or loading) numba loops" if compile_s else "",
            now - self._start, self.peak_rss[stage],
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
    shapes = {fqn: tuple(node.meta["val"].shape) for fqn, node in traced.params.items()}
    nodes = sum(1 for n in traced.graph.graph.nodes if n.op == "call_function" and n.target is not operator.getitem)
    add_step_terms(plan, shapes, nodes, profile)


def _peak_rss_gib() -> float:
    """This process' memory high-water mark so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**30 if sys.platform == "darwin" else 2**20)
