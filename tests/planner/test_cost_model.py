"""Hand-computed checks of the analytic cost model (no process group needed)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

from torchtitan_autoparallel.planner.cost.cost_model import (
    CommStep,
    ImpossibleRedistribute,
    collective_time_us,
    compute_time_us,
    mesh_dim_links,
    redistribute_steps,
    redistribute_time_us,
)
from torchtitan_autoparallel.planner.cost.pricer import redistribute_cost_matrix
from torchtitan_autoparallel.planner.cost.profiles import (
    BUILTIN_PROFILES,
    HardwareProfile,
    Link,
    default_profile_name,
    for_matmul_precision,
    load_profile,
)
from torchtitan_autoparallel.planner.strategies.placement import parse_placement, parse_placements, placement_str, placements_str

R, P = Replicate(), Partial()
# 10 us latency, 100 GB/s = 1e5 bytes/us: easy numbers to compute by hand.
LINK = Link(latency_us=10.0, bandwidth_GBps=100.0)
FAST, SLOW = Link(1.0, 400.0), Link(10.0, 50.0)


def toy_profile(devices_per_node: int = 8) -> HardwareProfile:
    return HardwareProfile(
        name="toy",
        peak_tflops={"float32": 50.0, "bfloat16": 100.0, "float16": 100.0},
        mem_bandwidth_GBps=1000.0,
        devices_per_node=devices_per_node,
        intra_node=FAST,
        inter_node=SLOW,
        compute_efficiency=0.5,
        kernel_overhead_us=2.0,
    )


# ------------------------------------------------------------- collectives


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_to_all"])
def test_single_pass_collectives(kind: str) -> None:
    # (4-1)*10 us + 3/4 * 4e6 B / 1e5 B/us = 30 + 30
    assert collective_time_us(kind, 4e6, 4, LINK) == pytest.approx(60.0)


def test_all_reduce_is_reduce_scatter_plus_all_gather() -> None:
    assert collective_time_us("all_reduce", 4e6, 4, LINK) == pytest.approx(120.0)
    # n = 8: 7*10 + 7/8 * 8e5 / 1e5 = 77, doubled
    assert collective_time_us("all_reduce", 8e5, 8, LINK) == pytest.approx(154.0)


def test_collective_edge_cases() -> None:
    assert collective_time_us("all_gather", 4e6, 1, LINK) == 0.0
    with pytest.raises(ValueError, match="broadcast"):
        collective_time_us("broadcast", 1.0, 2, LINK)


# ------------------------------------------------------------- compute


def test_compute_roofline() -> None:
    prof = toy_profile()
    # compute bound: 1e9 flops / (100 TF * 0.5 = 5e7 flop/us) = 20 us, + 2 overhead
    assert compute_time_us(1e9, 1e6, torch.bfloat16, prof) == pytest.approx(22.0)
    # fp32 peak is half: 40 us + 2
    assert compute_time_us(1e9, 0.0, torch.float32, prof) == pytest.approx(42.0)
    # memory bound: 1e8 B / 1e6 B/us = 100 us, + 2
    assert compute_time_us(1e3, 1e8, torch.bfloat16, prof) == pytest.approx(102.0)
    assert compute_time_us(0.0, 0.0, torch.bfloat16, prof) == 0.0


# ------------------------------------------------------------- links


def test_links_8x8_mesh_8_per_node() -> None:
    prof = toy_profile(devices_per_node=8)
    assert mesh_dim_links((8, 8), prof) == [SLOW, FAST]
    assert mesh_dim_links((2, 4), prof) == [FAST, FAST]
    assert mesh_dim_links((2, 4, 2), prof) == [SLOW, FAST, FAST]
    assert mesh_dim_links((16,), prof) == [SLOW]


def test_outer_dim_gather_uses_inter_node_link() -> None:
    prof = load_profile("h100")
    shape, mesh = (1024, 1024), (8, 8)
    outer = redistribute_time_us(shape, 2, (Shard(0), R), (R, R), mesh, prof)
    inner = redistribute_time_us(shape, 2, (R, Shard(0)), (R, R), mesh, prof)
    full = 1024 * 1024 * 2
    assert outer == pytest.approx(collective_time_us("all_gather", full, 8, prof.inter_node))
    assert inner == pytest.approx(collective_time_us("all_gather", full, 8, prof.intra_node))
    assert outer > inner


# ------------------------------------------------------------- redistribution


def test_identical_and_replicate_to_shard_are_free() -> None:
    prof = toy_profile()
    assert redistribute_time_us((8, 16), 4, (Shard(0), R), (Shard(0), R), (2, 4), prof) == 0.0
    assert redistribute_steps((8, 16), 4, (R, R), (Shard(0), Shard(1)), (2, 4)) == []
    assert redistribute_time_us((8, 16), 4, (R, R), (Shard(0), Shard(1)), (2, 4), prof) == 0.0
    assert redistribute_time_us((8, 16), 4, (R,), (P,), (4,), prof) == 0.0


def test_shard_to_replicate_on_2d_mesh_counts_other_dims_shard() -> None:
    # mesh dim 1 gathers tensor dim 1; mesh dim 0 still halves tensor dim 0,
    # so the gathered buffer is 4 x 16 fp32 = 256 bytes, not 512.
    steps = redistribute_steps((8, 16), 4, (Shard(0), Shard(1)), (Shard(0), R), (2, 4))
    assert steps == [CommStep("all_gather", 1, 256.0, 4)]
    prof = toy_profile()
    t = redistribute_time_us((8, 16), 4, (Shard(0), Shard(1)), (Shard(0), R), (2, 4), prof)
    assert t == pytest.approx(collective_time_us("all_gather", 256.0, 4, FAST))


def test_partial_to_shard_is_reduce_scatter() -> None:
    assert redistribute_steps((8, 16), 4, (P,), (Shard(0),), (4,)) == [CommStep("reduce_scatter", 0, 512.0, 4)]
    assert redistribute_steps((8, 16), 4, (P,), (R,), (4,)) == [CommStep("all_reduce", 0, 512.0, 4)]


def test_shard_to_shard_is_all_to_all_of_local_shard() -> None:
    assert redistribute_steps((8, 16), 4, (Shard(0),), (Shard(1),), (4,)) == [CommStep("all_to_all", 0, 128.0, 4)]


def test_uneven_shard_pads_to_ceil() -> None:
    # 10 rows over 4 ranks: shards padded to 3 rows, gathered buffer 12 rows.
    assert redistribute_steps((10,), 4, (Shard(0),), (R,), (4,)) == [CommStep("all_gather", 0, 48.0, 4)]


def test_reduce_scatter_before_gather_keeps_bytes_small() -> None:
    # P on both dims -> S(0) S(1): the second reduce-scatter sees a halved tensor.
    steps = redistribute_steps((8, 16), 4, (P, P), (Shard(0), Shard(1)), (2, 4))
    assert [s.kind for s in steps] == ["reduce_scatter", "reduce_scatter"]
    assert sum(s.bytes for s in steps) == 512 + 256


def test_nested_shard_is_replicated_first() -> None:
    # (S0, S0) -> (R, S0): mesh dim 1's chunking must be undone before dim 0's.
    steps = redistribute_steps((16, 4), 4, (Shard(0), Shard(0)), (R, Shard(0)), (2, 4))
    assert [(s.kind, s.mesh_dim, s.bytes) for s in steps] == [("all_gather", 1, 128.0), ("all_gather", 0, 256.0)]


def test_strided_shard_costs_like_shard() -> None:
    prof = toy_profile()
    ss = _StridedShard(0, split_factor=4)
    strided = redistribute_time_us((8, 16), 4, (ss, Shard(0)), (R, Shard(0)), (2, 4), prof)
    plain = redistribute_time_us((8, 16), 4, (Shard(1), Shard(0)), (R, Shard(0)), (2, 4), prof)
    assert strided == pytest.approx(plain) and strided > 0


def test_size_one_mesh_dims_are_free() -> None:
    prof = toy_profile()
    assert redistribute_time_us((8, 16), 4, (P, Shard(0)), (R, Shard(0)), (1, 4), prof) == 0.0


def test_impossible_pairs() -> None:
    prof = toy_profile()
    assert math.isinf(redistribute_time_us((8,), 4, (P,), (Partial("max"),), (4,), prof))
    with pytest.raises(ImpossibleRedistribute):
        redistribute_steps((8,), 4, (Shard(0),), (Partial("max"),), (4,))
    assert redistribute_time_us((8,), 4, (Shard(0),), (P,), (4,), prof) == 0.0


def test_matrix_equals_scalar() -> None:
    prof = load_profile("h100")
    opts = [(a, b) for a in (R, P, Shard(0), Shard(1)) for b in (R, P, Shard(0), Shard(1))]
    srcs, dsts = opts, [*opts[::-1], (Partial("max"), R)]  # the last column is impossible
    mat = redistribute_cost_matrix((96, 40), 2, srcs, dsts, (4, 4), prof)
    assert mat.shape == (len(srcs), len(dsts))
    want = np.array([[redistribute_time_us((96, 40), 2, s, d, (4, 4), prof) for d in dsts] for s in srcs])
    np.testing.assert_array_equal(mat, want)
    assert np.isinf(mat).any() and (mat == 0).any()


# ------------------------------------------------------------- profiles


def test_profile_json_round_trip(tmp_path) -> None:
    for prof in [*BUILTIN_PROFILES.values(), toy_profile()]:
        path = tmp_path / f"{prof.name}.json"
        prof.to_json(path)
        back = load_profile(str(path))
        assert back == prof and hash(back) == hash(prof)


def test_unknown_profile_message() -> None:
    with pytest.raises(ValueError) as err:
        load_profile("tpu_v9")
    msg = str(err.value)
    assert "\n" not in msg and "tpu_v9" in msg and ".json" in msg
    assert all(name in msg for name in ("h100", "h200", "a100", "cpu_gloo"))


@pytest.fixture
def matmul_precision():
    """Sets torch's float32 matmul precision for one test, then restores it."""
    before = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)


