"""The fast solvers (LP relaxation, TRW-S approximation, auto) and their certificates.

On random problems the brute-force optimum is the oracle; on the debug
model's real problem the exact ILP is. Throughout: LP bound <= optimum <=
every plan, each reported objective is the energy recomputed from the tables,
and each lower bound is a proven one.
"""

from __future__ import annotations

import dataclasses
import logging
import re

import numpy as np
import pytest
from test_solvers import random_problem

from torchtitan_autoparallel.config import load_config
from torchtitan_autoparallel.errors import ConfigError
from torchtitan_autoparallel.planner.problem.problem import InfeasibleProblem, Problem
from torchtitan_autoparallel.planner.solve import (
    ApproxSolver,
    BruteForceSolver,
    HighsILPSolver,
    get_solver,
)
from torchtitan_autoparallel.planner.solve import registry as auto_module
from torchtitan_autoparallel.planner.solve.approx import local_search
from torchtitan_autoparallel.planner.solve.approx.local_search import LocalState, polish
from torchtitan_autoparallel.planner.solve.approx.mrf import build_mrf
from torchtitan_autoparallel.planner.solve.approx.solver import search
from torchtitan_autoparallel.planner.solve.approx.trws import Trws, _stalled
from torchtitan_autoparallel.planner.solve.exact.ilp import _Run
from torchtitan_autoparallel.planner.solve.exact.lp_bound import lp_bound, solve_lp
from torchtitan_autoparallel.planner.solve.exact.rounding import round_and_polish
from torchtitan_autoparallel.planner.solve.presolve.pipeline import presolve

TOL = 1e-6
FAST = ["approx", "auto"]


def oracle(problem: Problem):
    try:
        return BruteForceSolver().solve(problem)
    except InfeasibleProblem as exc:
        return exc


def assert_scored(problem: Problem, sol) -> None:
    """The objective is the tables' energy, the plan is feasible, the bound is below it."""
    assert sol.objective == problem.energy(sol.assignment)
    assert problem.is_feasible(sol.assignment)
    assert sol.lower_bound <= sol.objective
    if problem.memory_budget is not None:
        assert problem.memory_used(sol.assignment) <= problem.memory_budget * (1 + 1e-9)


def mixed_problem(seed: int) -> Problem:
    """Random problems with every feature: forbidden pairs, pins, ties."""
    return random_problem(
        seed, num_nodes=(4, 9), inf_fraction=0.1 * (seed % 2), pins=int(seed % 3 == 0), ties=seed % 4 == 1
    )


# --- random problems against brute force -------------------------------------


@pytest.mark.parametrize("seed", range(16))
def test_lp_bound_below_optimum_below_every_plan(seed: int) -> None:
    problem = mixed_problem(seed)
    best = oracle(problem)
    if isinstance(best, InfeasibleProblem):
        for name in FAST:
            with pytest.raises(InfeasibleProblem):
                get_solver(name).solve(problem)
        return
    bounds = [lp_bound(problem, None, reduce=False), lp_bound(problem, None, reduce=True)]
    assert max(bounds) <= best.objective + TOL
    for name in FAST:
        sol = get_solver(name).solve(problem, time_limit=30)
        assert_scored(problem, sol)
        assert sol.objective >= best.objective - TOL
        assert sol.lower_bound <= best.objective + TOL
    lp = solve_lp(problem, None)
    if lp.integral:  # then the LP's plan is the optimum, and the ILP stops there saying so
        assert lp.value == pytest.approx(best.objective, rel=1e-9, abs=TOL)
        sol = HighsILPSolver().solve(problem)
        assert sol.status == "optimal"
        assert sol.objective == pytest.approx(best.objective, rel=1e-9)


