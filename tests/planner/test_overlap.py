"""Communication/computation overlap in the ILP/LP (``[autoparallel] overlap``)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from torchtitan_autoparallel.planner.problem.problem import Problem
from torchtitan_autoparallel.planner.solve import get_solver, overlap_solver
from torchtitan_autoparallel.planner.solve.exact.ilp import HighsILPSolver
from torchtitan_autoparallel.planner.solve.overlap.model import OverlapSpec, build_overlap_ilp
from torchtitan_autoparallel.planner.solve.overlap.presolve import overlap_presolve
from torchtitan_autoparallel.planner.solve.overlap.solver import (
    OVERLAP_MIP_GAP,
    overlap_breakdown,
    overlap_savings,
)
from torchtitan_autoparallel.planner.solve.presolve.pipeline import presolve

TOL = 1e-6


def _prefetch_case(hidden_compute: float) -> Problem:
    """p (a weight: 0 = sharded, gathered for 10 us; 1 = kept whole, 6 us of extra work),
    a (``hidden_compute`` us that runs before the consumer), c (the consumer)."""
    return Problem(
        node_names=["p", "a", "c"],
        strategy_labels=[["S", "R"], ["a"], ["c"]],
        unary=[np.array([0.0, 6.0]), np.array([hidden_compute]), np.array([1.0])],
        edges=np.array([[0, 2], [1, 2]]),
        pairwise=[np.array([[10.0], [0.0]]), np.zeros((1, 1))],
    )


def _brute_force(problem: Problem, spec: OverlapSpec) -> float:
    best = np.inf
    for x in itertools.product(*(range(len(u)) for u in problem.unary)):
        x = np.array(x)
        if problem.is_feasible(x):
            best = min(best, problem.energy(x) - overlap_savings(problem, spec, x))
    return best


def _comm(problem: Problem, x: np.ndarray, e: int) -> float:
    u, v = problem.edges[e]
    return float(problem.pairwise[e][x[u], x[v]])


def _random_problem(rng: np.random.Generator, n: int = 5) -> tuple[Problem, OverlapSpec]:
    k = rng.integers(1, 4, size=n)
    pairs = [(u, v) for u in range(n) for v in range(u + 1, n) if rng.random() < 0.5] or [(0, n - 1)]
    problem = Problem(
        node_names=[f"n{i}" for i in range(n)],
        strategy_labels=[[str(s) for s in range(int(kk))] for kk in k],
        unary=[rng.uniform(0, 10, size=int(kk)).round(1) for kk in k],
        edges=np.array(pairs),
        pairwise=[rng.uniform(0, 15, size=(int(k[u]), int(k[v]))).round(1) for u, v in pairs],
    )
    kinds = rng.integers(0, 3, size=len(pairs))  # 0 exposed, 1 prefetch, 2 backward
    spec = OverlapSpec(n, np.flatnonzero(kinds == 1), np.flatnonzero(kinds == 2))
    return problem, spec


def test_overlap_changes_the_hand_computed_optimum():
    problem = _prefetch_case(hidden_compute=20.0)
    plain = get_solver("ilp").solve(problem)
    # plain: gathering costs 10 > 6, so keep the weight whole: 6 + 20 + 1
    assert plain.assignment.tolist() == [1, 0, 0] and plain.objective == pytest.approx(27.0)
    spec = OverlapSpec(3, prefetch=[0], backward=[])
    sol = overlap_solver("ilp", "highs", spec).solve(problem)
    # overlap: the 10 us gather hides behind a's 20 us: 0 + 20 + 1 + 10 - 10
    assert sol.assignment.tolist() == [0, 0, 0]
    assert sol.objective == pytest.approx(21.0) and sol.status == "optimal"


def test_savings_are_capped_by_the_compute_before_the_consumer():
    problem = _prefetch_case(hidden_compute=3.0)
    spec = OverlapSpec(3, prefetch=[0], backward=[])
    assert overlap_savings(problem, spec, np.array([0, 0, 0])) == pytest.approx(3.0)
    # 0 + 3 + 1 + 10 - 3 = 11 > 6 + 3 + 1 = 10: overlap is modelled, but does not pay
    sol = overlap_solver("ilp", "highs", spec).solve(problem)
    assert sol.assignment.tolist() == [1, 0, 0] and sol.objective == pytest.approx(10.0)


def test_gradient_reductions_hide_only_behind_later_compute():
    # g produces a gradient reduced on g -> w; only a (after g) can hide it, not b (before)
    problem = Problem(
        node_names=["b", "g", "w", "a"],
        strategy_labels=[["b"], ["g"], ["w"], ["a"]],
        unary=[np.array([50.0]), np.array([1.0]), np.array([0.0]), np.array([4.0])],
        edges=np.array([[0, 1], [1, 2], [1, 3]]),
        pairwise=[np.zeros((1, 1)), np.array([[9.0]]), np.zeros((1, 1))],
    )
    spec = OverlapSpec(4, prefetch=[], backward=[1])
    assert overlap_savings(problem, spec, np.zeros(4, np.int64)) == pytest.approx(4.0)
    sol = overlap_solver("ilp", "highs", spec).solve(problem)
    assert sol.objective == pytest.approx(problem.energy(np.zeros(4, np.int64)) - 4.0)


def test_the_same_compute_is_never_spent_twice():
    # one 10 us node between a gradient's producer (before it) and a gather's consumer (after)
    problem = Problem(
        node_names=["g", "w", "a", "p", "c"],
        strategy_labels=[["g"], ["w"], ["a"], ["p"], ["c"]],
        unary=[np.zeros(1), np.zeros(1), np.array([10.0]), np.zeros(1), np.zeros(1)],
        edges=np.array([[0, 1], [3, 4], [2, 4]]),
        pairwise=[np.array([[10.0]]), np.array([[10.0]]), np.zeros((1, 1))],
    )
    spec = OverlapSpec(5, prefetch=[1], backward=[0])
    got = overlap_breakdown(problem, spec, np.zeros(5, np.int64))
    assert got.total == pytest.approx(10.0)  # not 20: either chain, not both


@pytest.mark.parametrize("seed", range(6))
def test_random_graphs_match_brute_force_and_respect_every_cap(seed):
    rng = np.random.default_rng(seed)
    problem, spec = _random_problem(rng)
    sol = overlap_solver("ilp", "highs", spec).solve(problem)
    assert sol.objective == pytest.approx(_brute_force(problem, spec), abs=1e-6)
    plain = get_solver("ilp").solve(problem)
    assert sol.objective <= plain.objective + TOL
    x = sol.assignment
    got = overlap_breakdown(problem, spec, x)
    compute = np.array([problem.unary[v][x[v]] for v in range(problem.num_nodes)])
    pos = spec.position
    for e, s in zip(got.edges.tolist(), got.savings.tolist()):
        assert -TOL <= s <= _comm(problem, x, e) + TOL
    saved = dict(zip(got.edges.tolist(), got.savings.tolist()))
    for e in spec.prefetch.tolist():  # gathers up to the consumer fit the compute before it
        p = pos[problem.edges[e, 1]]
        hid = sum(saved.get(f, 0.0) for f in spec.prefetch.tolist() if pos[problem.edges[f, 1]] <= p)
        assert hid <= compute[pos < p].sum() + TOL
    for e in spec.backward.tolist():  # reductions from the producer on fit the compute after it
        q = pos[problem.edges[e, 0]]
        hid = sum(saved.get(f, 0.0) for f in spec.backward.tolist() if pos[problem.edges[f, 0]] >= q)
        assert hid <= compute[pos > q].sum() + TOL
    assert got.total <= compute.sum() + TOL


@pytest.mark.parametrize("seed", range(3))
def test_without_overlappable_edges_the_objective_is_the_plain_one(seed):
    problem, _ = _random_problem(np.random.default_rng(100 + seed))
    empty = OverlapSpec(problem.num_nodes, [], [])
    plain = get_solver("ilp").solve(problem)
    assert overlap_solver("ilp", "highs", empty).solve(problem).objective == pytest.approx(plain.objective)


def test_memory_budget_and_ties_still_hold_with_overlap():
    rng = np.random.default_rng(7)
    problem, spec = _random_problem(rng, n=4)
    problem.unary[1] = problem.unary[2] = np.array([1.0, 2.0])
    problem.strategy_labels[1] = problem.strategy_labels[2] = ["0", "1"]
    problem.memory = [None, np.array([4.0, 1.0]), np.array([4.0, 1.0]), None]
    problem.memory_budget = 2.0
    problem.ties = [[1, 2]]
    problem.pairwise = [rng.uniform(0, 15, size=(len(problem.unary[u]), len(problem.unary[v])))
                        for u, v in problem.edges]
    problem.validate()
    sol = overlap_solver("ilp", "highs", spec).solve(problem)
    assert problem.is_feasible(sol.assignment)
    assert sol.objective == pytest.approx(_brute_force(problem, spec), abs=1e-6)


@pytest.mark.usefixtures("fake_world")
def test_debug_model_plan_with_overlap_saves_time():
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_autoparallel.models.registry import build_meta_model
    from torchtitan_autoparallel.planner.cost.profiles import load_profile
    from torchtitan_autoparallel.planner.plan.api import plan_stages
    from torchtitan_autoparallel.planner.plan.options import PlannerOptions

    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",))
    model = build_meta_model("llama3", "debugmodel", n_layers=1)
    options = PlannerOptions(global_batch_size=8, seq_len=64, profile=load_profile("h100"), time_limit_s=60)
    plain = plan_stages(model, mesh, options).plan
    stages = plan_stages(model, mesh, options.replace(overlap=True))
    plan = stages.plan
    p = plan.predicted
    assert p["overlap_savings_us"] > 0
    assert p["effective_us"] == pytest.approx(p["total_us"] - p["overlap_savings_us"])
    assert plan.objective == pytest.approx(p["effective_us"], rel=1e-6)
    assert plan.objective <= plain.objective + 1e-6
    assert p["overlap_savings_us"] <= min(p["comm_us"], p["compute_us"]) + 1e-6
    assert "overlap saves" in plan.table() and "overlap saves" not in plain.table()


def test_the_config_flag_reaches_the_planner():
    from types import SimpleNamespace

    from torchtitan_autoparallel.config import JobConfig
    from torchtitan_autoparallel.train import auto

    job = JobConfig()
    runtime = SimpleNamespace(device_type="cpu", fake=False)
    assert auto.planner_options(job, runtime, (1, 1, 1)).overlap is False
    job.autoparallel.overlap = True
    assert auto.planner_options(job, runtime, (1, 1, 1)).overlap is True
    assert auto.planner_options(job, runtime, (1, 1, 1)).cache_settings()["overlap"] is True


# --- overlap on the presolved problem (solve/overlap/presolve.py) -----------------------


def _layered_problem(rng: np.random.Generator) -> tuple[Problem, OverlapSpec]:
    """Two tied 'layers': w -> view (a prefetch) -> cast -> mm, a varying-compute leaf
    and a constant-compute leaf off mm, a gradient edge mm -> grad; and a fixed head.
    The presolve collapses the ties and eliminates head, cast (compute-free chain
    node) and const (a leaf whose compute is the same whatever it picks)."""
    k = 2
    names, unary, edges, tables, ties = [], [], [], [], []

    def node(name: str, compute: np.ndarray) -> int:
        names.append(name)
        unary.append(np.asarray(compute, dtype=np.float64))
        return len(names) - 1

    def edge(u: int, v: int, table: np.ndarray) -> int:
        edges.append((u, v))
        tables.append(np.asarray(table, dtype=np.float64))
        return len(edges) - 1

    head = node("head", [2.0])
    prefetch, backward = [], []
    layer_tables = [rng.uniform(0, 12, size=(k, k)).round(1) for _ in range(4)]
    layer_compute = [rng.uniform(0, 10, size=k).round(1) for _ in range(2)]
    members = []
    for layer in range(2):
        w = node(f"w{layer}", [0.0, 0.0])
        view = node(f"view{layer}", [0.0, 0.0])
        cast = node(f"cast{layer}", [0.0, 0.0])
        mm = node(f"mm{layer}", layer_compute[0])
        leaf = node(f"leaf{layer}", layer_compute[1])
        const = node(f"const{layer}", [3.0, 3.0])
        grad = node(f"grad{layer}", [0.5, 0.5])
        edge(head, mm, rng.uniform(0, 5, size=(1, k)).round(1))
        prefetch.append(edge(w, view, layer_tables[0]))
        edge(view, cast, layer_tables[1])
        edge(cast, mm, layer_tables[1].T)
        edge(mm, leaf, layer_tables[2])
        edge(mm, const, layer_tables[2].T)
        backward.append(edge(mm, grad, layer_tables[3]))
        members.append([w, view, cast, mm, leaf, const, grad])
    ties = [list(group) for group in zip(*members)]
    problem = Problem(
        node_names=names,
        strategy_labels=[[str(s) for s in range(len(u))] for u in unary],
        unary=unary, edges=np.array(edges), pairwise=tables, ties=ties,
    )
    return problem, OverlapSpec(len(names), prefetch, backward)


def _assert_caps(problem: Problem, spec: OverlapSpec, x: np.ndarray) -> None:
    """Every saving within its edge's cost, and within the compute its chain may use."""
    got = overlap_breakdown(problem, spec, x)
    compute = np.array([problem.unary[v][x[v]] for v in range(problem.num_nodes)])
    pos = spec.position
    saved = dict(zip(got.edges.tolist(), got.savings.tolist()))
    for e, s in saved.items():
        assert -TOL <= s <= _comm(problem, x, e) + TOL
    for e in spec.prefetch.tolist():
        p = pos[problem.edges[e, 1]]
        hid = sum(saved.get(f, 0.0) for f in spec.prefetch.tolist() if pos[problem.edges[f, 1]] <= p)
        assert hid <= compute[pos < p].sum() + TOL
    for e in spec.backward.tolist():
        q = pos[problem.edges[e, 0]]
        hid = sum(saved.get(f, 0.0) for f in spec.backward.tolist() if pos[problem.edges[f, 0]] >= q)
        assert hid <= compute[pos > q].sum() + TOL


