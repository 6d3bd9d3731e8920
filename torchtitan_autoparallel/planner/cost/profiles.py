"""Hardware profiles: the few numbers the cost model needs about a machine.

Units: microseconds, bytes, GB/s (1e9 bytes per second) and TFLOP/s (1e12).
The built-in figures and their sources are listed in docs/cost_model.md.
A profile is a frozen, hashable value so cost functions can be memoised on it.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

PEAK_DTYPES = ("float32", "bfloat16", "float16")
# Optional peak_tflops key: float32 matmuls on TF32 tensor cores, which torch uses only
# when ``torch.set_float32_matmul_precision`` is "high" or "medium" (see load_profile).
TF32 = "tf32"
# Fields with a default of 0, so that profiles saved before they existed still load.
_OPTIONAL_FIELDS = (
    "host_us_per_node", "alloc_us_per_byte", "optimizer_us_per_tensor", "optimizer_us_per_element",
    "optimizer_fixed_us", "device_memory_gib",
)


@dataclass(frozen=True)
class Link:
    """One communication link class: per-hop latency, per-GPU bandwidth and a fixed cost per call.

    ``call_overhead_us`` is paid once per collective whatever the group size:
    issuing it and waking the ranks' communication threads. It is 0 on the
    built-in GPU profiles; a calibration on ranks that share CPU cores fits it
    (tens of ms of scheduling there, see docs/cost_model.md).
    """

    latency_us: float
    bandwidth_GBps: float
    call_overhead_us: float = 0.0

    def __post_init__(self) -> None:
        if self.latency_us < 0 or self.bandwidth_GBps <= 0 or self.call_overhead_us < 0:
            raise ValueError(f"bad Link {self}: need latency_us >= 0, bandwidth_GBps > 0 and call_overhead_us >= 0")


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    peak_tflops: dict[str, float]  # dense peak per dtype, keys PEAK_DTYPES (and optionally TF32)
    mem_bandwidth_GBps: float
    devices_per_node: int
    intra_node: Link
    inter_node: Link
    compute_efficiency: float  # fraction of peak that large matmuls reach
    kernel_overhead_us: float  # fixed cost per launched kernel
    # The step's costs outside the planned graph (calibrate/measure_step.py);
    # 0 (not modelled) in the built-in profiles and in profiles saved before them.
    host_us_per_node: float = 0.0  # host time to run one node of the executed graph
    # First touch of a node's freshly allocated output (page faults: the CPU
    # allocator hands large buffers back to the OS, so each new one faults in).
    alloc_us_per_byte: float = 0.0
    optimizer_us_per_tensor: float = 0.0  # clipping + AdamW, per parameter tensor
    optimizer_us_per_element: float = 0.0  # ... per local parameter element
    optimizer_fixed_us: float = 0.0  # ... per step (clipping's one all-reduce of a scalar)
    # Memory of one device, as nvidia-smi and torch.cuda report it; 0: not known.
    # Prices nothing: a plan is checked against it (report/common.py, ``memory_fit``).
    device_memory_gib: float = 0.0

    def __post_init__(self) -> None:
        missing = [k for k in PEAK_DTYPES if k not in self.peak_tflops]
        if missing:
            raise ValueError(f"profile {self.name!r}: peak_tflops lacks {missing}")
        if any(v <= 0 for v in self.peak_tflops.values()):
            raise ValueError(f"profile {self.name!r}: peak_tflops must be > 0")
        if self.mem_bandwidth_GBps <= 0 or self.devices_per_node < 1:
            raise ValueError(f"profile {self.name!r}: mem_bandwidth_GBps and devices_per_node must be > 0")
        if not 0 < self.compute_efficiency <= 1:
            raise ValueError(f"profile {self.name!r}: compute_efficiency must be in (0, 1]")
        if self.kernel_overhead_us < 0:
            raise ValueError(f"profile {self.name!r}: kernel_overhead_us must be >= 0")
        negative = [k for k in _OPTIONAL_FIELDS if getattr(self, k) < 0]
        if negative:
            raise ValueError(f"profile {self.name!r}: {', '.join(negative)} must be >= 0")

    # The dict field would make the generated hash fail; hashing its sorted
    # items keeps profiles usable as lru_cache keys.  Treat the dict as frozen.
    def __hash__(self) -> int:
        return hash(
            (
                self.name,
                tuple(sorted(self.peak_tflops.items())),
                self.mem_bandwidth_GBps,
                self.devices_per_node,
                self.intra_node,
                self.inter_node,
                self.compute_efficiency,
                self.kernel_overhead_us,
                *(getattr(self, k) for k in _OPTIONAL_FIELDS),
            )
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HardwareProfile:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        missing = sorted(names - set(data) - set(_OPTIONAL_FIELDS))  # older profiles lack those: 0
        if unknown or missing:
            raise ValueError(f"bad hardware profile: missing fields {missing}, unknown fields {unknown}")
        kwargs = dict(data)
        kwargs["peak_tflops"] = {str(k): float(v) for k, v in data["peak_tflops"].items()}
        kwargs["intra_node"] = Link(**data["intra_node"])
        kwargs["inter_node"] = Link(**data["inter_node"])
        kwargs["devices_per_node"] = int(data["devices_per_node"])
        for key in ("mem_bandwidth_GBps", "compute_efficiency", "kernel_overhead_us", *_OPTIONAL_FIELDS):
            if key in data:
                kwargs[key] = float(data[key])
        return cls(**kwargs)

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> HardwareProfile:
        return cls.from_dict(json.loads(Path(path).read_text()))


# H100 SXM5: fp32 matmuls run on the FP32 cores (67) at torch's default precision and
# on TF32 tensor cores (494.7) only when the precision allows it; on an H100 here they
# ran at 52 and 375-401 TFLOP/s (experiments/gpu).  Sources: docs/cost_model.md.
_H100 = HardwareProfile(
    name="h100",
    peak_tflops={"float32": 67.0, TF32: 494.7, "bfloat16": 989.4, "float16": 989.4},
    mem_bandwidth_GBps=3350.0,
    devices_per_node=8,
    intra_node=Link(latency_us=3.0, bandwidth_GBps=450.0),  # NVLink4, 900 GB/s bidir
    inter_node=Link(latency_us=8.0, bandwidth_GBps=50.0),  # NDR 400 Gb/s per GPU
    compute_efficiency=0.70,
    kernel_overhead_us=3.0,
    device_memory_gib=81559 / 1024,  # 80 GB HBM3: nvidia-smi reports 81,559 MiB
)

# H200 SXM: an H100 SXM's compute, NVLink 4 and (DGX H200) 400 Gb/s port per GPU, with more
# and faster memory: 141 GB HBM3e at 4.8 TB/s.  Sources: docs/cost_model.md.
_H200 = replace(
    _H100,
    name="h200",
    mem_bandwidth_GBps=4800.0,
    # nvidia-smi reported 143,771 MiB on the lent H200, torch 139.8 GiB (experiments/gpu)
    device_memory_gib=143771 / 1024,
)

_A100 = HardwareProfile(
    name="a100",
    peak_tflops={"float32": 19.5, TF32: 156.0, "bfloat16": 312.0, "float16": 312.0},
    mem_bandwidth_GBps=2039.0,
    devices_per_node=8,
    intra_node=Link(latency_us=3.0, bandwidth_GBps=300.0),  # NVLink3, 600 GB/s bidir
    inter_node=Link(latency_us=10.0, bandwidth_GBps=25.0),  # HDR 200 Gb/s per GPU
    compute_efficiency=0.75,
    kernel_overhead_us=4.0,
    device_memory_gib=80.0,  # the 80 GB part: nvidia-smi reports 81,920 MiB
)

# A small shared CPU box running every rank as a gloo process over loopback.
# devices_per_node is huge so every mesh dim is "intra"; both links are the
# same loopback anyway.  bf16/fp16 matmuls are slower than fp32 on CPUs
# without AMX, hence the lower peaks.
_CPU_GLOO = HardwareProfile(
    name="cpu_gloo",
    peak_tflops={"float32": 0.1, "bfloat16": 0.03, "float16": 0.02},
    mem_bandwidth_GBps=15.0,
    devices_per_node=1 << 20,
    intra_node=Link(latency_us=80.0, bandwidth_GBps=2.0),
    inter_node=Link(latency_us=80.0, bandwidth_GBps=2.0),
    compute_efficiency=0.6,
    kernel_overhead_us=10.0,
)

BUILTIN_PROFILES: dict[str, HardwareProfile] = {p.name: p for p in (_H100, _H200, _A100, _CPU_GLOO)}


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """A built-in profile by name, or a profile saved with ``HardwareProfile.to_json``,
    pricing float32 matmuls as torch's current ``float32_matmul_precision`` runs them."""
    key = str(name_or_path)
    if key in BUILTIN_PROFILES:
        return for_matmul_precision(BUILTIN_PROFILES[key])
    path = Path(key)
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise ValueError(f"hardware profile file {key!r} does not exist")
        return for_matmul_precision(HardwareProfile.from_json(path))
    names = ", ".join(sorted(BUILTIN_PROFILES))
    raise ValueError(f"unknown hardware profile {key!r}: use one of {names} or a path to a .json profile")


