"""Calibration: the fits recover known parameters from synthetic timings, and a
real 2-rank gloo run through ``CALIBRATE=1 ./run_train.sh`` writes a profile
that ``[autoparallel] cost_profile`` loads."""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from _run import PYTHON, REPO, run_launcher

from torchtitan_autoparallel.calibrate.fit import (
    CommSample,
    ComputeSample,
    FitError,
    HostSample,
    OptimizerSample,
    build_profile,
    fit_compute,
    fit_link,
    fit_step,
    kept_from_base,
)
from torchtitan_autoparallel.calibrate.measure import KIB, MIB, default_settings, device_memory_gib, intra_node_dims
from torchtitan_autoparallel.planner.cost.cost_model import COLLECTIVES, collective_time_us, compute_time_us
from torchtitan_autoparallel.planner.cost.profiles import PEAK_DTYPES, HardwareProfile, Link, load_profile
from torchtitan_autoparallel.planner.cost.step_terms import alloc_us, host_us, optimizer_us

TRUE = replace(load_profile("h100"), name="truth")
_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _compute_samples(noise: float, rng: np.random.Generator) -> list[ComputeSample]:
    """What the cost model says TRUE takes, at the GPU default sizes (compute-bound matmuls)."""
    settings = default_settings("cuda")
    out = []
    for dtype in PEAK_DTYPES:
        for n in settings.matmul_sizes:
            flops, nbytes = 2.0 * n**3, 3.0 * n * n * _TORCH[dtype].itemsize
            us = compute_time_us(flops, nbytes, _TORCH[dtype], TRUE)
            out.append(ComputeSample("matmul", dtype, flops, nbytes, us * (1 + noise * rng.standard_normal())))
    for nbytes in settings.copy_bytes:
        us = compute_time_us(0.0, 2.0 * nbytes, torch.float32, TRUE)
        out.append(ComputeSample("copy", "float32", 0.0, 2.0 * nbytes, us * (1 + noise * rng.standard_normal())))
    return out


def _comm_samples(link, group_size: int, noise: float, rng: np.random.Generator) -> list[CommSample]:
    out = []
    for kind in COLLECTIVES:
        for nbytes in (64 * KIB, 4 * MIB, 64 * MIB, 256 * MIB):
            us = collective_time_us(kind, nbytes, group_size, link)
            out.append(CommSample(kind, 0, group_size, float(nbytes), us * (1 + noise * rng.standard_normal())))
    return out


def test_fits_recover_the_parameters_of_exact_timings() -> None:
    rng = np.random.default_rng(0)
    compute = fit_compute(_compute_samples(0.0, rng))
    for dtype in PEAK_DTYPES:
        assert compute.tflops[dtype] == pytest.approx(TRUE.peak_tflops[dtype] * TRUE.compute_efficiency, rel=1e-6)
    assert compute.mem_bandwidth_GBps == pytest.approx(TRUE.mem_bandwidth_GBps, rel=1e-6)
    assert compute.kernel_overhead_us == pytest.approx(TRUE.kernel_overhead_us, rel=1e-6)
    for link, n in ((TRUE.intra_node, 8), (TRUE.inter_node, 4)):
        fit = fit_link(_comm_samples(link, n, 0.0, rng))
        assert fit.link.latency_us == pytest.approx(link.latency_us, rel=1e-6)
        assert fit.link.bandwidth_GBps == pytest.approx(link.bandwidth_GBps, rel=1e-6)
        assert fit.rel_rms < 1e-9