def test_fp32_matmuls_are_priced_at_the_precision_torch_runs_them(matmul_precision) -> None:
    """At torch's default ("highest") fp32 matmuls run on an H100's FP32 cores (67 TFLOP/s
    peak, 52 measured); TF32 (494.7) only where the precision allows it."""
    strict = load_profile("h100")
    tf32 = for_matmul_precision(strict, "high")
    assert strict.peak_tflops["float32"] == pytest.approx(67.0)
    ratio = compute_time_us(1e15, 0.0, torch.float32, strict) / compute_time_us(1e15, 0.0, torch.float32, tf32)
    assert ratio == pytest.approx(494.7 / 67.0, rel=1e-4)
    assert compute_time_us(1e12, 0.0, torch.bfloat16, tf32) == compute_time_us(1e12, 0.0, torch.bfloat16, strict)
    matmul_precision("high")
    assert load_profile("h100") == tf32 and hash(load_profile("h100")) != hash(strict)  # plan-cache keys differ
    assert load_profile("cpu_gloo") == BUILTIN_PROFILES["cpu_gloo"]  # no TF32 rate: unchanged
    matmul_precision("highest")
    assert load_profile("h100") == strict


def test_the_mfu_peak_follows_the_matmul_precision(monkeypatch, matmul_precision) -> None:
    from torchtitan_autoparallel.train.metrics import resolve_peak

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    gpu = torch.device("cuda", 0)
    assert resolve_peak(None, gpu, "float32").tflops == pytest.approx(67.0)
    assert resolve_peak(None, gpu, "bfloat16").tflops == pytest.approx(989.0)
    matmul_precision("high")
    assert resolve_peak(None, gpu, "float32").tflops == pytest.approx(494.0)
    assert "tf32" in resolve_peak(None, gpu, "float32").source


