"""Exact solvers: the local-polytope ILP of ``exact.model`` solved by HiGHS or CBC.

Both backends share the model, the result checks and the infeasibility
diagnosis (``IlpSolver``); they differ only in how the arrays reach the
solver: HiGHS (here) takes the CSR matrix as is, CBC (``cbc``) reads an MPS
file written from it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from torchtitan_autoparallel.planner.problem.problem import InfeasibleProblem, Problem
from torchtitan_autoparallel.planner.solve.approx.solver import ApproxSolver
from torchtitan_autoparallel.planner.solve.base import Solution, memory_message
from torchtitan_autoparallel.planner.solve.exact.fixing import (
    Relaxation,
    approximate,
    best_known_plan,
    cheapest,
    fixed_columns,
    log_fixing,
)
from torchtitan_autoparallel.planner.solve.exact.model import (
    IlpModel,
    build_ilp,
)

LOG = logging.getLogger("torchtitan_autoparallel.planner")
PROGRESS_EVERY_S = 5.0
MIP_REL_GAP = 1e-9  # small enough that "optimal" really means optimal
OBJECTIVE_RTOL = 1e-6
OPTIMAL_RTOL = 1e-9  # plan within this of its bound: optimal (as ``trws.OPTIMAL_RTOL``)
INTEGRALITY_TOL = 1e-6  # HiGHS' own default mip_feasibility_tolerance
LP_SHARE = 0.7  # of the limit, for the LP relaxation before the MIP
FALLBACK_SHARE = 0.1  # of the time limit, granted on top to the approximate fallback
QUICK_SHARE = 0.1  # of the time limit, for the approximate plan tried first under a mip_gap


@dataclass
class _Run:
    status: str  # "optimal" | "time_limit" | "feasible" | "infeasible" | "no_solution"
    col_value: np.ndarray | None = None
    objective: float = math.nan  # the solver's own figure, model.offset excluded
    bound: float = -math.inf  # the solver's best bound, model.offset excluded


class IlpSolver:
    """Shared flow: build, run the backend, verify, diagnose infeasibility.

    ``mip_gap``: the relative gap at which the search stops, measured on the
    problem the solver is given (after the presolve, whose eliminated energy is
    left out: costs are times, so the whole plan's gap is no larger); HiGHS and
    CBC measure it on the model, without its constant energy too. Above
    ``MIP_REL_GAP`` a plan stopped short of a proof reports "feasible" with the
    bound that was proved."""

    name: str
    mip_gap: float = MIP_REL_GAP

    @property
    def stops_early(self) -> bool:
        return self.mip_gap > MIP_REL_GAP

    def _gap_status(self, run: _Run) -> _Run:
        """A search stopped at ``mip_gap`` says "optimal"; only a closed gap is."""
        if run.status == "optimal" and self.stops_early:
            if run.objective - run.bound > OPTIMAL_RTOL * max(abs(run.objective), 1.0):
                run.status = "feasible"
        return run

    def _run(
        self, model: IlpModel, time_limit: float | None, problem: Problem | None = None
    ) -> _Run:
        """Solve ``model``; ``problem``, the one it was built from, lets a backend
        improve its warm start."""
        raise NotImplementedError

    def solve(self, problem: Problem, time_limit: float | None = None) -> Solution:
        start = time.perf_counter()
        if problem.num_nodes == 0:
            return Solution(np.zeros(0, np.int64), 0.0, 0.0, self.name, "optimal", 0.0)
        model = build_ilp(problem)
        LOG.info(
            "%s: %d nodes, %d edges -> %s (built in %.2f s)",
            self.name, problem.num_nodes, len(problem.edges), model.describe(),
            time.perf_counter() - start,
        )
        run = self._quick(problem, model, start, time_limit) or self._run(
            model, _remaining(start, time_limit), problem
        )
        if run.status == "infeasible":
            raise InfeasibleProblem(self._why_infeasible(problem, model, start, time_limit))
        if run.status == "no_solution":
            return self._approximate(problem, start, time_limit)
        assignment = model.assignment(run.col_value)
        objective = problem.energy(assignment)
        _check_objective(self.name, objective, run.objective + model.offset)
        if not problem.is_feasible(assignment, energy=objective):
            raise RuntimeError(f"{self.name}: the solver's plan violates the problem's constraints")
        status = run.status
        lower = objective if status == "optimal" else min(objective, run.bound + model.offset)
        if objective - lower <= OPTIMAL_RTOL * max(abs(objective), 1.0):
            status = "optimal"  # e.g. the approximate solver's plan met its own bound
        seconds = time.perf_counter() - start
        LOG.info(
            "%s: %s, objective %.6g us, bound %.6g us, %.2f s",
            self.name, status, objective, lower, seconds,
        )
        return Solution(assignment, objective, lower, self.name, status, seconds)

    def _quick(
        self, problem: Problem, model: IlpModel, start: float, time_limit: float | None
    ) -> _Run | None:
        """With a ``mip_gap``: the approximate solver first (a fraction of a second), whose
        plan is taken when its own bound already proves it within the gap: on 3-D meshes
        the LP alone can take a minute."""
        if not self.stops_early:
            return None
        share = None if time_limit is None else QUICK_SHARE * time_limit
        sol = model.approx = approximate(problem, share)
        if sol is None:
            return None
        if model.start is None or sol.objective < problem.energy(model.start):
            model.start = sol.assignment  # the MIP's warm start, should it run
        if sol.gap > self.mip_gap:
            return None
        LOG.info(
            "%s: the approximate plan is within %.3g%% of its bound (mip_gap %.3g%%); no LP or MIP",
            self.name, 100 * sol.gap, 100 * self.mip_gap,
        )
        values = model.col_values(sol.assignment)
        return _Run("feasible", values, float(model.col_cost @ values), sol.lower_bound - model.offset)

    def _approximate(self, problem: Problem, start: float, time_limit: float | None) -> Solution:
        """No plan in time: the approximate solver's plan (with its own bound) beats none."""
        LOG.warning(
            "%s: no feasible plan within %s s; taking the approximate solver's", self.name, time_limit
        )
        grace = max(FALLBACK_SHARE * (time_limit or 0.0), 1.0)
        sol = ApproxSolver().solve(problem, grace)
        status = "optimal" if sol.status == "optimal" else "time_limit"
        seconds = time.perf_counter() - start
        return Solution(sol.assignment, sol.objective, sol.lower_bound, self.name, status, seconds)

    def _why_infeasible(
        self, problem: Problem, model: IlpModel, start: float, time_limit: float | None
    ) -> str:
        """Name the smallest feasible memory budget when the budget is the culprit."""
        base = "no plan satisfies the pins, ties and forbidden (inf) choices"
        if not model.has_memory_row:
            return base
        relaxed = model.min_memory_model()
        LOG.info("%s: infeasible; minimising memory to find the smallest budget", self.name)
        run = self._run(relaxed, _remaining(start, time_limit))
        if run.status == "infeasible":
            return base + " (even without the memory budget)"
        if run.status == "no_solution":
            return (
                "infeasible under the memory budget; the time limit stopped the search "
                "for the smallest feasible one"
            )
        minimum = problem.memory_used(relaxed.assignment(run.col_value))
        message = memory_message(problem.memory_budget, minimum)
        if run.status != "optimal":
            message += " (not proven smallest: time limit)"
        return message


def _remaining(start: float, time_limit: float | None) -> float | None:
    if time_limit is None:
        return None
    # a re-run after an infeasible first attempt still gets a usable slice
    return max(time_limit - (time.perf_counter() - start), min(1.0, time_limit))


def _check_objective(name: str, energy: float, solver_objective: float) -> None:
    if not math.isclose(energy, solver_objective, rel_tol=OBJECTIVE_RTOL, abs_tol=OBJECTIVE_RTOL):
        raise RuntimeError(
            f"{name}: recomputed energy {energy!r} differs from the solver's objective "
            f"{solver_objective!r}"
        )


class _Heartbeat:
    """Logs progress every few seconds from a side thread while a solver runs.

    HiGHS only calls back at certain points of its MIP loop (none during a long
    root LP) and CBC runs in a subprocess, so a timer thread is the one way to
    get a steady pulse; both release the GIL while they work.
    """

    def __init__(self, name: str, summary: Callable[[], str] = lambda: "") -> None:
        self.name, self.summary = name, summary
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)
        self._start = time.perf_counter()

    def _beat(self) -> None:
        while not self._stop.wait(PROGRESS_EVERY_S):
            elapsed = time.perf_counter() - self._start
            LOG.info("%s: %.0f s elapsed%s", self.name, elapsed, self.summary())

    def __enter__(self) -> _Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class _MipStats:
    """Keeps HiGHS' latest incumbent and bound (from its MIP callback) for the heartbeat."""

    def __init__(self, offset: float) -> None:
        self.offset = offset
        self.latest: tuple[int, float, float] | None = None

    def __call__(self, event) -> None:  # noqa: ANN001 (highspy's event type)
        out = event.data_out  # stored raw: formatting here would slow every callback
        self.latest = (out.mip_node_count, out.mip_primal_bound, out.mip_dual_bound)

    def summary(self) -> str:
        if self.latest is None:
            return " (before the first MIP node)"
        nodes, primal, dual = self.latest
        return (
            f", {nodes} B&B nodes, incumbent {primal + self.offset:.6g} us, "
            f"bound {dual + self.offset:.6g} us"
        )