def test_fits_stay_close_under_noise_and_price_like_the_truth() -> None:
    rng = np.random.default_rng(1)
    compute = fit_compute(_compute_samples(0.03, rng))
    intra = fit_link(_comm_samples(TRUE.intra_node, 8, 0.03, rng))
    inter = fit_link(_comm_samples(TRUE.inter_node, 2, 0.03, rng))
    profile = build_profile("fitted", TRUE, compute, intra, inter, devices_per_node=8)
    assert profile.compute_efficiency == 1.0
    for dtype in PEAK_DTYPES:
        assert profile.peak_tflops[dtype] == pytest.approx(TRUE.peak_tflops[dtype] * TRUE.compute_efficiency, rel=0.05)
    assert profile.intra_node.bandwidth_GBps == pytest.approx(TRUE.intra_node.bandwidth_GBps, rel=0.05)
    assert profile.inter_node.bandwidth_GBps == pytest.approx(TRUE.inter_node.bandwidth_GBps, rel=0.05)
    # What matters to the planner: the fitted profile prices work as the true one does.
    for kind in COLLECTIVES:
        assert collective_time_us(kind, 32 * MIB, 8, profile.intra_node) == pytest.approx(
            collective_time_us(kind, 32 * MIB, 8, TRUE.intra_node), rel=0.05
        )
    flops = 2.0 * 4096**3
    assert compute_time_us(flops, 0, torch.bfloat16, profile) == pytest.approx(
        compute_time_us(flops, 0, torch.bfloat16, TRUE), rel=0.05
    )


def test_unmeasured_link_and_dtype_are_kept_from_the_base() -> None:
    rng = np.random.default_rng(2)
    samples = [s for s in _compute_samples(0.0, rng) if s.dtype == "float32"]
    profile = build_profile("partial", TRUE, fit_compute(samples), None, None, devices_per_node=8)
    assert profile.intra_node == TRUE.intra_node and profile.inter_node == TRUE.inter_node
    # bf16 keeps its ratio to fp32 from the base profile.
    ratio = TRUE.peak_tflops["bfloat16"] / TRUE.peak_tflops["float32"]
    assert profile.peak_tflops["bfloat16"] == pytest.approx(profile.peak_tflops["float32"] * ratio, rel=1e-6)


def test_measured_device_memory_replaces_the_bases_and_unmeasured_is_reported_kept() -> None:
    """An H200 calibrated on the h100 profile kept H100's 80 GB; the memory torch reports wins."""
    rng = np.random.default_rng(10)
    compute, intra = fit_compute(_compute_samples(0.0, rng)), fit_link(_comm_samples(TRUE.intra_node, 8, 0.0, rng))
    measured = build_profile("gpu", TRUE, compute, intra, None, devices_per_node=8, device_memory_gib=140.4)
    assert measured.device_memory_gib == 140.4 and TRUE.device_memory_gib == pytest.approx(79.65, abs=0.01)
    assert kept_from_base(intra, None, 140.4) == ["inter_node"]
    unmeasured = build_profile("cpu", TRUE, compute, intra, None, devices_per_node=8)
    assert unmeasured.device_memory_gib == TRUE.device_memory_gib
    assert kept_from_base(intra, None, None) == ["inter_node", "device_memory_gib"]
    assert kept_from_base(None, None, None) == ["intra_node", "inter_node", "device_memory_gib"]
    assert device_memory_gib(torch.device("cpu")) is None  # CPU: nothing to measure, the base's is kept


@pytest.mark.parametrize("memory", [140.4, None])
def test_the_saved_profile_and_its_report_carry_the_device_memory(tmp_path: Path, capsys, memory) -> None:
    from argparse import Namespace

    from torchtitan_autoparallel.calibrate.__main__ import Measured, _fit_and_save

    rng = np.random.default_rng(11)
    host, opt = _step_samples(0.0, rng)
    out = tmp_path / "profile.json"
    measured = Measured(_compute_samples(0.0, rng), [], [], host, opt, memory)
    _fit_and_save(Namespace(name="calibrated", out=str(out)), TRUE, measured, (1,), 8)
    text = capsys.readouterr().out
    samples = json.loads(out.with_suffix(".samples.json").read_text())
    assert load_profile(str(out)).device_memory_gib == (memory or TRUE.device_memory_gib)
    if memory is None:
        assert samples["kept_from_base"]["fields"] == ["intra_node", "inter_node", "device_memory_gib"]
        assert "kept from profile 'truth': intra_node, inter_node, device_memory_gib" in text, text
        assert "device memory:" not in text
    else:
        assert samples["kept_from_base"]["fields"] == ["intra_node", "inter_node"]
        assert "device memory: 140.4 GiB" in text and "kept from profile 'truth': intra_node, inter_node\n" in text


