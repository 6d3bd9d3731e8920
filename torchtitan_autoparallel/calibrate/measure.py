"""Timings on the live process group: matmuls, copies and collectives per mesh dim.

Every rank runs every measurement at the same time (as training does: ranks
that share a machine compete for it), and each timing is the slowest rank's,
since a step waits for its slowest rank.

Where ranks share CPU cores (``Settings.context_matmul``), a collective is
timed as training meets it: right after a burst of compute, with the ranks
kept in step only by the collectives themselves (``time_after_compute_us``).
Back-to-back collectives on idle cores wake each other's threads at once;
after compute, a rank's communication thread waits for a core, and every
rank waits for the last one to finish its burst. On an oversubscribed machine
that wait is milliseconds per call (the OS runs four ranks on two cores in
turns, so equal bursts end at different times), and a real step pays it at
every collective: its compute is priced at the ranks' typical speed, not at
the slowest of them on each stretch between two collectives.
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
from torchtitan_autoparallel.errors import UserError
from torchtitan_autoparallel.planner.cost.cost_model import COLLECTIVES
from torchtitan_autoparallel.planner.cost.profiles import PEAK_DTYPES

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
    context_repeats: int = 20  # rounds of (burst, collective): the wait for the last rank is noisy
    # Shortest timed sample, in seconds, of compute and host timings (0: single calls); see time_us.
    window_s: float = 0.0

    @property
    def steps(self) -> int:
        return len(self.dtypes) * len(self.matmul_sizes) + len(self.copy_bytes)


def default_settings(device_type: str) -> Settings:
    """Sizes where a GPU, or a few CPU cores, leave the latency-bound regime."""
    if device_type == "cuda":
        # Batches of at least 5 ms: a step queues kernels back to back, while one call timed
        # alone adds the host's synchronise round trip (on an H100 single calls fitted 21.8 us
        # per kernel, batches 10.3; experiments/gpu).
        return Settings((1024, 4096, 8192), (1 * MIB, 64 * MIB, 512 * MIB), (64 * KIB, 4 * MIB, 64 * MIB, 256 * MIB), 10,
                        window_s=0.005)
    # GPU collectives progress on the device, not on host cores: no compute context needed there.
    return Settings((64, 256, 512), (4 * KIB, 1 * MIB, 16 * MIB), (16 * KIB, 256 * KIB, 4 * MIB), 5, context_matmul=256,
                    window_s=0.03)


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


def time_us(fn: Callable[[], object], repeats: int, device: torch.device, window_s: float = 0.0) -> float:
    """Median time of one call on the slowest rank, after a warm-up call.

    The median of single calls, not the mean: on a shared machine a few calls
    are slowed by others' work, and one outlier would skew every fit. With
    ``window_s``, each timed sample is a batch of calls lasting at least that
    long (divided by its size): where ranks outnumber cores the OS runs them
    in turns of a few ms, and a call shorter than a turn is timed either at a
    whole core's speed or stalled, while a step pays the shared rate; on a GPU
    the batch is queued as a step queues its kernels, with one synchronisation.
    The batch size is the ranks' largest, so calls that communicate stay matched.
    """
    fn()
    _sync(device)
    batch = _batch_size(fn, window_s, device) if window_s > 0 else 1
    dist.barrier()
    return _slowest(statistics.median(_call_times(fn, repeats, device, batch)), device)


def _batch_size(fn: Callable[[], object], window_s: float, device: torch.device) -> int:
    one = statistics.median(_call_times(fn, 3, device))
    mine = torch.tensor([math.ceil(window_s / max(one, 1e-7))], dtype=torch.float64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return int(min(mine.item(), 10_000))


def time_after_compute_us(
    fn: Callable[[], object], burst: Callable[[], object], repeats: int, device: torch.device
) -> float:
    """What a collective adds to a step: its time after a burst of compute, the wait for the last rank included.

    Each rank runs ``repeats`` rounds of (burst, untimed; collective, timed)
    with no barrier between them, as a step runs its stretches of compute
    between collectives. A round ends for every rank when the last rank's
    burst and the collective are done, so rank r times ``max(bursts) -
    burst_r + collective``. The compute term prices a burst at its typical
    length, so the step pays the round's mean over ranks of those times on
    top: the median over rounds of that mean is the sample. (The fastest
    rank's time, the collective alone, leaves out the wait, and steps of 35
    collectives measured ~50% above their prediction with it.)
    """
    burst()
    fn()
    _sync(device)
    dist.barrier()
    times = []
    for _ in range(repeats):
        burst()
        _sync(device)
        times.extend(_call_times(fn, 1, device))
    per_round = torch.tensor(times, dtype=torch.float64, device=device) * 1e6
    dist.all_reduce(per_round)  # summed over ranks, round by round
    return float(per_round.median().item()) / dist.get_world_size()


def _call_times(fn: Callable[[], object], repeats: int, device: torch.device, batch: int = 1) -> list[float]:
    """Seconds per call of ``repeats`` samples, each ``batch`` calls timed together."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(batch):
            fn()
        _sync(device)
        times.append((time.perf_counter() - start) / batch)
    return times


def _slowest(seconds: float, device: torch.device) -> float:
    """The largest of the ranks' ``seconds``, in microseconds: a step waits for its slowest rank."""
    mine = torch.tensor([seconds * 1e6], dtype=torch.float64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine.item())


def measure_compute(settings: Settings, device: torch.device, progress: Progress) -> list[ComputeSample]:
    samples = []
    for name in settings.dtypes:
        for n in settings.matmul_sizes:
            a = torch.randn(n, n, device=device).to(_DTYPES[name])
            b = torch.randn(n, n, device=device).to(_DTYPES[name])
            us = time_us(lambda: torch.mm(a, b), settings.repeats, device, settings.window_s)
            samples.append(ComputeSample("matmul", name, 2.0 * n**3, 3.0 * n * n * a.element_size(), us))
            progress.step(f"matmul {name} {n}x{n}", us)
    for nbytes in settings.copy_bytes:
        src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
        dst = torch.empty_like(src)
        us = time_us(lambda: dst.copy_(src), settings.repeats, device, settings.window_s)
        samples.append(ComputeSample("copy", "float32", 0.0, 2.0 * src.numel() * 4, us))
        progress.step(f"copy {nbytes / MIB:.3g} MiB", us)
    return samples


def device_memory_gib(device: torch.device) -> float | None:
    """One device's total memory in GiB, the smallest over the ranks; None where torch reports none (CPU).

    The smallest, as a plan must fit on every device; read here, since a base
    profile's figure is another GPU's (an H200 calibrated on the h100 profile
    kept H100's 80 GB).
    """
    if device.type != "cuda":
        return None
    mine = torch.tensor([torch.cuda.get_device_properties(device).total_memory / 2**30], dtype=torch.float64,
                        device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MIN)
    return float(mine.item())


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
                if context is None:
                    us = time_us(fn, settings.repeats, device)
                else:
                    us = time_after_compute_us(fn, context, settings.context_repeats, device)
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

    if not shape or any(s < 1 for s in shape) or math.prod(shape) != world_size:
        raise UserError(
            f"--mesh-shape {'x'.join(map(str, shape))} does not cover the {world_size} ranks launched; "
            f"accepted: sizes joined by 'x' whose product is {world_size}"
        )


def note(message: str, show: bool) -> None:
    if show:
        print(f"[calibrate] {message}", file=sys.stdout, flush=True)
