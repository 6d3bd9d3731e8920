"""Timings on the live process group: matmuls, copies and collectives per mesh dim.

Every rank runs every measurement at the same time (as training does: ranks
that share a machine compete for it), and each timing is the slowest rank's,
since a step waits for its slowest rank.

Where ranks share CPU cores (``Settings.context_matmul``), a collective is
timed as training meets it: right after a burst of compute (untimed).
Back-to-back collectives on idle cores wake each other's threads at once;
after compute, a rank's communication thread waits for a core, and that wait
(milliseconds per call on an oversubscribed machine) is part of every
collective of a real step.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torchtitan_autoparallel.calibrate.fit import CommSample, ComputeSample
from torchtitan_autoparallel.planner.cost_model import COLLECTIVES
from torchtitan_autoparallel.planner.profiles import PEAK_DTYPES

KIB, MIB = 2**10, 2**20
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Settings:
    matmul_sizes: tuple[int, ...]  # n of n x n @ n x n
    copy_bytes: tuple[int, ...]
    message_bytes: tuple[int, ...]  # per the cost model's convention, see CommSample
    repeats: int
    dtypes: tuple[str, ...] = PEAK_DTYPES
    collectives: tuple[str, ...] = COLLECTIVES
    # n of the n x n matmuls run before each timed collective (0: time collectives alone).
    context_matmul: int = 0
    context_calls: int = 10

    @property
    def steps(self) -> int:
        return len(self.dtypes) * len(self.matmul_sizes) + len(self.copy_bytes)


def default_settings(device_type: str) -> Settings:
    """Sizes where a GPU, or a few CPU cores, leave the latency-bound regime."""
    if device_type == "cuda":
        return Settings((1024, 4096, 8192), (1 * MIB, 64 * MIB, 512 * MIB), (64 * KIB, 4 * MIB, 64 * MIB, 256 * MIB), 10)
    # GPU collectives progress on the device, not on host cores: no compute context needed there.
    return Settings((64, 256, 512), (4 * KIB, 1 * MIB, 16 * MIB), (16 * KIB, 256 * KIB, 4 * MIB), 5, context_matmul=256)


class Progress:
    """One line per measurement on rank 0: ``[calibrate  7/40 ####------] what: time``."""

    def __init__(self, total: int, show: bool) -> None:
        self.total, self.done, self.show = total, 0, show

    def step(self, what: str, us: float) -> None:
        self.done += 1
        if self.show:
            filled = round(10 * self.done / self.total)
            bar = "#" * filled + "-" * (10 - filled)
            width = len(str(self.total))
            print(f"[calibrate {self.done:>{width}}/{self.total} {bar}] {what}: {us:,.1f} us", flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_us(
    fn: Callable[[], object], repeats: int, device: torch.device, before: Callable[[], object] | None = None
) -> float:
    """Median time of one call on the slowest rank, after a warm-up call.

    The median of single calls, not the mean: on a shared machine a few calls
    are slowed by others' work, and one outlier would skew every fit. With
    ``before`` (untimed, run before each call), the time is the fastest
    rank's: each rank's clock starts when its own ``before`` ends, so the
    ranks that finish it early also time their wait for the last one, and
    the last one times the call alone. That wait is skew between ranks,
    already paid in the slowest rank's compute time.
    """
    if before is not None:
        before()
    fn()
    _sync(device)
    dist.barrier()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
            _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    mine = torch.tensor([statistics.median(times) * 1e6], dtype=torch.float64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX if before is None else dist.ReduceOp.MIN)
    return float(mine.item())


def measure_compute(settings: Settings, device: torch.device, progress: Progress) -> list[ComputeSample]:
    samples = []
    for name in settings.dtypes:
        for n in settings.matmul_sizes:
            a = torch.randn(n, n, device=device).to(_DTYPES[name])
            b = torch.randn(n, n, device=device).to(_DTYPES[name])
            us = time_us(lambda: torch.mm(a, b), settings.repeats, device)
            samples.append(ComputeSample("matmul", name, 2.0 * n**3, 3.0 * n * n * a.element_size(), us))
            progress.step(f"matmul {name} {n}x{n}", us)
    for nbytes in settings.copy_bytes:
        src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
        dst = torch.empty_like(src)
        us = time_us(lambda: dst.copy_(src), settings.repeats, device)
        samples.append(ComputeSample("copy", "float32", 0.0, 2.0 * src.numel() * 4, us))
        progress.step(f"copy {nbytes / MIB:.3g} MiB", us)
    return samples


def _collective(kind: str, nbytes: int, n: int, group, device: torch.device) -> tuple[Callable[[], object], float]:
    """The call and the bytes the cost model charges it for (float32 buffers, sized to divide by n)."""
    full = max(n, nbytes // 4 // n * n)  # elements of the full buffer
    if kind == "all_gather":
        out, inp = torch.empty(full, device=device), torch.ones(full // n, device=device)
        return (lambda: dist.all_gather_single(out, inp, group=group)), full * 4.0
    if kind == "reduce_scatter":
        inp, out = torch.ones(full, device=device), torch.empty(full // n, device=device)
        return (lambda: dist.reduce_scatter_single(out, inp, group=group)), full * 4.0
    if kind == "all_reduce":
        buf = torch.ones(full, device=device)
        return (lambda: dist.all_reduce(buf, group=group)), full * 4.0
    inp, out = torch.ones(full, device=device), torch.empty(full, device=device)  # all_to_all: the local shard
    return (lambda: dist.all_to_all_single(out, inp, group=group)), full * 4.0


def measure_comm(
    mesh, settings: Settings, device: torch.device, progress: Progress, dims: tuple[int, ...] | None = None
) -> list[CommSample]:
    """Every collective at every size over every mesh dim of more than one rank (or over ``dims``)."""
    context = _context(settings, device)
    samples = []
    for dim, n in enumerate(mesh.mesh.shape):
        if n < 2 or (dims is not None and dim not in dims):
            continue
        group = mesh.get_group(dim)
        for kind in settings.collectives:
            for nbytes in settings.message_bytes:
                fn, charged = _collective(kind, nbytes, int(n), group, device)
                us = time_us(fn, settings.repeats, device, before=context)
                samples.append(CommSample(kind, dim, int(n), charged, us))
                progress.step(f"{kind} over {n} ranks{' after compute' if context else ''}, {charged / MIB:.3g} MiB", us)
    return samples


def _context(settings: Settings, device: torch.device) -> Callable[[], None] | None:
    if not settings.context_matmul:
        return None
    n = settings.context_matmul
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)

    def burst() -> None:
        for _ in range(settings.context_calls):
            torch.mm(a, b)

    return burst


def pair_dims(mesh_shape: tuple[int, ...], world_size: int, devices_per_node: int) -> bool:
    """Whether to also time groups of two ranks: one node, one mesh dim of more than two ranks.

    Timings at two group sizes separate the per-call cost from the per-hop
    latency (fit.py); a 2-D mesh already has them when its dims differ.
    """
    return len(mesh_shape) == 1 and world_size > 2 and world_size % 2 == 0 and world_size <= devices_per_node


def comm_steps(mesh_shape: tuple[int, ...], settings: Settings, pairs: bool = False) -> int:
    dims = sum(1 for n in mesh_shape if n > 1) + int(pairs)
    return dims * len(settings.collectives) * len(settings.message_bytes)


def intra_node_dims(mesh_shape: tuple[int, ...], devices_per_node: int) -> list[bool]:
    """Per mesh dim, whether it stays inside a node (the cost model's row-major layout)."""
    out, inner = [], 1
    for size in reversed(mesh_shape):
        inner *= size
        out.append(inner <= devices_per_node)
    return out[::-1]


def check_mesh_shape(shape: tuple[int, ...], world_size: int) -> None:
    from torchtitan_autoparallel.errors import UserError

    if not shape or any(s < 1 for s in shape) or math.prod(shape) != world_size:
        raise UserError(
            f"--mesh-shape {'x'.join(map(str, shape))} does not cover the {world_size} ranks launched; "
            f"accepted: sizes joined by 'x' whose product is {world_size}"
        )


def note(message: str, show: bool) -> None:
    if show:
        print(f"[calibrate] {message}", file=sys.stdout, flush=True)