def test_builtin_profiles_and_defaults() -> None:
    assert load_profile("h100").peak_tflops["bfloat16"] == pytest.approx(989.4)
    assert load_profile("a100").inter_node.bandwidth_GBps == pytest.approx(25.0)
    assert default_profile_name("cuda", False) == "h100"
    assert default_profile_name("cuda", False, "NVIDIA H100 80GB HBM3") == "h100"
    assert default_profile_name("cuda", False, "NVIDIA A100-SXM4-80GB") == "a100"
    assert default_profile_name("cuda", False, "NVIDIA H200") == "h200"  # as torch named the lent one
    assert default_profile_name("cuda", False, "NVIDIA GH200 480GB") == "h100"  # Grace Hopper: no H200
    assert default_profile_name("cuda", False, "NVIDIA L40S") == "h100"  # no built-in of its own
    assert default_profile_name("cpu", True, "NVIDIA A100-SXM4-80GB") == "h100"  # dry runs plan for H100s
    assert default_profile_name("cpu", True) == "h100"
    assert default_profile_name("cpu", False) == "cpu_gloo"
    cpu = load_profile("cpu_gloo")
    assert mesh_dim_links((4, 4, 4), cpu) == [cpu.intra_node] * 3


def test_h200_is_an_h100_with_more_and_faster_memory() -> None:
    h100, h200 = load_profile("h100"), load_profile("h200")
    assert h200.device_memory_gib == pytest.approx(140.4, abs=0.01)  # nvidia-smi: 143,771 MiB
    assert h200.mem_bandwidth_GBps == pytest.approx(4800.0)
    assert h200.peak_tflops == h100.peak_tflops and h200.compute_efficiency == h100.compute_efficiency
    assert (h200.intra_node, h200.inter_node) == (h100.intra_node, h100.inter_node)
    # A copy-bound op is priced by the bandwidth: 3350 / 4800 of H100's time.
    h100_us, h200_us = (compute_time_us(0.0, 1e10, torch.float32, p) - p.kernel_overhead_us for p in (h100, h200))
    assert h200_us == pytest.approx(h100_us * 3350.0 / 4800.0, rel=1e-6)


