"""The memory prediction counts the collectives as the executor runs them
(``planner/plan/buckets.py``, ``planner/plan/collective_memory.py``): the buckets it predicts
for a plan are the ones ``execute/bucketing.py`` merges in that plan's step graph."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.placement_types import Shard

from torchtitan_autoparallel.execute.bucketing import bucket_collectives
from torchtitan_autoparallel.execute.overlap import is_collective
from torchtitan_autoparallel.execute.parity import ParityConfig, batch, full_model, plan_parity
from torchtitan_autoparallel.planner.plan.buckets import BUCKET_BYTES, backend_scratch_bytes, group_buckets
from torchtitan_autoparallel.planner.plan.collective_memory import executed_collectives
from torchtitan_autoparallel.planner.plan.memory import whole_peak
from torchtitan_autoparallel.planner.problem.build import EdgeInfo
from torchtitan_autoparallel.planner.strategies.strategy import Strategy

MIB = 2**20
_AG = torch.ops._c10d_functional.all_gather_into_tensor.default
_KIND = {_AG: "all_gather", torch.ops._c10d_functional.reduce_scatter_tensor.default: "reduce_scatter"}


def _executed_buckets(gm: torch.fx.GraphModule) -> list[tuple[str, float, float]]:
    """Bucket ``gm``'s collectives; (kind, full-size bytes, packed-shard bytes) of each merged
    one (the collective nodes the pass made: the others keep their names)."""
    before = {n.name for n in gm.graph.nodes if is_collective(n)}
    bucket_collectives(gm)
    out = []
    for node in (n for n in gm.graph.nodes if n.target in _KIND and n.name not in before):
        inp, res = node.args[0].meta["val"], node.meta["val"]
        nbytes = lambda v: float(v.numel() * v.element_size())  # noqa: E731
        full, shard = (nbytes(res), nbytes(inp)) if node.target is _AG else (nbytes(inp), nbytes(res))
        out.append((_KIND[node.target], full, shard))
    return out


@pytest.mark.parametrize("ac", ["none", "full"])
def test_predicted_buckets_are_the_executed_ones(fake_two, ac):
    cfg = ParityConfig()
    full = full_model(cfg)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    planned = plan_parity(cfg, mesh, full, activation_checkpoint=ac)
    planned.step.compile(*batch(cfg, 0, full.tok_embeddings.weight.shape[0]))
    gm = planned.step.local_graph
    # Each gradient is reduce-scattered as the backward makes it: most of the backward's
    # matmuls still run after the first reduce-scatter (none would, reduced at the end).
    nodes = list(gm.graph.nodes)
    grads = [i for i, n in enumerate(nodes) if _KIND.get(n.target) == "reduce_scatter" and _feeds_output(n)]
    matmuls = [i for i, n in enumerate(nodes) if n.target is torch.ops.aten.mm.default]
    assert grads and sum(i > grads[0] for i in matmuls) > len(matmuls) // 3
    executed = _executed_buckets(gm)
    predicted = [(b["kind"], b["bytes"], b["packed_bytes"]) for b in planned.plan.peak_buckets]
    print(f"\nFSDP 2, ac {ac}: buckets (kind, bytes, packed) executed {executed}, predicted {predicted}")
    assert {kind for kind, *_ in executed} == {"all_gather", "reduce_scatter"}
    assert sorted(predicted) == sorted(executed)
    # Those buffers are a part of the whole peak, and add up with the others.
    parts = planned.plan.peak_parts
    assert parts["collective_buffers"] >= 0
    assert sum(parts.values()) == planned.plan.predicted["peak_bytes_per_device"]


def _feeds_output(node: torch.fx.Node) -> bool:
    """Whether ``node``'s result reaches the step's output through its wait and views only."""
    users = list(node.users)
    while users:
        user = users.pop()
        if user.op == "output":
            return True
        if user.target in (torch.ops._c10d_functional.wait_tensor.default, torch.ops.aten.view.default,
                           torch.ops.aten.t.default, torch.ops.aten._unsafe_view.default):
            users.extend(user.users)
    return False


class _C:
    def __init__(self, key, start, end, nbytes):
        self.key, self.start, self.end, self.nbytes = key, start, end, nbytes


def test_the_grouping_rule_keeps_to_the_cap_the_windows_and_the_key():
    cs = [_C("a", 0, 5, 10), _C("a", 0, 9, 10), _C("b", 0, 9, 1), _C("a", 6, 9, 10), _C("a", 0, 9, 25), _C("a", 0, 9, 5)]
    got = [[cs.index(c) for c in b] for b in group_buckets(cs, cap=30)]
    # 3 opens after 0's window ended (6 >= 5); 4 would pass the cap with 3, so 4 and 5 share one
    assert got == [[0, 1], [3], [4, 5], [2]]
    assert BUCKET_BYTES == 32 * 2**20


def test_gloo_scratch_is_counted_on_gloo_only():
    assert backend_scratch_bytes("all_gather", 100.0, gloo=True) == 100.0
    assert backend_scratch_bytes("reduce_scatter", 100.0, gloo=True) == 100.0
    assert backend_scratch_bytes("all_reduce", 100.0, gloo=True) == 0.0
    assert backend_scratch_bytes("all_gather", 100.0, gloo=False) == 0.0
    # A shard moved to another dim: gloo gathers the whole tensor (output and temporary);
    # NCCL copies the chunks it sends and receives.
    assert backend_scratch_bytes("all_to_all", 100.0, gloo=True, group_size=4) == 200.0
    assert backend_scratch_bytes("all_to_all", 100.0, gloo=False, group_size=4) == 50.0


def test_a_shard_moved_to_another_dim_holds_the_whole_tensor_on_gloo():
    """S(1) -> S(0) of a 2048 x 1024 float tensor over 4 ranks: DTensor's gloo fallback
    gathers all 8 MiB (and gloo keeps a temporary as large) to cut out a 2 MiB shard;
    measured, the redistribution alone peaks at 16 MiB (18 with a non-contiguous input)."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.ops.aten.mm.default, (x, x))
    graph.output(y)
    part = EdgeInfo(producer=x, output_index=0, consumer=y, arg_index=0, shape=(2048, 1024), dtype=torch.float32)
    chosen = {x: Strategy(outputs=((Shard(1),),), inputs=()),
              y: Strategy(outputs=((Shard(0),),), inputs=((Shard(0),), (Shard(1),)))}
    order = list(graph.nodes)
    for gloo, scratch in ((True, 16 * MIB), (False, 4 * MIB)):
        executed = executed_collectives(order, chosen, [[part]], (4,), set(), gloo)
        assert [(s.first, s.last, s.bytes) for s in executed.spans] == [(1, 1, scratch)]
        assert executed.spans[0].holds == ((part, scratch),)  # the consumer's choice makes it


def test_old_peaks_without_collectives_still_add_up():
    from torchtitan_autoparallel.planner.plan.memory import Peak

    parts = whole_peak(Peak(100.0, "mm", [], weight_copy_bytes=10.0, collective_bytes=30.0), param_bytes=8.0)
    assert parts["collective_buffers"] == 30.0 and parts["activations"] == 60.0
    assert sum(parts.values()) == 100.0 + 3 * 8.0
