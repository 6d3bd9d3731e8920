"""Least-squares fits of the cost model's parameters to measured timings.

The cost model (``planner/cost/cost_model.py``) is linear in the reciprocals of
its rates, so each fit is one weighted linear least-squares problem:

* compute: ``us = flops / F_dtype + overhead`` for matmuls and
  ``us = bytes / M + overhead`` for copies, one shared launch overhead;
* one link: ``us = k * ((n-1) * latency + (n-1)/n * bytes / B) + call`` with
  k = 2 for all_reduce and 1 for all_gather, reduce_scatter and all_to_all;
  the per-call cost is fitted only when groups of two sizes were timed (with
  one size it cannot be told from the latency, and stays 0);
* the step outside the graph (``measure_step.py``): ``us = nodes * host +
  fresh_bytes * alloc + moved_bytes / M + c`` for FX graphs of small ops and of
  activation-sized ones whose outputs stay alive (M from the compute fit, so
  the kernels' own traffic is not counted twice), and ``us = tensors * a +
  elements * b + fixed`` for clipping plus AdamW.

Rows are divided by the measured time, so the fit minimises relative error:
a 20 us latency-bound message counts as much as a 20 ms bandwidth-bound one.
A calibrated profile folds the efficiency into the peak: ``peak_tflops`` is
the throughput reached and ``compute_efficiency`` is 1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from torchtitan_autoparallel.planner.cost.cost_model import COLLECTIVES
from torchtitan_autoparallel.planner.cost.profiles import PEAK_DTYPES, HardwareProfile, Link


class FitError(ValueError):
    """The timings cannot determine a parameter (too few or inconsistent samples)."""


@dataclass(frozen=True)
class ComputeSample:
    op: str  # "matmul" or "copy"
    dtype: str  # one of PEAK_DTYPES
    flops: float
    bytes: float  # bytes read + written
    us: float


@dataclass(frozen=True)
class CommSample:
    kind: str  # one of COLLECTIVES
    mesh_dim: int
    group_size: int
    bytes: float  # as the cost model counts them: full buffer, or the local shard for all_to_all
    us: float


@dataclass(frozen=True)
class HostSample:
    nodes: int  # call_function nodes of the graph run
    us: float
    fresh_bytes: float = 0.0  # bytes of the outputs the graph allocates (views allocate none)
    moved_bytes: float = 0.0  # bytes its kernels read + write


@dataclass(frozen=True)
class OptimizerSample:
    tensors: int  # parameter tensors
    elements: int  # local parameter elements on one rank, all tensors together
    us: float  # one clip_grad_norm + AdamW step


@dataclass(frozen=True)
class StepFit:
    """The step's costs outside the planned graph; see HardwareProfile's fields of these names."""

    host_us_per_node: float
    alloc_us_per_byte: float
    optimizer_us_per_tensor: float
    optimizer_us_per_element: float
    optimizer_fixed_us: float
    rel_rms: dict[str, float]  # "host", "optimizer"


@dataclass(frozen=True)
class ComputeFit:
    tflops: dict[str, float]  # reached throughput per dtype
    mem_bandwidth_GBps: float
    kernel_overhead_us: float
    rel_rms: float  # root-mean-square relative residual


@dataclass(frozen=True)
class LinkFit:
    link: Link
    rel_rms: float


def _solve(rows: np.ndarray, us: np.ndarray) -> tuple[np.ndarray, float]:
    """Relative-error least squares; returns the coefficients and the RMS relative residual."""
    weights = 1.0 / us
    a, b = rows * weights[:, None], us * weights
    coef, *_ = np.linalg.lstsq(a, b, rcond=None)
    residual = a @ coef - b
    return coef, float(np.sqrt(np.mean(residual**2)))


def fit_compute(samples: list[ComputeSample]) -> ComputeFit:
    dtypes = sorted({s.dtype for s in samples if s.op == "matmul"}, key=PEAK_DTYPES.index)
    if not dtypes or not any(s.op == "copy" for s in samples):
        raise FitError("compute fit needs matmul timings and copy timings")
    col = {d: i for i, d in enumerate(dtypes)}
    mem, overhead = len(dtypes), len(dtypes) + 1
    rows = np.zeros((len(samples), len(dtypes) + 2))
    for r, s in enumerate(samples):
        if s.op == "matmul":
            rows[r, col[s.dtype]] = s.flops
        else:
            rows[r, mem] = s.bytes
        rows[r, overhead] = 1.0
    coef, rms = _solve(rows, np.array([s.us for s in samples]))
    bad = [d for d in dtypes if coef[col[d]] <= 0] + (["memory bandwidth"] if coef[mem] <= 0 else [])
    if bad:
        raise FitError(f"timings do not grow with work for {', '.join(bad)}; use larger sizes or more repeats")
    return ComputeFit(
        tflops={d: 1.0 / coef[col[d]] / 1e6 for d in dtypes},  # flops/us -> TFLOP/s
        mem_bandwidth_GBps=1.0 / coef[mem] / 1e3,  # bytes/us -> GB/s
        kernel_overhead_us=max(0.0, float(coef[overhead])),
        rel_rms=rms,
    )


def fit_link(samples: list[CommSample]) -> LinkFit:
    """One (latency, bandwidth, per-call cost) for collectives of every kind over the given groups."""
    if len({(s.group_size, s.bytes) for s in samples}) < 2:
        raise FitError("a link fit needs at least two distinct message sizes")
    with_call = len({s.group_size for s in samples}) > 1
    rows = np.zeros((len(samples), 3 if with_call else 2))
    for r, s in enumerate(samples):
        if s.kind not in COLLECTIVES:
            raise FitError(f"unknown collective {s.kind!r}; accepted: {', '.join(COLLECTIVES)}")
        k = 2.0 if s.kind == "all_reduce" else 1.0
        n = s.group_size
        rows[r, :2] = (k * (n - 1), k * (n - 1) / n * s.bytes)
        if with_call:
            rows[r, 2] = 1.0
    coef, rms = _solve(rows, np.array([s.us for s in samples]))
    if coef[1] <= 0:
        raise FitError("collective timings do not grow with message size; use larger messages")
    # A latency or call cost fitted below zero is noise around a small true value.
    call = max(0.0, float(coef[2])) if with_call else 0.0
    link = Link(latency_us=max(0.0, float(coef[0])), bandwidth_GBps=1.0 / coef[1] / 1e3, call_overhead_us=call)
    return LinkFit(link, rms)


def _positive(value: float) -> float:
    # A cost fitted below zero is noise around a small true value.
    return max(0.0, float(value))


def fit_step(host: list[HostSample], optimizer: list[OptimizerSample], mem_bandwidth_GBps: float = 0.0) -> StepFit:
    """Per-node host time, per-byte cost of fresh outputs, and the optimizer's per-tensor, per-element and fixed costs."""
    if len({s.nodes for s in host}) < 2:
        raise FitError("the host fit needs graphs of at least two sizes")
    if len({(s.tensors, s.elements) for s in optimizer}) < 3:
        raise FitError("the optimizer fit needs at least three (tensors, elements) settings")
    host_coef, host_rms = _fit_host(host, mem_bandwidth_GBps)
    rows = np.array([[s.tensors, s.elements, 1.0] for s in optimizer], dtype=float)
    opt_coef, opt_rms = _solve(rows, np.array([s.us for s in optimizer]))
    return StepFit(
        host_us_per_node=float(host_coef[0]),
        alloc_us_per_byte=_positive(host_coef[1]),
        optimizer_us_per_tensor=_positive(opt_coef[0]),
        optimizer_us_per_element=_positive(opt_coef[1]),
        optimizer_fixed_us=_positive(opt_coef[2]),
        rel_rms={"host": host_rms, "optimizer": opt_rms},
    )


