"""``autoparallel.mip_gap``: the exact solvers stop once their plan is proven within it.

Throughout, against the proven optimum: a plan taken under a gap costs at
least the optimum, its bound is at most the optimum, and the two are within
the gap; "optimal" is said only of a closed gap.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from _run import LLAMA3_CONFIG
from test_overlap import _layered_problem
from test_solvers import random_problem
from test_solvers_fast import assert_scored

from torchtitan_autoparallel.config import load_config
from torchtitan_autoparallel.errors import ConfigError
from torchtitan_autoparallel.planner.problem.problem import Problem
from torchtitan_autoparallel.planner.solve import CbcILPSolver, HighsILPSolver, get_solver, overlap_solver
from torchtitan_autoparallel.planner.solve import registry as auto
from torchtitan_autoparallel.planner.solve.exact import ilp
from torchtitan_autoparallel.planner.solve.exact.cbc import _cbc_args
from torchtitan_autoparallel.planner.solve.exact.lp_bound import solve_lp
from torchtitan_autoparallel.planner.solve.exact.model import build_ilp
from torchtitan_autoparallel.planner.solve.overlap import solver as overlap

TOL = 1e-6
LOGGER = "torchtitan_autoparallel.planner"


def assert_within(sol, optimum: float, gap: float) -> None:
    """A plan no cheaper than the optimum, a bound no higher, the two within ``gap``."""
    assert sol.objective >= optimum - TOL * max(abs(optimum), 1.0)
    assert sol.lower_bound <= optimum + TOL * max(abs(optimum), 1.0)
    assert sol.gap <= gap + 1e-12
    if sol.status == "optimal":
        assert sol.lower_bound == pytest.approx(sol.objective, rel=1e-9)
    else:
        assert sol.status == "feasible" and sol.lower_bound < sol.objective


def fractional_problems(count: int) -> list[Problem]:
    """Random problems whose LP relaxation is fractional: the MIP has work to do."""
    found = []
    for seed in range(200):
        problem = random_problem(2000 + seed, num_nodes=(6, 9), inf_fraction=0.0)
        if not solve_lp(problem, None).integral:
            found.append(problem)
        if len(found) == count:
            return found
    raise AssertionError("too few fractional problems")


@pytest.mark.parametrize("backend", ["highs", "cbc"])
def test_a_plan_its_own_bound_proves_within_the_gap_needs_no_lp(backend, monkeypatch, caplog) -> None:
    """The approximate plan is taken when its TRW-S bound proves it: no LP, no MIP is built."""
    solver_class = HighsILPSolver if backend == "highs" else CbcILPSolver

    def no_exact_search(self, model, time_limit, problem=None):  # noqa: ANN001, ANN202
        raise AssertionError("the exact search ran")

    problems = [random_problem(300 + seed, num_nodes=(5, 8), inf_fraction=0.0) for seed in range(12)]
    optima = [get_solver("ilp", backend, presolve=False).solve(p).objective for p in problems]
    monkeypatch.setattr(solver_class, "_run", no_exact_search)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for problem, optimum in zip(problems, optima):
            sol = get_solver("ilp", backend, presolve=False, mip_gap=0.5).solve(problem)
            assert_scored(problem, sol)
            assert_within(sol, optimum, 0.5)
    assert caplog.text.count("no LP or MIP") == len(problems)


def test_the_lp_proves_the_best_known_plan_within_the_gap_and_skips_the_mip(monkeypatch, caplog) -> None:
    """With the approximate shortcut off, a fractional LP whose value is within the gap
    of the best known plan ends the search before the MIP."""
    monkeypatch.setattr(ilp, "approximate", lambda problem, limit: None)  # only the shortcut's
    skipped = 0
    for problem in fractional_problems(6):
        optimum = get_solver("ilp", presolve=False).solve(problem).objective
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=LOGGER):
            sol = get_solver("ilp", presolve=False, mip_gap=0.5).solve(problem)
        assert_scored(problem, sol)
        assert_within(sol, optimum, 0.5)
        if "no MIP" in caplog.text:
            skipped += 1
            assert sol.lower_bound == pytest.approx(solve_lp(problem, None).value, rel=1e-7)
    assert skipped >= 3  # the path is really taken


def test_without_a_gap_every_plan_is_proven_optimal() -> None:
    for problem in fractional_problems(4):
        sol = get_solver("ilp", presolve=False).solve(problem)
        assert sol.status == "optimal" and sol.lower_bound == sol.objective


def test_a_highs_mip_stopped_at_its_gap_is_feasible_not_optimal() -> None:
    solver = HighsILPSolver(mip_gap=0.01)
    stopped = solver._gap_status(ilp._Run("optimal", np.zeros(1), 100.0, 99.5))
    closed = solver._gap_status(ilp._Run("optimal", np.zeros(1), 100.0, 100.0))
    exact = HighsILPSolver()._gap_status(ilp._Run("optimal", np.zeros(1), 100.0, 99.5))
    assert (stopped.status, stopped.bound) == ("feasible", 99.5)
    assert closed.status == "optimal"
    assert exact.status == "optimal"  # at the default gap HiGHS' "optimal" stands


CBC_WITHIN_GAP_LOG = """Result - Optimal solution found (within gap tolerance)

