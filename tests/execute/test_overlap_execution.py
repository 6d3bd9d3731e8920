"""``execute/overlap.py``: collectives issued early and waited for late, order kept.

Graph tests trace a small step of raw functional collectives with ``make_fx``
on a one-rank gloo group (real collectives, so the scheduled graph can be run
and its values compared with the traced one), and schedule the local graph of
a planned FSDP step on a fake process group (structure only: a fake group's
collectives return no real values). One multi-rank test trains through the
compiled and scheduled step under torchrun and compares losses with one device.
"""

from __future__ import annotations

import re

import pytest
import torch
from _graphs import live_graph, node_signatures
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from torchtitan_autoparallel.execute.compiled import graph_collectives
from torchtitan_autoparallel.execute.overlap import is_collective, is_wait, schedule_overlap

_ag = torch.ops._c10d_functional.all_gather_into_tensor
_ar = torch.ops._c10d_functional.all_reduce
_wait = torch.ops._c10d_functional.wait_tensor


def _fsdp_like(group: str):
    """Three layers whose weights are all-gathered where used, then an all-reduce.

    Each collective is waited for at once (as DTensor's redistributions are
    traced), with compute that does not need it before the collective and,
    for the all-reduce, after its wait: the pass should overlap both.
    """

    def step(x, w0, w1, w2, b):
        h = x
        for k, w in enumerate((w0, w1, w2)):
            bias = torch.cos(b * (k + 1)) + 1  # independent of the gather
            full = _wait(_ag(w, 1, group))
            h = torch.tanh(h @ full + bias)
        y = h * 2
        flat = y.view(-1)  # the traced graph links the all-reduce to this view, not to add_
        y.add_(1)  # so only the barrier rule keeps the all-reduce after this mutation
        reduced = _wait(_ar(flat, "sum", group))
        side = torch.sigmoid(x).sum()  # independent of the all-reduce
        return reduced.view(y.shape) + side, h

    return step


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=g)
    return [x, *(torch.randn(8, 8, generator=g) for _ in range(3)), torch.randn(8, generator=g)]


def _trace(group: str) -> fx.GraphModule:
    return make_fx(_fsdp_like(group), tracing_mode="real")(*_inputs())


def _comm_pairs(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node]]:
    return [(c, next(iter(c.users))) for c in gm.graph.nodes if is_collective(c)]


def _max_in_flight(gm: fx.GraphModule) -> int:
    in_flight = most = 0
    for n in gm.graph.nodes:
        in_flight += is_collective(n) - is_wait(n)
        most = max(most, in_flight)
    return most


def _check_schedule(gm: fx.GraphModule, issue_order: list[str], prefetch: int) -> None:
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    assert [n.name for n in gm.graph.nodes if is_collective(n)] == issue_order
    for c, w in _comm_pairs(gm):
        assert is_wait(w), f"{c.name}: its only user should be its wait"
        assert index[c] < index[w] < min(index[u] for u in w.users), f"{c.name} / {w.name} misplaced"
    assert _max_in_flight(gm) <= prefetch
    gm.graph.lint()


def test_traced_graph_waits_each_collective_at_once(gloo_one):
    gm = _trace(gloo_one)
    assert graph_collectives(gm) == {"all_gather": 3, "all_reduce": 1}
    assert _max_in_flight(gm) == 1
    for c, w in _comm_pairs(gm):
        assert c.next is w  # the starting point the pass improves on


@pytest.mark.parametrize("prefetch", [1, 2])
def test_schedule_overlaps_and_keeps_the_values(gloo_one, prefetch):
    reference = _trace(gloo_one)
    gm = _trace(gloo_one)
    order = [n.name for n in gm.graph.nodes if is_collective(n)]
    stats = schedule_overlap(gm, prefetch=prefetch)
    _check_schedule(gm, order, prefetch)
    assert stats.collectives == 4
    assert stats.hoisted >= 2 and stats.sunk >= 1
    assert stats.mean_gap_before == 0 and stats.mean_gap_after > 0
    # The all-reduce's wait moved past the independent sigmoid, and stays after the add_.
    names = [n.name for n in gm.graph.nodes]
    wait_ar = next(w for c, w in _comm_pairs(gm) if "all_reduce" in c.name)
    assert names.index("sigmoid") < names.index(wait_ar.name)
    assert names.index("add_") < names.index(next(c.name for c, _ in _comm_pairs(gm) if "all_reduce" in c.name))
    inputs = _inputs()
    for got, want in zip(gm(*inputs), reference(*inputs)):
        assert torch.equal(got, want)