def test_a_gpu_run_prices_with_its_own_gpus_profile(monkeypatch, caplog) -> None:
    from types import SimpleNamespace

    from torchtitan_autoparallel.config import JobConfig
    from torchtitan_autoparallel.train import auto

    auto._warn_unprofiled_gpu.cache_clear()  # warned once per process: start from none
    runtime = SimpleNamespace(device_type="cuda", fake=False, device=torch.device("cuda", 0))
    for gpu, want, warned in (("NVIDIA A100-SXM4-80GB", "a100", False), ("NVIDIA H100 80GB HBM3", "h100", False),
                              ("NVIDIA H200", "h200", False), ("NVIDIA L40S", "h100", True)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, gpu=gpu: gpu)
        caplog.clear()
        with caplog.at_level("WARNING", logger="torchtitan_autoparallel"):
            assert auto.resolve_profile(JobConfig(), runtime).name == want
        assert ("no built-in cost profile for NVIDIA L40S" in caplog.text) == warned, caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="torchtitan_autoparallel"):
        auto.resolve_profile(JobConfig(), runtime)  # the L40S again: the run was told once
    assert "no built-in cost profile" not in caplog.text


# ------------------------------------------------------------- labels


def test_placement_labels_round_trip() -> None:
    ps = (Shard(0), R, P, _StridedShard(1, split_factor=4), Partial("max"))
    assert [placement_str(p) for p in ps] == ["S(0)", "R", "P", "SS(1,4)", "P(max)"]
    assert placements_str(ps) == "S(0)RPSS(1,4)P(max)"
    assert parse_placements(placements_str(ps)) == ps
    assert parse_placements("[S(0), SS(1,4), R]") == (Shard(0), _StridedShard(1, split_factor=4), R)
    assert all(parse_placement(placement_str(p)) == p for p in ps)
    with pytest.raises(ValueError):
        parse_placement("Q")


def test_partial_target_dim_shards_first_to_shrink_other_collectives() -> None:
    # (R, P) -> (P, R): shard mesh dim 0 for free, all-reduce the half-size
    # tensor over mesh dim 1, then turn the shard into Partial(sum) for free.
    assert redistribute_steps((8, 16), 4, (R, P), (P, R), (2, 4)) == [CommStep("all_reduce", 1, 256.0, 4)]