@pytest.mark.parametrize("seed", range(8))
def test_presolved_overlap_matches_the_full_model_and_brute_force(seed):

    problem, spec = _layered_problem(np.random.default_rng(seed))
    pre = overlap_presolve(problem, spec)
    assert not set(pre.reduced.node_names) & {"w1", "head", "cast0", "const0"}  # ties, eliminations
    with_pre = overlap_solver("ilp", "highs", spec, presolve=True).solve(problem)
    without = overlap_solver("ilp", "highs", spec, presolve=False).solve(problem)
    exact = _brute_force(problem, spec)
    assert with_pre.objective == pytest.approx(exact, abs=1e-6)
    assert without.objective == pytest.approx(exact, abs=1e-6)
    assert with_pre.status == "optimal" and with_pre.lower_bound == pytest.approx(exact, abs=1e-6)
    x = with_pre.assignment
    assert problem.is_feasible(x)
    assert with_pre.objective == pytest.approx(problem.energy(x) - overlap_savings(problem, spec, x))
    _assert_caps(problem, spec, x)
    plain = get_solver("ilp").solve(problem)  # overlap off: the plain presolved optimum, unchanged
    assert plain.objective == pytest.approx(get_solver("ilp", presolve=False).solve(problem).objective)
    assert with_pre.objective <= plain.objective + TOL