def test_fit_errors_name_the_problem() -> None:
    with pytest.raises(FitError, match="two distinct message sizes"):
        fit_link([CommSample("all_gather", 0, 2, 1024.0, 10.0)] * 3)
    with pytest.raises(FitError, match="matmul timings and copy timings"):
        fit_compute([ComputeSample("copy", "float32", 0.0, 1e6, 10.0)])


# What the step fit must recover: 12.5 us per node, and 400 us per tensor + 7 ns per element + 4 ms per step.
STEP_TRUTH = replace(TRUE, host_us_per_node=12.5, optimizer_us_per_tensor=400.0, optimizer_us_per_element=0.007,
                     optimizer_fixed_us=4000.0)


def _step_samples(noise: float, rng: np.random.Generator) -> tuple[list[HostSample], list[OptimizerSample]]:
    def jitter(us: float) -> float:
        return us * (1 + noise * rng.standard_normal())

    host = [HostSample(n, jitter(host_us(n, STEP_TRUTH) + 150.0)) for n in (300, 1200, 2400)]
    settings = ((8, 4096), (32, 4096), (8, 65536), (32, 65536), (16, 262144))
    opt = [OptimizerSample(t, t * e, jitter(optimizer_us(t, t * e, STEP_TRUTH))) for t, e in settings]
    return host, opt


def test_step_fit_recovers_host_and_optimizer_costs() -> None:
    fit = fit_step(*_step_samples(0.0, np.random.default_rng(3)))
    assert fit.host_us_per_node == pytest.approx(12.5, rel=1e-6)
    assert fit.optimizer_us_per_tensor == pytest.approx(400.0, rel=1e-6)
    assert fit.optimizer_us_per_element == pytest.approx(0.007, rel=1e-6)
    assert fit.optimizer_fixed_us == pytest.approx(4000.0, rel=1e-6)
    assert max(fit.rel_rms.values()) < 1e-9
    noisy = fit_step(*_step_samples(0.03, np.random.default_rng(4)))
    profile = build_profile("fitted", TRUE, fit_compute(_compute_samples(0.0, np.random.default_rng(5))),
                            None, None, devices_per_node=8, step=noisy)
    # The fitted profile prices the debug model's optimizer (45 tensors, 1.5M elements) as the truth does.
    assert optimizer_us(45, 1.5e6, profile) == pytest.approx(optimizer_us(45, 1.5e6, STEP_TRUTH), rel=0.05)
    assert host_us(2000, profile) == pytest.approx(host_us(2000, STEP_TRUTH), rel=0.05)


def test_step_fit_recovers_the_cost_of_fresh_output_memory() -> None:
    """Small-op graphs and activation-sized chains, the kernels' traffic at the compute fit's bandwidth taken off."""
    truth = replace(STEP_TRUTH, alloc_us_per_byte=4.0 / 4096)  # 4 us per 4 KiB page
    bandwidth = 40.0  # GB/s, as the compute fit would give it

    def sample(nodes: int, out_bytes: float, noise: float, rng) -> HostSample:
        fresh, moved = nodes * out_bytes, 2.0 * nodes * out_bytes
        us = host_us(nodes, truth) + alloc_us(fresh, truth) + moved / (bandwidth * 1e3) + 150.0
        return HostSample(nodes, us * (1 + noise * rng.standard_normal()), fresh_bytes=fresh, moved_bytes=moved)

    graphs = ((300, 1024.0), (1200, 1024.0), (2400, 1024.0), (120, 65536.0), (60, 262144.0), (30, 1048576.0))
    _, opt = _step_samples(0.0, np.random.default_rng(8))
    for noise, rel in ((0.0, 1e-6), (0.03, 0.1)):
        rng = np.random.default_rng(9)
        fit = fit_step([sample(n, b, noise, rng) for n, b in graphs], opt, mem_bandwidth_GBps=bandwidth)
        assert fit.alloc_us_per_byte == pytest.approx(truth.alloc_us_per_byte, rel=rel)
        assert fit.host_us_per_node == pytest.approx(12.5, rel=rel)
    # One chain faster than the copy bandwidth (its outputs stayed in cache) still fits; all of them cannot.
    cached = [sample(n, b, 0.0, rng) for n, b in graphs]
    cached[4] = replace(cached[4], us=0.5 * cached[4].moved_bytes / (bandwidth * 1e3))
    assert fit_step(cached, opt, mem_bandwidth_GBps=bandwidth).host_us_per_node > 0
    with pytest.raises(FitError, match="below their kernels' memory traffic"):
        fit_step(cached, opt, mem_bandwidth_GBps=bandwidth / 1000)
    # Small-op graphs alone cannot tell the per-byte cost from the per-node one: it stays 0.
    small = fit_step([sample(n, b, 0.0, rng) for n, b in graphs[:3]], opt)
    assert small.alloc_us_per_byte == 0.0