def _random_placements(rng: np.random.Generator, ndim: int, mesh: tuple[int, ...], count: int) -> list[tuple]:
    pool = [R, P, Partial("max"), _StridedShard(0, split_factor=2), *[Shard(d) for d in range(ndim)]]
    return [tuple(pool[k] for k in rng.integers(len(pool), size=len(mesh))) for _ in range(count)]


@pytest.mark.parametrize("mesh", [(4,), (8,), (2, 4), (8, 8), (2, 2, 2), (8, 8, 8), (1, 4, 2)])
def test_matrix_pricer_equals_reference_search(mesh: tuple[int, ...]) -> None:
    # The matrix path (shared move prices, int states) must reproduce the
    # per-pair search bit for bit, uneven shards and impossible pairs included.
    prof = load_profile("h100")
    rng = np.random.default_rng(len(mesh) * 100 + mesh[-1])
    for shape in [(7,), (96, 40), (3, 5, 16), (8, 2048, 128), (2, 4, 6, 10)]:
        srcs = _random_placements(rng, len(shape), mesh, 25)
        dsts = [*_random_placements(rng, len(shape), mesh, 25), srcs[0]]
        mat = redistribute_cost_matrix(shape, 2, srcs, dsts, mesh, prof)
        want = np.array([[redistribute_time_us(shape, 2, s, d, mesh, prof) for d in dsts] for s in srcs])
        np.testing.assert_array_equal(mat, want)
        assert mat[0, -1] == 0.0


def test_matrix_pricer_falls_back_when_codes_outgrow_a_digit(monkeypatch) -> None:
    # With 8 codes per digit, a 4-d tensor's placements soon overflow the
    # pricer's numbering; those pairs must go through the scalar search.
    from torchtitan_autoparallel.planner.cost import cost_model, pricer

    monkeypatch.setattr(pricer, "RADIX", 8)
    pricer.clear_caches()
    prof = load_profile("h100")
    rng = np.random.default_rng(7)
    mesh, shape = (2, 2, 2), (2, 4, 6, 10)
    srcs, dsts = _random_placements(rng, 4, mesh, 20), _random_placements(rng, 4, mesh, 20)
    mat = redistribute_cost_matrix(shape, 4, srcs, dsts, mesh, prof)
    assert cost_model._time_cached.cache_info().currsize > 0  # the matrix did fall back
    want = np.array([[redistribute_time_us(shape, 4, s, d, mesh, prof) for d in dsts] for s in srcs])
    np.testing.assert_array_equal(mat, want)
    pricer.clear_caches()


def test_matrix_pricer_on_a_mesh_too_wide_to_memoise_pair_times() -> None:
    # Six mesh dims make (start, goal) keys outgrow an int64, so the pricer keeps
    # no table of pair times and searches every pair; the answers stay exact.
    from torchtitan_autoparallel.planner.cost import pricer

    prof = load_profile("h100")
    rng = np.random.default_rng(11)
    mesh, shape = (2, 2, 1, 2, 1, 2), (8, 6, 4)
    srcs, dsts = _random_placements(rng, 3, mesh, 6), _random_placements(rng, 3, mesh, 6)
    mat = redistribute_cost_matrix(shape, 2, srcs, dsts, mesh, prof)
    assert pricer.pricer(shape, 2, mesh, prof).times is None
    want = np.array([[redistribute_time_us(shape, 2, s, d, mesh, prof) for d in dsts] for s in srcs])
    np.testing.assert_array_equal(mat, want)


def test_price_table_keeps_every_key_through_growth() -> None:
    # The open-addressing table behind the pricer's move prices: thousands of
    # keys (colliding on purpose: multiples of the capacity) survive each rehash.
    from torchtitan_autoparallel.planner.cost.pricer import _Prices, _slot

    table = _Prices(capacity=4)
    keys = [i * 4096 for i in range(3000)] + list(range(1, 3000, 7))
    for k in keys:
        table.put(k, k * 0.5)
    table.put(keys[0], -1.0)  # a key set again is no new key
    assert table.size == len(set(keys))
    assert 2 * table.size <= len(table.keys)
    for k in keys[1:]:
        at = _slot(table.keys, k)
        assert table.keys[at] == k and table.prices[at] == k * 0.5
    assert table.prices[_slot(table.keys, keys[0])] == -1.0