@pytest.mark.parametrize("seed", range(6))
def test_presolved_overlap_on_random_graphs_with_ties(seed):
    rng = np.random.default_rng(200 + seed)
    problem, spec = _random_problem(rng, n=6)
    k = len(problem.unary[1])
    problem.unary[4] = rng.uniform(0, 10, size=k).round(1)  # 1 and 4 take the same strategy
    problem.strategy_labels[4] = problem.strategy_labels[1]
    problem.pairwise = [rng.uniform(0, 15, size=(len(problem.unary[u]), len(problem.unary[v]))).round(1)
                        for u, v in problem.edges]
    problem.ties = [[1, 4]]
    problem.validate()
    sol = overlap_solver("ilp", "highs", spec, presolve=True).solve(problem)
    assert sol.objective == pytest.approx(_brute_force(problem, spec), abs=1e-6)
    assert sol.assignment[1] == sol.assignment[4]
    _assert_caps(problem, spec, sol.assignment)


def test_presolve_keeps_a_node_whose_compute_buys_overlap():
    # a: strategy 0 = 1 us of compute but 5 us on the exposed a -> c edge (energy 6, best
    # plainly); strategy 1 = 10 us of compute, no transfer (energy 10), which hides p's
    # 10 us gather: 6 + 10 - 1 = 15 against 10 + 10 - 10 = 10
    problem = Problem(
        node_names=["p", "a", "c"],
        strategy_labels=[["S"], ["0", "1"], ["c"]],
        unary=[np.zeros(1), np.array([1.0, 10.0]), np.zeros(1)],
        edges=np.array([[0, 2], [1, 2]]),
        pairwise=[np.array([[10.0]]), np.array([[5.0], [0.0]])],
    )
    spec = OverlapSpec(3, prefetch=[0], backward=[])

    assert "a" not in presolve(problem).reduced.node_names  # the plain presolve folds it away
    assert "a" in overlap_presolve(problem, spec).reduced.node_names
    sol = overlap_solver("ilp", "highs", spec).solve(problem)
    assert sol.assignment.tolist() == [0, 1, 0] and sol.objective == pytest.approx(10.0)