def test_step_fit_errors_name_the_problem() -> None:
    host, opt = _step_samples(0.0, np.random.default_rng(6))
    with pytest.raises(FitError, match="graphs of at least two sizes"):
        fit_step(host[:1], opt)
    with pytest.raises(FitError, match="three"):
        fit_step(host, opt[:2])
    with pytest.raises(FitError, match="do not grow with the number of nodes"):
        fit_step([HostSample(300, 900.0), HostSample(1200, 500.0)], opt)


def test_link_fit_separates_the_per_call_cost_given_two_group_sizes() -> None:
    rng = np.random.default_rng(7)
    link = Link(latency_us=300.0, bandwidth_GBps=0.5, call_overhead_us=5000.0)
    fit = fit_link(_comm_samples(link, 4, 0.0, rng) + _comm_samples(link, 2, 0.0, rng))
    assert fit.link.call_overhead_us == pytest.approx(5000.0, rel=1e-6)
    assert fit.link.latency_us == pytest.approx(300.0, rel=1e-6)
    assert fit.link.bandwidth_GBps == pytest.approx(0.5, rel=1e-6)
    # One group size cannot tell a per-call cost from the latency: it stays 0, as before.
    assert fit_link(_comm_samples(TRUE.intra_node, 8, 0.0, rng)).link.call_overhead_us == 0.0
    # The cost model charges the per-call cost once per collective.
    assert collective_time_us("all_gather", 1024.0, 2, link) == pytest.approx(
        collective_time_us("all_gather", 1024.0, 2, replace(link, call_overhead_us=0.0)) + 5000.0
    )


