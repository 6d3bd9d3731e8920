"""The weights' first values: a 1-rank run's, whatever the mesh, in bounded memory.

A planned model's parameters are placed from full, unsharded values
(``execute.step.FullValues``), asked for once the plan is known:

* a model of at most ``training.full_init_max_gib`` of parameters is
  initialised whole on every rank's device, and each rank keeps its slices
  (nothing is sent);
* a larger one is initialised once, in rank 0's host memory, and each tensor is
  scattered from there in turn, so no other rank holds more than one full
  tensor at a time. Without this every rank would build the whole model: 282 GB
  each for LLaMA3-70B in fp32.

Either way the values are those of a 1-rank run on the device that initialised
them (the CPU's generator for the scattered path). Before building anything,
rank 0 checks that its host can hold what it is about to allocate, so a job
too large for the host fails with a one-line error instead of a rank killed
by the kernel's out-of-memory killer.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from torchtitan_autoparallel.errors import UserError
from torchtitan_autoparallel.execute.step import FullValues
from torchtitan_autoparallel.mesh.runtime import Runtime
from torchtitan_autoparallel.planner.plan.plan import Plan
from torchtitan_autoparallel.report.common import GIB, fmt_bytes, predicted_peak_bytes, state_bytes
from torchtitan_autoparallel.train.setup import init_full_model, param_bytes

logger = logging.getLogger("torchtitan_autoparallel")

class _MadeWhenAsked(Mapping):
    """``make`` of each of ``source``'s tensors, made when placement asks for it and
    not kept, so only the tensor being scattered is ever whole on the device."""

    def __init__(self, source: Mapping[str, torch.Tensor], make: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._source, self._make = source, make

    def __getitem__(self, fqn: str) -> torch.Tensor:
        return self._make(self._source[fqn])

    def __contains__(self, fqn: object) -> bool:  # Mapping's own would make the tensor to find out
        return fqn in self._source

    def __iter__(self) -> Iterator[str]:
        return iter(self._source)

    def __len__(self) -> int:
        return len(self._source)


def full_values(model_config, meta_model: nn.Module, seed: int, runtime: Runtime, whole: bool) -> FullValues:
    """The values to place: every rank's own whole model, or rank 0's scattered."""
    device = runtime.device
    if whole:
        return FullValues.of(init_full_model(model_config, seed, device))
    if runtime.rank == 0:
        source = init_full_model(model_config, seed, torch.device("cpu"))

        def make(host: torch.Tensor) -> torch.Tensor:
            return host.to(device)
    else:
        # Only shapes are needed (rank 0 sends the values), so the meta model's
        # tensors, buffers computed at init (RoPE's table) included, will do.
        source = meta_model

        def make(meta: torch.Tensor) -> torch.Tensor:
            return torch.empty(meta.shape, dtype=meta.dtype, device=device)

    params, buffers = dict(source.named_parameters()), dict(source.named_buffers())
    return FullValues(_MadeWhenAsked(params, make), _MadeWhenAsked(buffers, make), src_rank=0)


def planned_full_values(
    model_config, meta_model: nn.Module, seed: int, runtime: Runtime, max_whole_gib: float
) -> Callable[[Plan], FullValues]:
    """What ``plan_and_build`` asks for once the plan is known: the host check, then the values."""
    model_bytes = param_bytes(meta_model)
    whole = model_bytes <= max_whole_gib * GIB
    # rank 0 alone builds it while the other ranks wait in the first scatter: say so
    announce = runtime.rank == 0 and not whole

    def values(plan: Plan) -> FullValues:
        if runtime.rank == 0:
            check_host_memory(plan, runtime, model_bytes, whole)
        if announce:
            logger.info(
                f"initialising the {fmt_bytes(model_bytes)} model once in rank 0's host memory, then "
                f"scattering each tensor (more than training.full_init_max_gib = {max_whole_gib})"
            )
        start = time.perf_counter()
        out = full_values(model_config, meta_model, seed, runtime, whole)
        if announce:
            logger.info(f"model initialised in {time.perf_counter() - start:.1f} s; scattering")
        return out

    return values


def host_need_bytes(plan: Plan, runtime: Runtime, model_bytes: float, whole: bool, local_ranks: int) -> float:
    """What rank 0's host must hold at least: each CPU rank's share of the step as
    planned (parameters, AdamW state, the step's predicted peak), and the full model
    while it is placed (on every CPU rank when initialised whole, else once)."""
    on_cpu = runtime.device_type == "cpu"
    per_rank = predicted_peak_bytes(plan) or state_bytes(plan)
    step = local_ranks * per_rank if on_cpu else 0.0
    if whole:
        return step + (local_ranks * model_bytes if on_cpu else 0.0)
    return step + model_bytes


def check_host_memory(plan: Plan, runtime: Runtime, model_bytes: float, whole: bool) -> None:
    """Refuse, in one line, a job its host surely cannot hold (skipped where the
    host's free memory is unknown)."""
    available = available_host_bytes()
    if available is None:
        return
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    need = host_need_bytes(plan, runtime, model_bytes, whole, local_ranks)
    if need <= available:
        return
    where = f"its {local_ranks} CPU rank(s)" if runtime.device_type == "cpu" else "rank 0, to initialise it,"
    raise UserError(
        f"the {fmt_bytes(model_bytes)} model does not fit this host: {where} need at least "
        f"{fmt_bytes(need)} of memory as planned (parameters, AdamW state and the step's "
        f"estimated peak; the full model while it is placed), and {fmt_bytes(available)} is "
        "available (free on the host, or left under its container's limit); accepted: a smaller "
        "model.flavor, fewer ranks per host, or a host or container with more memory"
    )


# Where a container's memory limit is read (cgroup v2, then v1): its processes are
# killed at the limit, however much the host has free.
CGROUPS = (
    (Path("/sys/fs/cgroup"), "memory.max", "memory.current", "inactive_file"),
    (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
)
_NO_LIMIT = 2**60  # cgroup v1 writes "no limit" as a number near 2**63


def available_host_bytes(meminfo: Path = Path("/proc/meminfo"), cgroups=CGROUPS) -> float | None:
    """What new allocations can get without swapping: Linux's estimate for the host,
    or less where the job's container has a memory limit; None where neither is known."""
    found = [_meminfo_available(meminfo), *(_cgroup_available(*cgroup) for cgroup in cgroups)]
    known = [x for x in found if x is not None]
    return min(known) if known else None


def _meminfo_available(meminfo: Path) -> float | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024  # reported in kB
    except OSError:
        return None
    return None


def _cgroup_available(root: Path, limit_file: str, usage_file: str, inactive_key: str) -> float | None:
    """The limit less the working set: usage less the inactive page cache, which the
    kernel reclaims before it kills (the kubelet counts it the same way)."""
    try:
        limit = (root / limit_file).read_text().strip()
        if limit == "max" or int(limit) >= _NO_LIMIT:
            return None
        usage = int((root / usage_file).read_text())
        stat = dict(line.split()[:2] for line in (root / "memory.stat").read_text().splitlines() if " " in line)
        inactive = int(stat.get(inactive_key, 0))
    except (OSError, ValueError):
        return None
    return float(int(limit) - (usage - inactive))