class HighsILPSolver(IlpSolver):
    def __init__(
        self, name: str = "ilp-highs", threads: int | None = None, highs_presolve: bool = True,
        mip_gap: float = MIP_REL_GAP,
    ) -> None:
        self.name = name
        self.threads = threads
        self.mip_gap = mip_gap
        # off when the model comes out of the exact presolve: HiGHS' presolve then
        # finds little and can cost more than the solve itself
        self.highs_presolve = highs_presolve

    def _run(
        self, model: IlpModel, time_limit: float | None, problem: Problem | None = None
    ) -> _Run:
        """LP relaxation first (integral: done); else, given the ``problem`` the model
        was built from, reduced-cost fixing against the best plan known (``fixing``),
        then the MIP over the columns left."""
        start = time.perf_counter()
        # most of the time: the MIP of a big model without the LP's duals gets no
        # further than its own root LP, while after fixing it is small
        relaxed = self._run_lp(model, None if time_limit is None else LP_SHARE * time_limit)
        if isinstance(relaxed, _Run):
            return relaxed
        if relaxed is None and problem is not None:
            # the MIP's root LP is this LP again: in the time left it gets no further
            return self._without_lp(problem, model, _remaining(start, time_limit))
        fixed = None
        if relaxed is not None and problem is not None:
            deadline = None if time_limit is None else start + time_limit
            fixed = self._fix(problem, model, relaxed, deadline)
            known = None if fixed is None else self._known_within_gap(model, relaxed)
            if known is not None:
                return known
        run = self._run_mip(model, _remaining(start, time_limit), fixed)
        if fixed is not None and run.status in ("infeasible", "no_solution"):
            # only numerical trouble can get here: the known plan is in the restricted model
            LOG.warning("%s: the MIP after fixing found no plan; keeping the known one", self.name)
            values = model.col_values(model.start)
            return _Run("feasible", values, float(model.col_cost @ values), relaxed.value)
        if relaxed is not None:
            run.bound = max(run.bound, relaxed.value)
        return run

    def _known_within_gap(self, model: IlpModel, lp: Relaxation) -> _Run | None:
        """The best known plan, when the LP already proves it within ``mip_gap``."""
        if not self.stops_early:
            return None
        values = model.col_values(model.start)
        upper = float(model.col_cost @ values)
        if upper - lp.value > self.mip_gap * abs(upper):
            return None
        LOG.info(
            "%s: the best known plan is within %.3g%% of the LP bound (mip_gap %.3g%%); no MIP",
            self.name, 100 * (upper - lp.value) / max(abs(upper), 1e-9), 100 * self.mip_gap,
        )
        return _Run("feasible", values, upper, lp.value)

    def certify(self, model: IlpModel, upper: float, time_limit: float | None) -> float:
        """A lower bound on the model's optimum (model space) given a plan of cost
        ``upper``: the LP value, raised by the MIP over the columns reduced-cost fixing
        leaves (the plan is optimal if that MIP finds nothing cheaper); -inf when the LP
        does not finish."""
        start = time.perf_counter()
        relaxed = self._run_lp(model, None if time_limit is None else LP_SHARE * time_limit)
        if isinstance(relaxed, _Run):  # integral: the optimum; infeasible: no plan at all
            return relaxed.objective if relaxed.status == "optimal" else upper
        if relaxed is None:
            return -math.inf
        fixed = fixed_columns(model, relaxed, upper)
        log_fixing(self.name, model, relaxed, upper, fixed)
        run = self._run_mip(model, _remaining(start, time_limit), fixed)
        if run.status == "infeasible":
            return upper  # every plan cheaper than ``upper`` was in the model
        # plans outside the restricted model cost more than ``upper``
        proven = run.objective if run.status == "optimal" else run.bound
        return max(relaxed.value, min(proven, upper))

    def _without_lp(self, problem: Problem, model: IlpModel, time_limit: float | None) -> _Run:
        """The LP did not finish: the approximate solver's plan and bound, or the warm start's."""
        LOG.warning(
            "%s: the LP relaxation did not finish; the approximate solver gets the time left",
            self.name,
        )
        sol = model.approx or approximate(problem, time_limit)
        plan = cheapest(problem, [model.start, None if sol is None else sol.assignment])
        if plan is None:
            return _Run("no_solution")
        values = model.col_values(plan)
        bound = -math.inf if sol is None else sol.lower_bound - model.offset
        return _Run("time_limit", values, float(model.col_cost @ values), bound)

    def _fix(
        self, problem: Problem, model: IlpModel, lp: Relaxation, deadline: float | None
    ) -> np.ndarray | None:
        """Columns the LP rules out against the best plan known (which becomes the start)."""
        plan = best_known_plan(problem, model, lp, deadline)
        if plan is None:
            return None
        model.start = plan
        upper = problem.energy(plan) - model.offset
        fixed = fixed_columns(model, lp, upper)
        log_fixing(self.name, model, lp, upper, fixed)
        return fixed

    def _run_lp(self, model: IlpModel, time_limit: float | None) -> _Run | Relaxation | None:
        """The LP relaxation alone: when its optimum is integral it is the ILP's
        optimum (its bound is met), found without the MIP machinery, whose own
        presolve can cost several times the LP on big tight models. A fractional
        optimum comes back with its reduced costs; None if the LP did not finish."""
        import highspy

        # HiGHS' presolve pays off on the LP when a memory row couples the nodes (as in
        # ``lp.solve_lp``); the MIP keeps the solver's setting
        presolve = self.highs_presolve or model.has_memory_row
        h = self._highs(model, time_limit, integer=False, presolve=presolve)
        with _Heartbeat(self.name, lambda: " (LP relaxation)"):
            h.run()
        ms = h.getModelStatus()
        if ms == highspy.HighsModelStatus.kInfeasible:
            return _Run("infeasible")  # no fractional plan, so no integral one
        if ms != highspy.HighsModelStatus.kOptimal:
            return None
        solution = h.getSolution()
        values = np.asarray(solution.col_value, dtype=np.float64)
        objective = h.getInfo().objective_function_value
        x = values[: model.num_x]
        if np.minimum(np.abs(x), np.abs(1.0 - x)).max(initial=0.0) > INTEGRALITY_TOL:
            if not solution.dual_valid:
                return None
            return Relaxation(objective, values, np.asarray(solution.col_dual, dtype=np.float64))
        LOG.info("%s: the LP relaxation is integral, so optimal", self.name)
        return _Run("optimal", values, objective, objective)

    def _run_mip(
        self, model: IlpModel, time_limit: float | None, fixed: np.ndarray | None = None
    ) -> _Run:
        import highspy

        # with columns fixed, HiGHS' presolve is what removes them
        presolve = self.highs_presolve or fixed is not None
        h = self._highs(model, time_limit, integer=True, presolve=presolve, fixed=fixed)
        if model.start is not None:
            values = model.col_values(model.start)
            h.setSolution(len(values), np.arange(len(values), dtype=np.int32), values)
        stats = _MipStats(model.offset)
        h.cbMipInterrupt.subscribe(stats)
        with _Heartbeat(self.name, stats.summary):
            h.run()
        return self._result(h, highspy)

    def _highs(  # noqa: ANN202 (a highspy.Highs)
        self,
        model: IlpModel,
        time_limit: float | None,
        integer: bool,
        presolve: bool | None = None,
        fixed: np.ndarray | None = None,
    ):
        """HiGHS loaded with ``model``; ``presolve`` None keeps the solver's setting,
        ``fixed`` columns get an upper bound of 0."""
        import highspy

        if model.num_nz >= 2**31:
            raise ValueError(f"{self.name}: {model.num_nz} nonzeros exceed HiGHS' int32 indices")
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("mip_rel_gap", self.mip_gap)
        if time_limit is not None:
            h.setOptionValue("time_limit", float(time_limit))
        if self.threads is not None:
            h.setOptionValue("threads", int(self.threads))
        if not (self.highs_presolve if presolve is None else presolve):
            h.setOptionValue("presolve", "off")
        integrality = np.zeros(model.num_col, dtype=np.int32)
        if integer:
            integrality[: model.num_x] = int(highspy.HighsVarType.kInteger)
        status = h.passModel(
            model.num_col, model.num_row, model.num_nz,
            int(highspy.MatrixFormat.kRowwise), int(highspy.ObjSense.kMinimize), 0.0,
            model.col_cost, np.zeros(model.num_col),
            np.ones(model.num_col) if fixed is None else np.where(fixed, 0.0, 1.0),
            model.row_lower, model.row_upper,
            model.row_start[:-1].astype(np.int32), model.row_index.astype(np.int32),
            model.row_value, integrality,
        )
        if status == highspy.HighsStatus.kError:
            raise RuntimeError(f"{self.name}: HiGHS rejected the model")
        return h

    def _result(self, h, highspy) -> _Run:  # noqa: ANN001 (highspy objects)
        ms = h.getModelStatus()
        info = h.getInfo()
        has_solution = info.primal_solution_status == highspy.kSolutionStatusFeasible
        kinds = highspy.HighsModelStatus
        if ms in (kinds.kInfeasible, kinds.kUnboundedOrInfeasible):
            return _Run("infeasible")
        if ms == kinds.kOptimal:
            status = "optimal"  # within mip_gap: closed, or "feasible" below
        elif ms in (kinds.kTimeLimit, kinds.kInterrupt, kinds.kIterationLimit,
                    kinds.kSolutionLimit):
            status = "time_limit" if has_solution else "no_solution"
        else:
            raise RuntimeError(f"{self.name}: HiGHS ended with {h.modelStatusToString(ms)}")
        if status == "no_solution":
            return _Run(status)
        values = np.asarray(h.getSolution().col_value, dtype=np.float64)
        run = _Run(status, values, info.objective_function_value, info.mip_dual_bound)
        return self._gap_status(run)