def test_fractional_lp_rounds_and_polishes_to_a_feasible_plan_above_its_bound() -> None:
    """The rounded LP plan (an incumbent for reduced-cost fixing) fits, and the LP bounds it."""
    fractional = 0
    for seed in range(40):
        problem = random_problem(1000 + seed, num_nodes=(6, 9), inf_fraction=0.0)
        lp = solve_lp(problem, None)
        if lp.integral:
            continue
        fractional += 1
        best = BruteForceSolver().solve(problem)
        x = round_and_polish(problem, lp.marginals, None)
        assert x is not None and problem.is_feasible(x)
        assert lp.value <= best.objective + TOL <= problem.energy(x) + 2 * TOL
    assert fractional >= 3  # the case is really exercised


@pytest.mark.parametrize("iterations", [1, 2, 50])
def test_trws_bound_is_valid_at_every_iteration(iterations: int) -> None:
    for seed in range(30):
        problem = random_problem(2000 + seed, num_nodes=(3, 9), inf_fraction=0.15)
        best = oracle(problem)
        if isinstance(best, InfeasibleProblem):
            continue
        mrf = build_mrf(problem)
        run = Trws(mrf).run(mrf.flat_unary, None, max_iters=iterations, gap=0.0)
        assert run.bound <= best.objective + TOL
        assert run.energy >= best.objective - TOL
        assert run.iterations <= iterations


def _stall_point(bounds: list[float], energies: list[float], patience: int = 10) -> int | None:

    history: list[tuple[float, float]] = []
    for i, (b, e) in enumerate(zip(bounds, energies)):
        if _stalled(history, b, e, patience):
            return i
    return None


def test_trws_sweeps_visit_each_edge_once_behind_before_ahead() -> None:
    """Each sweep's plan lists, per node in sweep order, its links to neighbours
    already passed (in edge order) and then to those ahead (in edge order), with
    the messages in and out of each edge's two ends, every message once."""
    mrf = build_mrf(random_problem(4200, num_nodes=(12, 12)))
    trws = Trws(mrf)
    for plan, forward in ((trws.forward, True), (trws.backward, False)):
        nodes = plan.steps[:, 0].tolist()
        assert nodes == (sorted(nodes) if forward else sorted(nodes, reverse=True))
        seen = []
        for v, _, _, lo, hi in plan.steps.tolist():
            links = plan.links[lo:hi]
            flags = links[:, 0].tolist()
            assert flags == sorted(flags)  # behind (0) first, then ahead (1)
            for flag, u, at, into, out, rows in links.tolist():
                assert (u > v) == (flag == 1) if forward else (u < v) == (flag == 1)
                e = next(i for i, (a, b) in enumerate(mrf.edges.tolist())
                         if {a, b} == {u, v} and mrf.offset[i] == at and (a == v) == bool(rows))
                seen.append((e, v, into, out))
            edge_order = [e for e, *_ in seen[len(seen) - len(links):]]
            for flag in (0, 1):
                group = [e for e, f in zip(edge_order, flags) if f == flag]
                assert group == sorted(group)
        assert sorted(e for e, *_ in seen) == sorted(list(range(len(mrf.edges))) * 2)
        ends = {(e, v): (into, out) for e, v, into, out in seen}
        for e, (a, b) in enumerate(mrf.edges.tolist()):
            assert ends[e, a] == ends[e, b][::-1]  # one end's message in is the other's out
        assert sorted(m for m, _ in ends.values()) == sorted(trws.incoming.tolist())


def test_trws_stops_once_the_plan_settled_and_the_bound_only_creeps() -> None:
    sweeps = range(200)
    settled = [100.0] * 200
    creeping = [90.0 + 0.001 * i for i in sweeps]  # 0.01 per 10 sweeps against a gap of ~10
    assert _stall_point(creeping, settled) == 10
    closing = [90.0 + 0.05 * i for i in sweeps]  # 0.5 per 10 sweeps: 5% of the gap
    assert _stall_point(closing, settled) is None
    improving = [100.0 - 0.01 * i for i in sweeps]  # a better plan every sweep
    assert _stall_point(creeping, improving) is None
    flat = [95.0] * 200  # neither moves at all
    assert _stall_point(flat, settled) == 10