@pytest.mark.parametrize("seed", range(4))
def test_fixed_plan_savings_match_the_pinned_model(seed):
    from dataclasses import replace


    problem, spec = _random_problem(np.random.default_rng(300 + seed), n=6)
    x = get_solver("ilp").solve(problem).assignment
    pinned = replace(problem, pins={v: int(s) for v, s in enumerate(x.tolist())})
    model = build_overlap_ilp(pinned, spec)
    h = HighsILPSolver()._highs(model, None, integer=False)
    h.run()
    reference = float(np.maximum(model.savings(np.asarray(h.getSolution().col_value)), 0).sum())
    assert overlap_savings(problem, spec, x) == pytest.approx(reference, abs=1e-6)


@pytest.mark.usefixtures("fake_world")
def test_debug_model_overlap_with_and_without_presolve_agree():
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_autoparallel.models.registry import build_meta_model
    from torchtitan_autoparallel.planner.cost.profiles import load_profile
    from torchtitan_autoparallel.planner.plan.api import plan_stages
    from torchtitan_autoparallel.planner.plan.options import PlannerOptions
    from torchtitan_autoparallel.planner.plan.overlap import overlap_spec
    from torchtitan_autoparallel.planner.solve.overlap.presolve import overlap_presolve

    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",))
    model = build_meta_model("llama3", "debugmodel", n_layers=2)
    stages = plan_stages(model, mesh, PlannerOptions(global_batch_size=8, seq_len=64, profile=load_profile("h100"),
                                                     time_limit_s=60))
    problem, spec = stages.built.problem, overlap_spec(stages.built, stages.traced)
    assert overlap_presolve(problem, spec).reduced.num_nodes < problem.num_nodes
    a = overlap_solver("ilp", "highs", spec, presolve=True).solve(problem, 120)
    b = overlap_solver("ilp", "highs", spec, presolve=False).solve(problem, 120)
    # both stop at the MIP gap: each plan is within it of the other's proven bound
    for one, other in ((a, b), (b, a)):
        assert one.lower_bound <= other.objective + TOL
        assert one.objective <= other.lower_bound + 2 * OVERLAP_MIP_GAP * abs(other.objective) + TOL
        _assert_caps(problem, spec, one.assignment)
