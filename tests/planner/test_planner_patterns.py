"""The planner rediscovers what experts write by hand: FSDP, DDP, Megatron TP."""

from __future__ import annotations

import pytest
from torch.distributed.device_mesh import init_device_mesh

from torchtitan_autoparallel.models.registry import build_meta_model
from torchtitan_autoparallel.planner.cost.profiles import load_profile
from torchtitan_autoparallel.planner.plan.api import plan_training_step
from torchtitan_autoparallel.planner.plan.plan import Plan

WORLD = 8
PROFILE = load_profile("h100")


pytestmark = pytest.mark.usefixtures("fake_world")


def _plan(family: str, flavor: str, dim: str, batch: int, seq: int, n_layers: int | None = None) -> Plan:
    model = build_meta_model(family, flavor, n_layers)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=(dim,))
    return plan_training_step(model, mesh, global_batch_size=batch, seq_len=seq, profile=PROFILE)


def _node(plan: Plan, prefix: str) -> list[str]:
    return [v for k, v in plan.nodes.items() if k.rstrip("_0123456789") == prefix]


def test_dp_shard_gives_fsdp():
    plan = _plan("llama3", "debugmodel", "dp_shard", batch=64, seq=2048)
    assert plan.status == "optimal"
    for fqn, placements in plan.parameters.items():
        assert placements[0].startswith("S("), fqn  # every weight sharded over dp_shard
    # activations batch-sharded: embedding, attention and every projection
    assert _node(plan, "embedding") == ["S(0)"]
    assert set(_node(plan, "_scaled_dot_product_flash_attention_for_cpu")) == {"S(0),S(0)"}
    grads = plan.collective_kinds("gradient")
    assert "reduce_scatter" in grads
    big_grad_all_reduces = [c for c in plan.collectives if c.kind == "all_reduce" and c.bytes > 64]
    assert not big_grad_all_reduces
    assert "all_gather" in plan.collective_kinds("parameter")
    # one reduce-scatter per parameter
    n_rs = sum(c.count for c in plan.collectives if c.kind == "reduce_scatter" and c.purpose == "gradient")
    assert n_rs == len(plan.parameters)
    assert plan.replicated_ops == []


def test_dp_replicate_gives_ddp():
    plan = _plan("llama3", "debugmodel", "dp_replicate", batch=64, seq=2048)
    assert all(p == ["R"] for p in plan.parameters.values())
    assert set(_node(plan, "_scaled_dot_product_flash_attention_for_cpu")) == {"S(0),S(0)"}
    assert "all_reduce" in plan.collective_kinds("gradient")
    assert not plan.collective_kinds("parameter")  # weights are never gathered
    # every gradient is reduced: all-reduce, or reduce-scatter + all-gather (equal cost)
    reduced = sum(c.count for c in plan.collectives if c.purpose == "gradient" and c.kind in ("all_reduce", "reduce_scatter"))
    assert reduced >= len(plan.parameters)


def test_tp_gives_megatron_on_llama3_8b_shapes():
    plan = _plan("llama3", "8B", "tp", batch=1, seq=2048, n_layers=1)
    p = plan.parameters
    assert p["layers.0.attention.qkv_linear.wqkv.weight"] == ["S(0)"]
    assert p["layers.0.feed_forward.w1.weight"] == ["S(0)"]
    assert p["layers.0.feed_forward.w3.weight"] == ["S(0)"]
    assert p["layers.0.attention.wo.weight"] == ["S(1)"]
    assert p["layers.0.feed_forward.w2.weight"] == ["S(1)"]
    # attention runs head-parallel
    assert set(_node(plan, "_scaled_dot_product_flash_attention_for_cpu")) == {"S(1),S(1)"}