def test_approx_is_near_optimal_on_random_problems() -> None:
    gaps = []
    for seed in range(40):
        problem = mixed_problem(3000 + seed)
        best = oracle(problem)
        if isinstance(best, InfeasibleProblem):
            continue
        sol = ApproxSolver(gap=0.0).solve(problem)
        assert_scored(problem, sol)
        gaps.append(sol.objective / best.objective - 1)
    assert np.mean(np.array(gaps) < 1e-9) >= 0.9  # optimal nine times in ten
    assert max(gaps) < 0.1


def test_local_search_only_lowers_the_energy_and_keeps_the_budget() -> None:
    rng = np.random.default_rng(0)
    for seed in range(20):
        problem = random_problem(4000 + seed, inf_fraction=0.0, memory=True)
        heaviest = sum(float(m.max()) for m in problem.memory if m is not None)
        problem.memory_budget = 0.6 * heaviest if heaviest else None
        try:
            mrf = build_mrf(problem)
        except ValueError:  # the budget left some node without a label
            continue
        for _ in range(5):
            x = np.array([rng.integers(len(u)) for u in mrf.unary])
            y = polish(mrf, x, None)
            assert mrf.fits(y) or not mrf.fits(x)
            if mrf.fits(x):
                assert mrf.energy(y) <= mrf.energy(x) + TOL


def test_local_search_costs_are_the_tables_at_the_neighbours_labels() -> None:
    """``LocalState``'s cost table (compiled) holds, per node and label, the unary
    plus each incident table's entry at the neighbour's label, summed neighbour by
    neighbour in node order; moves keep it up to date."""
    rng = np.random.default_rng(1)
    mrf = build_mrf(random_problem(4100, inf_fraction=0.0))
    state = LocalState(mrf, np.array([rng.integers(k) for k in mrf.k]))

    ends = [(a, e, b, t) for e, ((a, b), t) in enumerate(zip(mrf.edges.tolist(), mrf.tables))]
    ends += [(b, e, a, t.T) for a, e, b, t in ends]  # each edge seen from both of its nodes

    def expected() -> np.ndarray:
        cost = state.unary.copy()
        for a, _, b, table in sorted(ends, key=lambda end: end[:2]):
            cost[b, : table.shape[1]] += table[state.x[a]]
        return cost

    np.testing.assert_array_equal(state.cost, expected())
    for _ in range(10):
        v = int(rng.integers(mrf.num_nodes))
        state.move(v, int(rng.integers(mrf.k[v])))
    np.testing.assert_allclose(state.cost, expected(), rtol=1e-12)
    state.refresh()
    np.testing.assert_array_equal(state.cost, expected())


def sparse_problem(seed: int, n: int = 60, chords: int = 10, memory: bool = False) -> Problem:
    """A path with a few chords: sparse enough that a star's answer depends on nodes
    two edges away and not on the rest."""
    rng = np.random.default_rng(seed)
    k = rng.integers(2, 6, size=n)
    edges = [(i, i + 1) for i in range(n - 1)]
    while len(edges) < n - 1 + chords:
        a, b = sorted(rng.choice(n, 2, replace=False).tolist())
        if b - a > 1 and (a, b) not in edges:
            edges.append((a, b))
    mem = [rng.uniform(1, 4, kv) if memory and v % 2 else None for v, kv in enumerate(k)]
    heaviest = sum(float(m.max()) for m in mem if m is not None)
    return Problem(
        node_names=[f"n{v}" for v in range(n)],
        strategy_labels=[[f"s{j}" for j in range(kv)] for kv in k],
        unary=[rng.uniform(0, 10, kv) for kv in k],
        edges=np.array(edges),
        pairwise=[rng.uniform(0, 10, (k[a], k[b])) for a, b in edges],
        memory=mem,
        memory_budget=0.7 * heaviest if memory else None,
    )