def _fit_host(host: list[HostSample], mem_bandwidth_GBps: float) -> tuple[list[float], float]:
    """(us per node, us per fresh byte); the kernels' traffic at bandwidth M is known and taken off first."""
    # The per-byte cost is separable from the per-node one only if graphs allocate different bytes per node.
    with_alloc = len({round(s.fresh_bytes / s.nodes) for s in host}) > 1
    traffic = np.array([s.moved_bytes / (mem_bandwidth_GBps * 1e3) if mem_bandwidth_GBps > 0 else 0.0 for s in host])
    rows = np.array([[s.nodes, s.fresh_bytes, 1.0] if with_alloc else [s.nodes, 1.0] for s in host], dtype=float)
    us = np.array([s.us for s in host])
    # A graph whose outputs stay in cache may run under the copy's bandwidth (a 256 KiB chain
    # beside a 4 MiB copy did); only when every graph with traffic does is the copy timing wrong.
    moved = traffic > 0
    if moved.any() and np.all(us[moved] <= traffic[moved]):
        raise FitError("graph timings are below their kernels' memory traffic; check the copy timings")
    coef, rms = _solve(rows, us - traffic)
    if coef[0] <= 0:
        raise FitError("graph timings do not grow with the number of nodes; use larger graphs")
    return [float(coef[0]), float(coef[1]) if with_alloc else 0.0], rms


def build_profile(
    name: str,
    base: HardwareProfile,
    compute: ComputeFit,
    intra: LinkFit | None,
    inter: LinkFit | None,
    devices_per_node: int,
    step: StepFit | None = None,
    device_memory_gib: float | None = None,
) -> HardwareProfile:
    """``base`` with every measured parameter replaced; what was not measured keeps base's value.

    A dtype not measured keeps base's peak scaled by the measured fp32 ratio,
    so the dtypes stay in base's proportions. ``device_memory_gib``: one
    device's memory as torch reports it (None on CPU, where base's is kept).
    """
    # Reached / base peak; without an fp32 timing, base's own efficiency (the profile's is now 1).
    if "float32" in compute.tflops:
        scale = compute.tflops["float32"] / base.peak_tflops["float32"]
    else:
        scale = base.compute_efficiency
    peaks = {d: compute.tflops.get(d, base.peak_tflops[d] * scale) for d in PEAK_DTYPES}
    return replace(
        base,
        name=name,
        peak_tflops=peaks,
        compute_efficiency=1.0,
        mem_bandwidth_GBps=compute.mem_bandwidth_GBps,
        kernel_overhead_us=compute.kernel_overhead_us,
        intra_node=intra.link if intra else base.intra_node,
        inter_node=inter.link if inter else base.inter_node,
        devices_per_node=devices_per_node,
        device_memory_gib=base.device_memory_gib if device_memory_gib is None else device_memory_gib,
        **(_step_fields(step) if step else {}),
    )


def kept_from_base(intra: LinkFit | None, inter: LinkFit | None, device_memory_gib: float | None) -> list[str]:
    """The fields ``build_profile`` keeps from its base, given the same fits and memory."""
    unmeasured = (("intra_node", intra), ("inter_node", inter), ("device_memory_gib", device_memory_gib))
    return [name for name, value in unmeasured if value is None]


def _step_fields(step: StepFit) -> dict[str, float]:
    return {
        "host_us_per_node": step.host_us_per_node,
        "alloc_us_per_byte": step.alloc_us_per_byte,
        "optimizer_us_per_tensor": step.optimizer_us_per_tensor,
        "optimizer_us_per_element": step.optimizer_us_per_element,
        "optimizer_fixed_us": step.optimizer_fixed_us,
    }
