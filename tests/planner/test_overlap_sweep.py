"""The theta sweep (``solvers/overlap_lagrange``): overlap plans and bounds from plain solves."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
from test_overlap import _brute_force, _layered_problem, _random_problem

from torchtitan_autoparallel.planner.problem.problem import Problem
from torchtitan_autoparallel.planner.solve import get_solver
from torchtitan_autoparallel.planner.solve.overlap.lagrange import (
    SweepOverlapSolver,
    reweighted,
    slope,
    sweep,
)
from torchtitan_autoparallel.planner.solve.overlap.model import OverlapSpec
from torchtitan_autoparallel.planner.solve.overlap.solver import OverlapSolver, overlap_objective
from torchtitan_autoparallel.planner.solve.overlap.terms import overlappable
from torchtitan_autoparallel.planner.solve.presolve.pipeline import presolve
from torchtitan_autoparallel.planner.solve.registry import AutoSolver, overlap_solver

TOL = 1e-6


def _split(problem, spec, x):  # noqa: ANN001, ANN202
    """(compute, overlappable comm, other comm) of a plan, summed by hand."""
    edges = set(overlappable(problem, spec)[0].tolist())
    compute = sum(float(problem.unary[v][x[v]]) for v in range(problem.num_nodes))
    ov = other = 0.0
    for e, (u, v) in enumerate(problem.edges):
        cost = float(problem.pairwise[e][x[u], x[v]])
        if e in edges:
            ov += cost
        else:
            other += cost
    return compute, ov, other


@pytest.mark.parametrize("seed", range(4))
def test_reweighted_energy_is_the_lagrangian_of_every_plan(seed):
    rng = np.random.default_rng(seed)
    problem, spec = _random_problem(rng, n=6)
    edges = overlappable(problem, spec)[0]
    for theta in (0.0, 0.3, 1.0):
        scaled = reweighted(problem, edges, theta)
        for _ in range(5):
            x = np.array([rng.integers(len(u)) for u in problem.unary])
            c, o, n = _split(problem, spec, x)
            assert scaled.energy(x) == pytest.approx((1 - theta) * c + theta * o + n)
            assert slope(problem, edges, x) == pytest.approx(o - c)
            # the bound's premise: no plan saves more than min(C, O)
            assert overlap_objective(problem, spec, x) >= c + o + n - min(c, o) - TOL


def test_forbidden_choices_stay_forbidden_at_theta_zero():
    problem, spec = _random_problem(np.random.default_rng(1), n=4)
    e = int(overlappable(problem, spec)[0][0])
    problem.pairwise[e] = problem.pairwise[e].copy()
    problem.pairwise[e][0, 0] = np.inf
    scaled = reweighted(problem, np.array([e]), 0.0)
    assert np.isinf(scaled.pairwise[e][0, 0]) and not np.isnan(scaled.pairwise[e]).any()


@pytest.mark.parametrize("seed", range(8))
def test_sweep_bound_and_plan_bracket_the_exact_optimum(seed):
    problem, spec = _random_problem(np.random.default_rng(300 + seed), n=6)
    exact = _brute_force(problem, spec)
    score = lambda x: overlap_objective(problem, spec, x)  # noqa: E731
    found = sweep(problem, spec, get_solver("ilp"), score)
    assert found.bound <= exact + TOL <= found.objective + 2 * TOL
    assert found.objective == pytest.approx(score(found.assignment))
    plain = get_solver("ilp").solve(problem)
    assert found.objective <= score(plain.assignment) + TOL  # never worse than overlap off
    # every step's bound is a bound
    assert all(bound <= exact + TOL for _, _, bound in found.trace)


@pytest.mark.parametrize("level", ["INFO", "DEBUG"])
def test_sweep_logs_a_line_a_step_and_hides_its_plain_solves_at_info(level, caplog):
    problem, spec = _random_problem(np.random.default_rng(300), n=6)
    score = lambda x: overlap_objective(problem, spec, x)  # noqa: E731
    logger = logging.getLogger("torchtitan_autoparallel.planner")
    with caplog.at_level(level, logger=logger.name):
        found = sweep(problem, spec, get_solver("ilp"), score)
        assert logger.level == logging.getLevelName(level)  # restored after the sweep
    steps = re.findall(r"overlap sweep (\d+)/\d+: theta", caplog.text)
    assert steps == [str(i + 1) for i in range(len(found.trace))] and steps
    # the plain ILP's own lines ("ilp-highs: presolve: ...") only where DEBUG asks for them
    assert ("ilp-highs: presolve" in caplog.text) == (level == "DEBUG")


@pytest.mark.parametrize("seed", range(3))
def test_approx_with_overlap_returns_a_certified_plan(seed):
    problem, spec = _layered_problem(np.random.default_rng(seed))
    exact = overlap_solver("ilp", "highs", spec).solve(problem).objective
    solver = overlap_solver("approx", "highs", spec)
    assert isinstance(solver, SweepOverlapSolver)
    sol = solver.solve(problem, time_limit=30)
    assert problem.is_feasible(sol.assignment)
    assert sol.objective == pytest.approx(overlap_objective(problem, spec, sol.assignment))
    assert sol.lower_bound <= exact + TOL <= sol.objective + 2 * TOL


def test_approx_with_overlap_keeps_the_memory_budget():
    problem, spec = _layered_problem(np.random.default_rng(5))
    w = [problem.node_names.index(f"w{layer}") for layer in range(2)]
    for v in w:  # strategy 0 shards the weight (1 unit), strategy 1 keeps it whole (4 units)
        problem.memory[v] = np.array([1.0, 4.0])
    problem.memory_budget = 2.0  # only the sharded weights fit
    unlimited = overlap_solver("approx", "highs", spec).solve(_without_budget(problem), time_limit=30)
    sol = overlap_solver("approx", "highs", spec).solve(problem, time_limit=30)
    assert problem.memory_used(sol.assignment) <= 2.0 + TOL
    assert problem.is_feasible(sol.assignment)
    assert sol.objective >= unlimited.lower_bound - TOL


def _without_budget(problem):  # noqa: ANN001, ANN202
    from dataclasses import replace

    return replace(problem, memory_budget=None)


def test_auto_with_overlap_picks_exact_or_sweep():
    spec = OverlapSpec(3, prefetch=[0], backward=[])
    solver = overlap_solver("auto", "highs", spec)
    assert isinstance(solver, AutoSolver)
    assert isinstance(solver.exact, OverlapSolver) and isinstance(solver.approx, SweepOverlapSolver)
    with pytest.raises(ValueError, match="accepted: approx, auto, brute-force, ilp$"):
        overlap_solver("greedy", "highs", spec)


def test_exact_path_reports_the_better_of_sweep_and_mip_bounds():
    problem, spec = _layered_problem(np.random.default_rng(7))
    sol = overlap_solver("ilp", "highs", spec).solve(problem)
    assert sol.lower_bound <= _brute_force(problem, spec) + TOL
    assert sol.objective == pytest.approx(_brute_force(problem, spec), abs=1e-6)


def test_restrict_inverts_expand_and_refuses_dropped_strategies():
    import itertools


    rng = np.random.default_rng(11)
    pairs = [(u, v) for u in range(5) for v in range(u + 1, 5)]  # K5: nothing to eliminate
    tables = [rng.uniform(0, 100, size=(3, 3)).round(1) for _ in pairs]
    for t, (u, _) in zip(tables, pairs):
        if u == 0:
            t[2] = t[0]  # node 0's strategy 2 is strategy 0 plus 1000 us of compute: dominated
    problem = Problem(
        node_names=[f"n{i}" for i in range(5)], strategy_labels=[["a", "b", "c"]] * 5,
        unary=[np.array([0.0, 0.0, 1000.0])] + [rng.uniform(0, 5, size=3).round(1) for _ in range(4)],
        edges=np.array(pairs), pairwise=tables,
    )
    pre = presolve(problem, dominance=True)
    assert pre.reduced.num_nodes == 5 and len(pre.reduced.unary[0]) == 2  # K5 survives, minus 0's "c"
    for r in itertools.islice(itertools.product(*(range(len(u)) for u in pre.reduced.unary)), 40):
        assert pre.restrict(pre.expand(np.array(r))).tolist() == list(r)
    assert pre.restrict(np.array([2, 0, 0, 0, 0])) is None


@pytest.mark.usefixtures("fake_world")
def test_debug_model_plans_with_overlap_on_the_approximate_solver():
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_autoparallel.models.registry import build_meta_model
    from torchtitan_autoparallel.planner.cost.profiles import load_profile
    from torchtitan_autoparallel.planner.plan.api import plan_stages
    from torchtitan_autoparallel.planner.plan.options import PlannerOptions
    from torchtitan_autoparallel.planner.plan.overlap import overlap_spec

    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",))
    model = build_meta_model("llama3", "debugmodel", n_layers=1)
    options = PlannerOptions(global_batch_size=8, seq_len=64, profile=load_profile("h100"), time_limit_s=60,
                             solver="approx")
    plain = plan_stages(model, mesh, options)
    stages = plan_stages(model, mesh, options.replace(overlap=True))
    plan, p = stages.plan, stages.plan.predicted
    assert plan.solver == "approx-trws+overlap"
    assert plan.objective == pytest.approx(p["effective_us"], rel=1e-6)
    assert p["overlap_savings_us"] > 0
    # the sweep keeps the plain plan among its candidates: never worse than it, overlap priced
    spec = overlap_spec(stages.built, stages.traced)
    plain_x = plain.solution.assignment
    assert plan.objective <= overlap_objective(stages.built.problem, spec, plain_x) + 1e-6
    assert plan.objective < plain.plan.objective
    assert plan.lower_bound <= plan.objective + 1e-6