def test_star_moves_skip_only_centres_whose_answer_cannot_have_changed(monkeypatch) -> None:
    """Skipping settled star centres gives the very plans a search that re-examines
    every centre in every round gives (a reach of one edge instead of two fails this),
    and it does skip: fewer block moves are tried."""

    rng = np.random.default_rng(0)
    cases = []
    for seed in range(60):
        mrf = build_mrf(sparse_problem(seed, memory=seed % 2 == 1))
        x = np.array([rng.integers(len(u)) for u in mrf.unary])
        cases.append((mrf, x, 0.0 if seed % 4 < 2 else 0.5))
    skipping = [polish(mrf, x, None, lam) for mrf, x, lam in cases]
    monkeypatch.setattr(local_search, "SKIP_SETTLED", False)
    for (mrf, x, lam), fast in zip(cases, skipping):
        assert np.array_equal(polish(mrf, x, None, lam), fast)

    tried = 0
    step = local_search._tree_step

    def counted(*args):  # the compiled block move, counted from the rounds' Python form
        nonlocal tried
        tried += 1
        return step(*args)

    monkeypatch.setattr(local_search, "_tree_step", counted)
    counts = {}
    for skip in (True, False):
        tried = 0
        for mrf, x, lam in cases:
            state = local_search.LocalState(mrf, x)
            nodes = np.arange(mrf.num_nodes)
            for _ in range(3):  # full rounds, as ``polish`` makes them
                local_search._stars.py_func(
                    state._m, lam, 1, nodes, True, skip, *mrf.reach, local_search.GAIN_RTOL
                )
        counts[skip] = tried
    assert counts[True] < counts[False]


@pytest.mark.parametrize("depth", [1, 2])
def test_tree_blocks_are_trees_solved_exactly(depth: int) -> None:
    """The compiled block move: its nodes induce a tree on the graph, and its
    relabeling is the best of every relabeling of those nodes (enumerated) under
    energy + lam * memory, with the gain and growth that relabeling really has."""
    from itertools import product


    rng = np.random.default_rng(depth)
    for seed in range(12):
        mrf = build_mrf(sparse_problem(seed, n=12, chords=5, memory=True))
        state = local_search.LocalState(mrf, np.array([rng.integers(k) for k in mrf.k]))
        lam = float(rng.choice([0.0, 0.7]))
        for root in rng.choice(mrf.num_nodes, 3, replace=False).tolist():
            block = local_search._block(state, root, depth, lam)
            nodes = block.order.tolist()
            assert nodes[0] == root and len(set(nodes)) == len(nodes)
            inside = sum(a in nodes and b in nodes for a, b in mrf.edges.tolist())
            assert inside == len(nodes) - 1  # a tree: no induced cycle
            score = {}
            for labels in product(*(range(mrf.k[v]) for v in nodes)):
                y = state.x.copy()
                y[nodes] = labels
                score[labels] = mrf.energy(y) + lam * mrf.memory_used(y)
            best = min(score.values())
            assert score[tuple(block.best.tolist())] == pytest.approx(best, rel=1e-12)
            y = state.x.copy()
            y[nodes] = block.best
            assert block.gain == pytest.approx(mrf.energy(state.x) - mrf.energy(y), rel=1e-9)
            assert block.grow == pytest.approx(mrf.memory_used(y) - mrf.memory_used(state.x))
            for r in range(mrf.k[root]):  # totals: the best per root label, up to a constant
                best_r = min(v for labels, v in score.items() if labels[0] == r)
                assert best_r - block.totals[r] == pytest.approx(best - block.totals.min())


# --- memory budget -------------------------------------------------------------


def _least_memory(problem: Problem) -> float:
    budget, problem.memory_budget = problem.memory_budget, 0.0
    with pytest.raises(InfeasibleProblem) as info:
        HighsILPSolver().solve(problem)
    problem.memory_budget = budget
    return float(re.search(r"\((\d+) bytes\)", str(info.value)).group(1))