def test_a_larger_prefetch_issues_earlier(gloo_one):
    gaps = []
    for prefetch in (1, 2, 3):
        gm = _trace(gloo_one)
        gaps.append(schedule_overlap(gm, prefetch=prefetch).mean_gap_after)
        assert _max_in_flight(gm) == min(prefetch, 3)  # three gathers are ready at the start
    assert gaps[0] < gaps[1] <= gaps[2]


def test_the_pass_is_deterministic_and_idempotent(gloo_one):
    first, second = _trace(gloo_one), _trace(gloo_one)
    schedule_overlap(first)
    schedule_overlap(second)
    assert [n.name for n in first.graph.nodes] == [n.name for n in second.graph.nodes]
    before = [n.name for n in first.graph.nodes]
    again = schedule_overlap(first)
    assert [n.name for n in first.graph.nodes] == before
    assert again.hoisted == again.sunk == 0


def test_prefetch_must_allow_one_collective_in_flight(gloo_one):
    with pytest.raises(ValueError, match="prefetch"):
        schedule_overlap(_trace(gloo_one), prefetch=0)


# ---------------------------------------------------------------- a planned step (fake group)


def _planned_fsdp_step():
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_autoparallel.execute.parity import ParityConfig, batch, full_model, plan_parity

    cfg = ParityConfig()
    full = full_model(cfg)
    planned = plan_parity(cfg, init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",)), full)
    return planned.step, batch(cfg, 0, full.tok_embeddings.weight.shape[0])


def test_planned_step_is_scheduled_when_asked(fake_two):
    step, (tokens, labels) = _planned_fsdp_step()
    step.compile(tokens, labels)
    traced = step.local_graph
    assert step.overlap_stats is None
    order = [n.name for n in traced.graph.nodes if is_collective(n)]
    counts = graph_collectives(traced)

    step.overlap_execution = True
    step.compile(tokens, labels)
    gm, stats = step.local_graph, step.overlap_stats
    print(f"\nplanned FSDP step: {stats.summary()}")
    assert graph_collectives(gm) == counts and stats.collectives == sum(counts.values())
    _check_schedule(gm, order, prefetch=1)
    assert stats.hoisted > 0 and stats.mean_gap_after > stats.mean_gap_before
    # A second trace schedules identically: what every rank relies on.
    names = [n.name for n in gm.graph.nodes]
    step.compile(tokens, labels)
    assert [n.name for n in step.local_graph.graph.nodes] == names


def test_compiling_the_step_shares_one_fake_mode(fake_two, monkeypatch):
    """Each FakeTensorMode captures the Python stack when made; one per recorded op
    was half of the re-trace's time (execute/compiled.py)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    step, (tokens, labels) = _planned_fsdp_step()
    made = []
    init = FakeTensorMode.__init__

    def counting(self, *args, **kwargs):
        made.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(FakeTensorMode, "__init__", counting)
    step.compile(tokens, labels)
    nodes = len(step.local_graph.graph.nodes)
    assert nodes > 500 and len(made) <= 2, f"{len(made)} fake modes for {nodes} nodes"


def test_compiling_the_step_logs_its_progress(fake_two, monkeypatch, caplog):
    """A compile can run for minutes (a large model, a crowded host): it says it started,
    then how many graph nodes it has interpreted, every PROGRESS_EVERY_S seconds."""
    from torchtitan_autoparallel.execute import compiled

    step, (tokens, labels) = _planned_fsdp_step()
    monkeypatch.setattr(compiled, "PROGRESS_EVERY_S", 0.0)  # every node
    with caplog.at_level("INFO", logger="torchtitan_autoparallel.execute"):
        step.compile(tokens, labels)
    total = len(step.traced.graph.graph.nodes)
    assert f"compiling the step: one step interpreted over DTensors ({total} graph nodes)" in caplog.text
    done = [int(m) for m in re.findall(rf"compiling the step: node (\d+) of {total} interpreted", caplog.text)]
    assert done == list(range(1, total + 1))


# ---------------------------------------------------------------- multi-rank parity


@pytest.mark.multirank
def test_fsdp_losses_equal_single_device_when_overlapped(tmp_path_factory):
    from test_execute import REL_TOL, reference, run_parity

    flags = ("--audit", "--compile", "1", "--overlap-execution", "1")
    result = run_parity("dp_shard=2", *flags, tmp=tmp_path_factory.mktemp("fsdp2_overlap"))
    assert "error" not in result, result["error"]
    want = reference("llama3")
    print(f"\noverlapped fsdp2: losses {result['losses']} (reference {want}); {result['overlap_stats']}")
    assert result["overlap_stats"]["hoisted"] > 0
    assert len(result["losses"]) == len(want)
    for step, (got, ref) in enumerate(zip(result["losses"], want)):
        assert abs(got - ref) <= REL_TOL * abs(ref), f"step {step}: {got} vs {ref}"
    assert result["executed"] == result["expected"]
    assert result["compiled_collectives"] == result["expected"]


@pytest.mark.multirank
def test_a_plan_made_with_overlap_trains_like_one_device(tmp_path_factory):
    """The planner's overlap model changes the plan, not the numerics."""
    from test_execute import REL_TOL, reference, run_parity

    flags = ("--audit", "--compile", "1", "--overlap-execution", "1", "--plan-overlap", "1")
    result = run_parity("dp_shard=2", *flags, tmp=tmp_path_factory.mktemp("fsdp2_plan_overlap"))
    assert "error" not in result, result["error"]
    want = reference("llama3")
    assert len(result["losses"]) == len(want)
    for step, (got, ref) in enumerate(zip(result["losses"], want)):
        assert abs(got - ref) <= REL_TOL * abs(ref), f"step {step}: {got} vs {ref}"
    assert result["executed"] == result["expected"]


def test_compiling_reuses_dtensors_sharding_cache_and_records_the_same_graph(fake_two, monkeypatch):
    """Under a tracer DTensor re-derives each op's sharding uncached (a third of the
    compile); compiled.py lets it use its cache, which in a real-mode trace changes no
    live node of the recorded graph, and restores torch's method afterwards."""
    import contextlib

    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    from torchtitan_autoparallel.execute import compiled

    uncached = []
    original = ShardingPropagator.propagate_op_sharding_non_cached

    def counting(self, schema):
        uncached.append(schema.op)
        return original(self, schema)

    # The cache wraps the method it was built with, so only calls that bypass it are counted.
    monkeypatch.setattr(ShardingPropagator, "propagate_op_sharding_non_cached", counting)
    graphs = {}
    for cached in (True, False):
        if not cached:
            monkeypatch.setattr(compiled, "sharding_propagation_for_trace", contextlib.nullcontext)
        step, (tokens, labels) = _planned_fsdp_step()
        uncached.clear()  # the compile's calls only: building the step may propagate uncached once per process
        step.compile(tokens, labels)
        graphs[cached] = node_signatures(live_graph(step.local_graph))
        if cached:
            assert uncached == [], f"{len(uncached)} uncached propagations, e.g. {uncached[:3]}"
            prop = DTensor._op_dispatcher.sharding_propagator
            assert "propagate_op_sharding_non_cached" not in vars(prop)
            assert type(prop.propagate_op_sharding).__name__ == "LocalLRUCache"  # torch's cache is back
    assert uncached, "without the patch the traced dispatch propagates uncached (torch changed?)"
    assert graphs[True] == graphs[False]