def for_matmul_precision(profile: HardwareProfile, precision: str | None = None) -> HardwareProfile:
    """``profile`` with float32 matmuls at its TF32 rate where ``precision`` (default: torch's
    current setting) lets them use TF32, as "high" and "medium" do; else ``profile`` itself.

    The trainer keeps torch's default, "highest"; a run that sets another precision before
    planning gets plans priced as its matmuls will run.
    """
    precision = precision or torch.get_float32_matmul_precision()
    if precision == "highest" or TF32 not in profile.peak_tflops:
        return profile
    return replace(profile, peak_tflops={**profile.peak_tflops, "float32": profile.peak_tflops[TF32]})


# GPU names (as torch.cuda.get_device_name has them) -> their built-in profile.
_GPU_PROFILES = {"H100": "h100", "H200": "h200", "A100": "a100"}


def gpu_profile_name(device_name: str) -> str | None:
    """The built-in profile of the GPU called ``device_name``, or None where it has none."""
    # a whole word: a GH200 (Grace Hopper, 96 or 144 GB) is no H200
    return next((profile for gpu, profile in _GPU_PROFILES.items() if re.search(rf"\b{gpu}\b", device_name)), None)


def default_profile_name(device_type: str, fake_backend: bool, device_name: str = "") -> str:
    """The profile to price a plan with when the user names none: the GPU's own where a
    built-in one matches ``device_name`` (``torch.cuda.get_device_name``), else ``h100``."""
    # A fake-backend dry run plans for the real GPU cluster it stands in for.
    if fake_backend:
        return "h100"
    if device_type == "cuda":
        return gpu_profile_name(device_name) or "h100"
    if device_type == "cpu":
        return "cpu_gloo"
    raise ValueError(f"no default hardware profile for device type {device_type!r}; pass one explicitly")