@pytest.mark.parametrize("seed", range(8))
def test_approx_respects_a_binding_budget(seed: int) -> None:
    problem = random_problem(5000 + seed, inf_fraction=0.05 * (seed % 2), memory=True, ties=seed % 2 == 0)
    if all(m is None for m in problem.memory):
        problem.memory[0] = np.linspace(1e9, 3e9, len(problem.unary[0]))
    problem.memory_budget = 1e30
    free = BruteForceSolver().solve(problem)
    least = _least_memory(problem)
    for budget in (least, 0.5 * (least + problem.memory_used(free.assignment))):
        problem.memory_budget = budget
        best = BruteForceSolver().solve(problem)
        for name in FAST:
            sol = get_solver(name).solve(problem, time_limit=30)
            assert_scored(problem, sol)
            assert best.objective - TOL <= sol.objective
            assert sol.lower_bound <= best.objective + TOL


def test_price_search_stops_once_a_plan_that_fits_is_proven(monkeypatch) -> None:
    """Every plan TRW-S meets is polished under the budget at once, so the search on
    the memory price ends as soon as the best plan that fits is within the gap of
    the certificate; without that slack it goes on bisecting."""
    problem = random_problem(5002, memory=True)  # its unpriced optimum breaks this budget
    problem.memory_budget = 1e30
    free = BruteForceSolver().solve(problem)
    problem.memory_budget = 0.5 * (_least_memory(problem) + problem.memory_used(free.assignment))
    best = BruteForceSolver().solve(problem)
    mrf = build_mrf(problem)
    assert mrf.memory is not None
    runs = []
    run = Trws.run
    monkeypatch.setattr(Trws, "run", lambda self, *a, **k: runs.append(1) or run(self, *a, **k))
    outcomes = {}
    for gap in (1.0, 0.0):
        runs.clear()
        out = search(mrf, None, gap)
        energy = mrf.energy(out.labels)
        assert mrf.feasible(out.labels)
        assert out.bound <= best.objective + TOL <= energy + 2 * TOL
        outcomes[gap] = (len(runs), energy, out.bound)
    (runs_proven, energy, bound), (runs_exact, energy_exact, _) = outcomes[1.0], outcomes[0.0]
    assert energy - bound <= 1.0 * max(abs(energy), abs(bound), 1.0)  # within its gap
    assert runs_proven == 1 < runs_exact  # the first plan, repaired, was proof enough
    assert energy_exact <= energy  # the longer search polished that first plan too


@pytest.mark.parametrize("name", FAST)
def test_too_small_budget_names_the_smallest_feasible_one(name: str) -> None:
    problem = random_problem(300, inf_fraction=0.1, memory=True)
    problem.memory_budget = 1e30
    least = _least_memory(problem)
    problem.memory_budget = 0.5 * least
    with pytest.raises(InfeasibleProblem, match=r"smallest feasible budget [0-9.]+ GiB \((\d+) bytes\)") as info:
        get_solver(name).solve(problem)
    assert float(re.search(r"\((\d+) bytes\)", str(info.value)).group(1)) == least


# --- time limits, certificates, auto -------------------------------------------


def chain_problem(n: int = 400, k: int = 12, seed: int = 9) -> Problem:
    rng = np.random.default_rng(seed)
    edges = np.array([(v - 1 - int(rng.integers(0, min(v, 4))), v) for v in range(1, n)])
    return Problem(
        node_names=[f"op{i}" for i in range(n)],
        strategy_labels=[[str(j) for j in range(k)]] * n,
        unary=[rng.uniform(0, 100, size=k) for _ in range(n)],
        edges=edges,
        pairwise=[rng.uniform(0, 50, size=(k, k)) for _ in edges],
    )


@pytest.mark.parametrize("name", FAST)
def test_time_limit_returns_a_plan_with_its_gap(name: str) -> None:
    problem = chain_problem()
    sol = get_solver(name, presolve=False).solve(problem, time_limit=1e-3)
    assert_scored(problem, sol)
    assert sol.status in ("time_limit", "optimal", "feasible")
    assert np.isfinite(sol.lower_bound)
    assert sol.seconds < 30


def test_approx_reports_time_limit_when_cut_short() -> None:
    sol = ApproxSolver(gap=0.0, full_presolve=False).solve(chain_problem(), time_limit=1e-4)
    assert sol.status == "time_limit"
    assert sol.lower_bound < sol.objective