Objective value:                6801.15827396
Lower bound:                    6800.966
Gap:                            0.00
"""


@pytest.mark.parametrize("within_gap", [True, False])
def test_cbc_within_its_ratio_keeps_the_bound_from_its_log(within_gap: bool) -> None:
    """What CBC 2.10 prints when ``-ratio`` stops it, and when it proves the optimum."""
    problem = random_problem(11, num_nodes=(4, 5))
    model = build_ilp(problem)
    plan = get_solver("ilp", presolve=False).solve(problem).assignment
    values = model.col_values(plan)
    objective = float(model.col_cost @ values)
    head = f"Optimal{' (within gap tolerance)' if within_gap else ''} - objective value {objective}\n"
    log = CBC_WITHIN_GAP_LOG if within_gap else "Result - Optimal solution found\n"
    run = CbcILPSolver(mip_gap=0.01)._outcome(model, 0, (head, values), log)
    if within_gap:
        assert run.status == "feasible"
        assert run.bound == pytest.approx(objective - (6801.15827396 - 6800.966))
    else:
        assert run.status == "optimal" and run.bound == objective
    paths = {k: f"model.{k}" for k in ("mps", "mst", "sol", "log")}
    args = _cbc_args(model, paths, None, 0.01)
    assert args[args.index("-ratio") + 1] == "0.01"


class _Refuse:
    name = "approx-trws"

    def solve(self, problem, time_limit=None):  # noqa: ANN001, ANN201
        raise AssertionError("auto ran the approximate solver")


def test_auto_keeps_an_exact_plan_within_its_gap_without_the_approximate_solver() -> None:
    candidates = (random_problem(seed, num_nodes=(5, 8), inf_fraction=0.0) for seed in range(300, 360))
    problem = next(p for p in candidates if HighsILPSolver(mip_gap=0.5).solve(p).status == "feasible")
    optimum = get_solver("ilp", presolve=False).solve(problem).objective
    sol = auto.AutoSolver(HighsILPSolver(mip_gap=0.5), _Refuse(), accept_gap=0.5).solve(problem)
    assert sol.status == "feasible"
    assert_within(sol, optimum, 0.5)
    with pytest.raises(AssertionError, match="ran the approximate solver"):  # without accept_gap
        auto.AutoSolver(HighsILPSolver(mip_gap=0.5), _Refuse()).solve(problem)
    assert_within(get_solver("auto", presolve=False, mip_gap=0.5).solve(problem), optimum, 0.5)


@pytest.mark.parametrize("seed", range(4))
def test_overlap_takes_the_sweeps_plan_within_the_gap(seed: int, monkeypatch, caplog) -> None:
    problem, spec = _layered_problem(np.random.default_rng(seed))
    optimum = overlap_solver("ilp", "highs", spec).solve(problem)
    assert optimum.status == "optimal"

    def no_mip(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the overlap MIP was built")

    monkeypatch.setattr(overlap, "_instance", no_mip)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        sol = overlap_solver("ilp", "highs", spec, mip_gap=0.9).solve(problem)
    assert "no MIP needed" in caplog.text
    assert_within(sol, optimum.objective, 0.9)


def test_overlap_mip_takes_the_gap_it_is_given(monkeypatch) -> None:
    """Below the sweep's gap the MIP runs, with HiGHS' mip_rel_gap set to the user's."""
    seen = []
    original = HighsILPSolver._highs

    def spy(self, model, time_limit, integer, **options):  # noqa: ANN001, ANN003, ANN202
        if integer:
            seen.append(self.mip_gap)
        return original(self, model, time_limit, integer, **options)

    monkeypatch.setattr(HighsILPSolver, "_highs", spy)
    problem, spec = _layered_problem(np.random.default_rng(0))
    for gap, expected in ((None, overlap.OVERLAP_MIP_GAP), (0.0, 0.0)):
        seen.clear()
        overlap_solver("ilp", "highs", spec, mip_gap=gap).solve(problem)
        assert set(seen) <= {expected}


