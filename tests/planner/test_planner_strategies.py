"""Candidate strategies per node: torch's rules, ours, and the no-silent-fallback report."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from torchtitan_autoparallel.models.registry import build_meta_model
from torchtitan_autoparallel.planner.strategies.placement import MeshSpec, label, parameter_placements
from torchtitan_autoparallel.planner.strategies.strategy import StrategyTable, enumerate_strategies
from torchtitan_autoparallel.planner.trace.trace import BatchSpec, trace_training_step

aten = torch.ops.aten
WORLD = 8


pytestmark = pytest.mark.usefixtures("fake_world")


@pytest.fixture(scope="module")
def llama_traced():
    return trace_training_step(build_meta_model("llama3", "debugmodel"), 8, 64)


@pytest.fixture(scope="module")
def table_2d(llama_traced) -> StrategyTable:
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp_shard", "tp"))
    return enumerate_strategies(llama_traced, mesh)


@pytest.fixture(scope="module")
def table_1d(llama_traced) -> StrategyTable:
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp_shard",))
    return enumerate_strategies(llama_traced, mesh)


def _labelled(table: StrategyTable, target) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    node = next(n for n in table.nodes if n.target is target)
    return [
        (tuple(label(p) for p in s.outputs if p), tuple(label(p) for p in s.inputs))
        for s in table.nodes[node].strategies
    ]


def test_mm_has_shard_replicate_and_partial_combinations(table_1d):
    combos = set(_labelled(table_1d, aten.mm.default))
    assert (("R",), ("R", "R")) in combos
    assert (("S(0)",), ("S(0)", "R")) in combos  # rows: data parallel
    assert (("S(1)",), ("R", "S(1)")) in combos  # columns: Megatron column-parallel
    assert (("P",), ("S(1)", "S(0)")) in combos  # contraction: row-parallel, partial sums


def test_mm_strategies_cover_both_mesh_dims(table_2d):
    combos = set(_labelled(table_2d, aten.mm.default))
    assert (("S(0)S(1)",), ("S(0)R", "RS(1)")) in combos  # batch on dp, columns on tp
    assert (("S(0)P",), ("S(0)S(1)", "RS(0)")) in combos


@pytest.mark.parametrize(
    "target",
    [
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    ],
)
def test_cpu_flash_attention_shards_batch_and_heads(table_2d, target):
    combos = _labelled(table_2d, target)
    outs = {o for o, _ in combos}
    n_out = len(combos[0][0])
    for placement in ("S(0)R", "S(1)R", "RS(1)", "S(0)S(1)", "RR"):
        assert (placement,) * n_out in outs, placement
    # inputs follow the outputs: every tensor sharded the same way
    for o, i in combos:
        assert set(i) == {o[0]}


def test_no_op_is_replicated_for_llama3(table_1d, table_2d):
    assert table_1d.replicated_ops == []
    assert table_2d.replicated_ops == []
    assert all(ns.source != "replicate" for ns in table_2d.nodes.values())


def test_no_op_is_replicated_for_qwen3():
    traced = trace_training_step(build_meta_model("qwen3", "debugmodel", n_layers=2), 8, 32)
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp_shard", "tp"))
    table = enumerate_strategies(traced, mesh)
    assert table.replicated_ops == []


def test_an_op_without_rule_is_replicated_and_reported():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(16, 16, device="meta"))

        def forward(self, x):
            # no DTensor rule exists for this op in torch 2.14
            return torch.renorm(x @ self.w, 2, 0, 1.0)

    batch = BatchSpec((8, 16), (8, 16), torch.float32, torch.float32)
    traced = trace_training_step(Odd(), 8, 16, loss_fn=lambda p, y: ((p - y) ** 2).mean(), batch=batch)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp_shard",))
    table = enumerate_strategies(traced, mesh)
    assert table.replicated_ops == ["aten.renorm.default"]
    node = next(n for n in table.nodes if n.target is aten.renorm.default)
    (only,) = table.nodes[node].strategies
    assert only.outputs[0] == (Replicate(),) and only.inputs == ((Replicate(),),)


def test_parameters_and_inputs_obey_the_mesh_knobs(llama_traced):
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp_replicate", "tp"))
    table = enumerate_strategies(llama_traced, mesh)
    for fqn, node in llama_traced.params.items():
        for s in table.nodes[node].strategies:
            assert s.outputs[0][0] == Replicate(), fqn  # DDP axis never shards weights
            assert not any(isinstance(p, Partial) for p in s.outputs[0])
    (tok,) = table.nodes[llama_traced.tokens].strategies
    assert tok.outputs[0] == (Shard(0), Replicate())


def test_parameter_placements_only_split_evenly():
    mesh = MeshSpec(("dp_shard", "tp"), (2, 4))
    options = {label(p) for p in parameter_placements((6, 8), mesh)}
    assert "S(0)R" in options and "S(1)S(1)" in options  # 6 % 2, 8 % 8
    assert "RS(0)" not in options  # 6 rows do not split 4 ways
    assert "RR" in options


def test_enumeration_is_memoised(table_2d):
    assert table_2d.cache_hits > table_2d.cache_misses


def test_deeper_models_compute_no_new_strategies():
    # Every repeated block after the first is answered from the memos (by value,
    # then by identity once its inputs are the objects the block before made):
    # the strategies computed are those of one block, however deep the model.
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp_shard", "tp"))
    tables = [
        enumerate_strategies(trace_training_step(build_meta_model("llama3", "debugmodel", n), 8, 64), mesh)
        for n in (1, 3)
    ]
    assert tables[1].cache_misses == tables[0].cache_misses
    assert tables[1].cache_hits > tables[0].cache_hits
    # and the deeper blocks share the first one's strategy lists (so the problem
    # build downstream can memoise by identity too)
    lists = [len({id(ns.strategies) for ns in t.nodes.values()}) for t in tables]
    assert len(tables[1].nodes) > len(tables[0].nodes) and lists[1] == lists[0]


def test_cuda_attention_variants_shard_batch_and_heads():
    # The CUDA kernels keep torch's own single-dim rules; check they expand to
    # batch- and head-sharded strategies on a 2-D mesh like ours.
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import TensorMeta

    from torchtitan_autoparallel.planner.strategies.strategy import expand_rules

    def meta(*shape, dtype=torch.bfloat16):
        return TensorMeta(torch.Size(shape), torch.empty(shape).stride(), dtype)

    q = meta(4, 8, 128, 64)
    lse = meta(4, 8, 128, dtype=torch.float32)
    op = aten._scaled_dot_product_efficient_attention.default
    rules = DTensor._op_dispatcher.sharding_propagator.op_single_dim_strategy_funcs[op].func(
        op, (q, q, q, None, True, 0.0, True), {}
    )
    mesh = MeshSpec(("dp_shard", "tp"), (2, 4))
    strategies = expand_rules(rules, 4, [q, lse, None, None], [q, q, q], mesh)
    outs = {label(s.outputs[0]) for s in strategies}
    assert {"S(0)S(1)", "S(1)S(1)", "S(0)R", "RR"} <= outs