def test_ilp_without_incumbent_falls_back_to_approx(monkeypatch, caplog) -> None:
    problem = chain_problem(60, 5)
    monkeypatch.setattr(HighsILPSolver, "_run", lambda self, model, limit, problem=None: _Run("no_solution"))
    with caplog.at_level(logging.WARNING, logger="torchtitan_autoparallel.planner"):
        sol = HighsILPSolver().solve(problem, time_limit=1.0)
    assert "taking the approximate solver's" in caplog.text
    assert_scored(problem, sol)
    assert sol.status in ("time_limit", "optimal")
    assert sol.solver == "ilp-highs"


def test_optimality_check_tightens_the_bound(caplog) -> None:
    problem = random_problem(1003, num_nodes=(8, 9), inf_fraction=0.0)
    plain = ApproxSolver(gap=0.5).solve(problem)  # stops early: a loose own bound
    with caplog.at_level(logging.INFO, logger="torchtitan_autoparallel.planner"):
        checked = get_solver("approx", optimality_check=True).solve(problem)
    value = lp_bound(problem, None)
    assert "certified gap" in caplog.text or checked.status == "optimal"
    assert checked.lower_bound >= min(value, checked.objective) - TOL
    assert checked.lower_bound >= plain.lower_bound - TOL or checked.objective < plain.objective
    assert checked.lower_bound <= BruteForceSolver().solve(problem).objective + TOL


def test_auto_picks_by_size_and_says_why(monkeypatch, caplog) -> None:
    problem = random_problem(7)
    with caplog.at_level(logging.INFO, logger="torchtitan_autoparallel.planner"):
        small = get_solver("auto").solve(problem)
        monkeypatch.setattr(auto_module, "EXACT_MAX_ENTRIES", 0)
        large = get_solver("auto").solve(problem)
    assert small.solver.startswith("auto:ilp") and large.solver.startswith("auto:approx")
    assert re.search(r"auto solver: ilp \(\d+ pairwise entries <= ", caplog.text)
    assert re.search(r"auto solver: approx \(\d+ pairwise entries > 0", caplog.text)


def test_registry_and_config_name_the_solvers() -> None:
    assert get_solver("approx").name == "approx-trws"
    with pytest.raises(ValueError, match="accepted: approx, auto, brute-force, ilp$"):
        get_solver("greedy")
    for name in ("ilp", "approx", "auto"):
        assert load_config(["--autoparallel.solver", name]).autoparallel.solver == name
    with pytest.raises(ConfigError) as info:
        load_config(["--autoparallel.solver", "trws"])
    message = str(info.value)
    assert "\n" not in message
    assert "autoparallel.solver = 'trws' is not accepted; accepted: ilp, approx, auto" in message
    with pytest.raises(ConfigError, match="'lp' is not accepted"):  # the LP is a bound, not a solver
        load_config(["--autoparallel.solver", "lp"])


def test_cache_key_covers_the_optimality_check() -> None:
    from types import SimpleNamespace

    from torchtitan_autoparallel.train.auto import planner_options

    runtime = SimpleNamespace(device_type="cpu", fake=False)
    on = planner_options(load_config(["--autoparallel.optimality_check", "true"]), runtime, (1, 1, 1))
    off = planner_options(load_config([]), runtime, (1, 1, 1))
    assert on.cache_settings() != off.cache_settings()


@pytest.mark.parametrize("overlap_on,warned", [("true", True), ("false", False)])
def test_optimality_check_with_overlap_is_flagged(overlap_on: str, warned: bool, capsys) -> None:
    """The check's LP bounds the objective without savings, so overlap solves skip it."""
    from _run import LLAMA3_CONFIG

    from torchtitan_autoparallel.launch import preflight

    argv = ["--ngpu", "2", "--job.config_file", str(LLAMA3_CONFIG), "--model.name", "llama3_auto_parallel",
            "--autoparallel.overlap", overlap_on, "--autoparallel.optimality_check", "true"]
    assert preflight.main(argv) == 0
    err = capsys.readouterr().err
    if warned:
        assert err.startswith("warning: autoparallel.optimality_check = True has no effect with "
                              "autoparallel.overlap = True"), err
        assert err.count("\n") == 1
    else:
        assert err == ""