def test_profile_saved_before_the_step_fields_still_loads(tmp_path: Path) -> None:
    old = STEP_TRUTH.to_dict()
    for key in ("host_us_per_node", "optimizer_us_per_tensor", "optimizer_us_per_element", "optimizer_fixed_us"):
        del old[key]
    for link in ("intra_node", "inter_node"):
        del old[link]["call_overhead_us"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    loaded = load_profile(str(path))
    assert loaded == replace(STEP_TRUTH, host_us_per_node=0.0, optimizer_us_per_tensor=0.0,
                             optimizer_us_per_element=0.0, optimizer_fixed_us=0.0)
    assert loaded.intra_node.call_overhead_us == 0.0
    STEP_TRUTH.to_json(path)  # and the new fields survive a round trip
    assert load_profile(str(path)) == STEP_TRUTH and hash(load_profile(str(path))) == hash(STEP_TRUTH)
    with pytest.raises(ValueError, match="host_us_per_node must be >= 0"):
        HardwareProfile.from_dict({**STEP_TRUTH.to_dict(), "host_us_per_node": -1.0})


def test_intra_node_dims_follow_the_row_major_layout() -> None:
    assert intra_node_dims((2, 4), 4) == [False, True]
    assert intra_node_dims((8,), 8) == [True]
    assert intra_node_dims((2, 2, 2), 2) == [False, False, True]


@pytest.mark.multirank
def test_real_two_rank_calibration_writes_a_loadable_profile(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    # 16 MiB messages: at 4 MiB a test running beside this one (make test's other worker)
    # could out-time the size, and the fit rightly refused a slope below zero
    args = ["--out", out, "--matmul-sizes", "64,256", "--copy-kib", "64,4096",
            "--message-kib", "16,16384", "--repeats", "3"]
    run = run_launcher(args, ngpu=2, env={"CALIBRATE": "1"}, timeout=300)
    assert run.returncode == 0, run.tail()
    text = run.stdout + run.stderr
    # 3 dtypes x 2 + 2 copies + 3 host graphs + 3 activation-sized graphs + 5 optimizer settings
    # + 4 kinds x 2 sizes (no pairs on 2 ranks)
    assert "[calibrate 27/27 ##########]" in text, run.tail()
    assert "us per graph node" in text and "per fresh 4 KiB page" in text and "(clip + AdamW)" in text, run.tail()
    assert f"profile written to {out}" in text
    profile = load_profile(str(out))  # what --autoparallel.cost_profile PATH calls
    assert profile.name == "calibrated" and profile.compute_efficiency == 1.0
    assert all(v > 0 for v in profile.peak_tflops.values()) and profile.intra_node.bandwidth_GBps > 0
    assert profile.host_us_per_node > 0
    assert profile.optimizer_us_per_tensor + profile.optimizer_us_per_element > 0
    samples = json.loads(out.with_suffix(".samples.json").read_text())
    assert len(samples["comm_samples"]) == 8
    # No device memory on CPU: cpu_gloo's (none) is kept, and said so.
    assert samples["kept_from_base"]["fields"] == ["inter_node", "device_memory_gib"]
    assert "kept from profile 'cpu_gloo': inter_node, device_memory_gib" in text, run.tail()


def test_bad_mesh_shape_is_a_one_line_error() -> None:
    proc = subprocess.run(
        [str(PYTHON), "-m", "torchtitan_autoparallel.calibrate", "--mesh-shape", "3x1"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: --mesh-shape 3x1 does not cover the 1 ranks launched; "
        "accepted: sizes joined by 'x' whose product is 1"
    )


class _Clock:
    """``measure``'s clock, moved only by the timed calls: the asserts on it are exact
    whatever else the machine runs (under CI load a real 1 ms sleep took ~2 ms)."""

    def __init__(self) -> None:
        self.now = 0.0

    def advance(self, seconds: float):
        def call() -> None:
            self.now += seconds
        return call


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    from types import SimpleNamespace

    from torchtitan_autoparallel.calibrate import measure

    fake = _Clock()
    monkeypatch.setattr(measure, "time", SimpleNamespace(perf_counter=lambda: fake.now))
    return fake


def test_short_calls_are_timed_in_batches_that_span_the_window(gloo_one, clock) -> None:
    from torchtitan_autoparallel.calibrate import measure

    calls = []
    step = clock.advance(0.001)

    def one_ms() -> None:
        calls.append(1)
        step()

    us = measure.time_us(one_ms, 3, torch.device("cpu"), window_s=0.02)
    assert abs(us - 1000.0) < 1e-6  # per call, not per batch
    batch = (len(calls) - 1 - 3) / 3  # one warm-up, three single calls to size the batch, three batches
    assert batch in (20, 21)  # 20 ms of 1 ms calls (21 where 0.02 / 0.001 rounds up)
    calls.clear()
    measure.time_us(one_ms, 3, torch.device("cpu"))  # no window: single calls, after one warm-up
    assert len(calls) == 4


def test_a_collective_after_compute_is_charged_without_the_burst(gloo_one, clock) -> None:
    from torchtitan_autoparallel.calibrate import measure

    # One rank waits for no one: the sample is the 2 ms call alone, the 5 ms burst before it untimed.
    us = measure.time_after_compute_us(clock.advance(0.002), clock.advance(0.005), 5, torch.device("cpu"))
    assert abs(us - 2000.0) < 1e-6