def test_config_accepts_a_gap_in_zero_to_one_and_refuses_others() -> None:
    assert load_config([]).autoparallel.mip_gap is None
    assert load_config(["--autoparallel.mip_gap", "0.01"]).autoparallel.mip_gap == 0.01
    for bad in ("1.5", "-0.1", "1"):
        with pytest.raises(ConfigError) as info:
            load_config(["--autoparallel.mip_gap", bad])
        message = str(info.value)
        assert "\n" not in message
        assert f"autoparallel.mip_gap = {float(bad)} is not accepted; accepted: a relative gap in [0, 1)" in message


def test_the_plan_cache_key_covers_the_gap(fake_world) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_autoparallel.planner.cost.profiles import load_profile
    from torchtitan_autoparallel.planner.plan.cache import plan_settings
    from torchtitan_autoparallel.planner.plan.options import PlannerOptions

    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",))
    options = PlannerOptions(global_batch_size=8, seq_len=64, profile=load_profile("h100"))
    assert plan_settings(mesh, options) != plan_settings(mesh, options.replace(mip_gap=0.01))


@pytest.mark.parametrize(
    "solver,overlap_on,warned",
    [("approx", "false", True), ("approx", "true", True), ("ilp", "false", False), ("auto", "false", False)],
)
def test_a_gap_for_a_solver_without_a_mip_is_flagged(solver, overlap_on, warned, capsys) -> None:
    from torchtitan_autoparallel.launch import preflight

    argv = ["--ngpu", "2", "--job.config_file", str(LLAMA3_CONFIG), "--model.name", "llama3_auto_parallel",
            "--autoparallel.solver", solver, "--autoparallel.overlap", overlap_on, "--autoparallel.mip_gap", "0.01"]
    assert preflight.main(argv) == 0
    err = capsys.readouterr().err
    if warned:
        assert err.startswith(f"warning: autoparallel.mip_gap = 0.01 has no effect: solver = '{solver}'"), err
        assert err.count("\n") == 1
    else:
        assert err == ""


def test_plan_stages_passes_the_gap_to_the_solver(fake_world) -> None:
    """On the debug model's problem: TRW-S proves its plan within 5%, so that plan is taken
    ("feasible", with TRW-S' bound) where the exact run proves the optimum."""
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_autoparallel.models.registry import build_meta_model
    from torchtitan_autoparallel.planner.cost.profiles import load_profile
    from torchtitan_autoparallel.planner.plan.api import plan_stages
    from torchtitan_autoparallel.planner.plan.options import PlannerOptions

    model = build_meta_model("llama3", "debugmodel", n_layers=2)
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp_shard", "tp"))
    options = PlannerOptions(global_batch_size=8, seq_len=256, profile=load_profile("h100"), time_limit_s=120)
    exact = plan_stages(model, mesh, options)
    gapped = plan_stages(model, mesh, options.replace(mip_gap=0.05))
    assert exact.solution.status == "optimal"
    assert_within(gapped.solution, exact.solution.objective, 0.05)
    assert gapped.solution.status == "feasible"
    assert gapped.plan.lower_bound == pytest.approx(gapped.solution.lower_bound)