@pytest.mark.parametrize("solver,large,hinted", [("ilp", True, True), ("ilp", False, False), ("auto", True, False)])
def test_ilp_on_a_large_problem_names_the_quicker_solver(fake_world, monkeypatch, caplog, solver, large, hinted):
    """The hint reads auto's own size rule (here made to call every problem large)."""
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_autoparallel.models.registry import build_meta_model
    from torchtitan_autoparallel.planner.cost.profiles import load_profile
    from torchtitan_autoparallel.planner.plan.api import plan_stages
    from torchtitan_autoparallel.planner.plan.options import PlannerOptions

    if large:
        monkeypatch.setattr(auto_module, "EXACT_MAX_ENTRIES", 0)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    with caplog.at_level(logging.INFO, logger="torchtitan_autoparallel.planner"):
        plan_stages(build_meta_model("llama3", "debugmodel", n_layers=1), mesh,
                    PlannerOptions(global_batch_size=2, seq_len=16, profile=load_profile("h100"), solver=solver))
    hint = re.search(r"solver = ilp on a large problem \([\d,]+ pairwise entries > 0\): .* solver = auto", caplog.text)
    assert bool(hint) == hinted, caplog.text[-2000:]


# --- the debug model's real problem ------------------------------------------


@pytest.fixture(scope="module")
def debug_stages(fake_world):
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_autoparallel.models.registry import build_meta_model
    from torchtitan_autoparallel.planner.cost.profiles import load_profile
    from torchtitan_autoparallel.planner.plan.api import plan_stages
    from torchtitan_autoparallel.planner.plan.options import PlannerOptions

    model = build_meta_model("llama3", "debugmodel", n_layers=3)
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp_shard", "tp"))
    return plan_stages(model, mesh, PlannerOptions(global_batch_size=8, seq_len=256, profile=load_profile("h100"),
                                                   solver="approx", optimality_check=True))


def test_plan_stages_runs_approx_with_the_optimality_check(debug_stages) -> None:
    plan, problem = debug_stages.plan, debug_stages.built.problem
    exact = get_solver("ilp").solve(problem, 120)
    assert plan.solver == "approx-trws"
    assert plan.objective == pytest.approx(problem.energy(debug_stages.solution.assignment))
    assert plan.lower_bound <= exact.objective + TOL * exact.objective
    assert plan.objective >= exact.objective - TOL * exact.objective
    # the LP bound of this problem is tight: the certificate proves (near) optimality
    assert plan.objective - plan.lower_bound <= 2e-3 * plan.objective


@pytest.mark.parametrize("looseness", [1.0, 4.0])
def test_debug_model_bounds_sit_below_every_plan(debug_stages, looseness: float) -> None:
    problem = debug_stages.built.problem
    problem = dataclasses.replace(problem, memory_budget=problem.memory_budget * looseness)
    # a loose budget leaves the LP fractional and the ILP's branch-and-bound long: cap it
    limits = {"ilp": 5, "approx": 60}
    plans = {name: get_solver(name).solve(problem, limit) for name, limit in limits.items()}
    bounds = [sol.lower_bound for sol in plans.values()] + [lp_bound(problem, 60)]
    best = min(sol.objective for sol in plans.values())
    assert max(bounds) <= best * (1 + 1e-7)
    for name, sol in plans.items():
        assert_scored(problem, sol)
        if name != "ilp":  # a time-capped ILP may return its warm start; the fast ones are close
            assert sol.objective <= best * (1 + 5e-3), name
    if plans["ilp"].status == "optimal":
        assert plans["approx"].objective >= plans["ilp"].objective * (1 - 1e-9)
        lp = solve_lp(presolve(problem).reduced, 60)
        if lp.integral:  # the ILP stopped at the LP's optimum
            assert lp.value + presolve(problem).offset == pytest.approx(plans["ilp"].objective, rel=1e-9)
