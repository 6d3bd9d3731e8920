"""``metrics.tensor_memory_step``: one step's peak of tensor memory on a CPU rank.

On a GPU ``torch.cuda.max_memory_allocated`` is the measurement the plan's
memory prediction is checked against. A CPU rank has no such counter, and its
resident set (what the console's ``memory`` shows there) holds the Python
interpreter, libraries and allocator slack besides tensors. This probe counts
tensors only, as the plan predicts them:

* at the step's start, every CPU tensor storage Python can reach (parameters,
  their DTensor shards, gradients, optimizer state, the batch, graph
  constants), each storage once;
* during the step, every allocation and free made through torch's CPU
  allocator, from the profiler's memory events (``profile_memory``): the
  running total of what the step allocated and has not freed, replayed by
  address, has its maximum at the step's peak above that start. Frees of
  storages made before the step are not reported by the profiler, so the
  peak counts them as still live: an upper bound by those bytes, which the
  log line names (a gradient of the previous step still held at the start,
  for instance).

The replay does not use the profiler's own running total: that total drops
a buffer only when the free is seen on a thread the profiler records, and a
collective's buffers are often freed on gloo's worker thread (its work
object holds the input and output until the worker lets go of it, after the
training thread's wait), outside any recorded op. Such a free is missing
from the events, and the profiler's total kept the buffer for the rest of
the step: which rank lost the race decided whether a 21 MiB packed gradient
bucket counted once or twice. The allocator cannot hand out an address that
is still live, so a new allocation at a recorded address ends the buffer
recorded there. A buffer whose free is missing and whose address is not
reused, but which no tensor holds at the step's end (gloo's copy of a
reduce-scatter's input, made inside the collective op), was freed unseen:
it ends at the first collective wait that finishes after it was made, when
the work that held it is done (or at its own op's end if no wait follows).

The profiler slows the measured step, so the probe runs on one step, and the
plan check's timings of that step are not comparable with the others.
"""

from __future__ import annotations

import bisect
import gc
import json
import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

logger = logging.getLogger("torchtitan_autoparallel")
GIB = 2**30
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_WAIT = "wait_tensor"  # a collective's wait (_c10d_functional::wait_tensor): its work is done


@dataclass(frozen=True)
class TensorMemory:
    step: int
    rank: int
    start_bytes: int  # CPU tensor storages live when the step began
    peak_bytes: int  # start_bytes plus the largest running total of the step's allocations
    end_bytes: int  # start_bytes plus the step's net allocations


def live_tensor_bytes() -> int:
    """Bytes of the distinct CPU storages of the tensors Python can reach now.

    Plain tensors and parameters only: a wrapper subclass (DTensor) holds its data in a
    plain local tensor, counted on its own, and the planner's fake tensors hold none.
    """
    return sum(live_storages().values())


def live_storages() -> dict[int, int]:
    """Address -> bytes of each distinct CPU storage of the tensors Python can reach now."""
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if type(obj) not in _PLAIN or obj.device.type != "cpu":
            continue
        try:
            storage = obj.untyped_storage()
            ptr = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # a storage freed or never allocated
            continue
        if ptr:
            seen[ptr] = max(seen.get(ptr, 0), storage.nbytes())
    return seen


def _allocation_totals(prof: profile, alive_at_end: set[int]) -> list[int]:
    """Bytes allocated in the profiled span and not yet freed, after each recorded
    allocation or free, in order (replayed by address: see the module docstring).
    ``alive_at_end``: the addresses of the storages tensors hold once the span ended."""
    events, waits = [], []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            f = node.extra_fields
            op_end = node.parent.end_time_ns if node.parent is not None else node.start_time_ns
            events.append((node.start_time_ns, f.ptr, f.alloc_size, op_end))
        elif _WAIT in node.name:
            waits.append(node.end_time_ns)
        stack.extend(node.children)
    events.sort()
    unseen = _frees_unseen(events, sorted(waits), alive_at_end)
    return replay_allocations(ptr_size for _, *ptr_size in sorted([*(e[:3] for e in events), *unseen]))


def _frees_unseen(events: list[tuple], waits: list[int], alive_at_end: set[int]) -> list[tuple[int, int, int]]:
    """A free event (time, address, -size) for each buffer the replay would leave live
    at the span's end though no tensor holds it then: at the first wait finishing
    after its allocation, else at the end of the op that made it."""
    last: dict[int, tuple] = {}  # address -> its latest event
    for event in events:
        last[event[1]] = event
    out = []
    for time_ns, ptr, size, op_end in last.values():
        if size > 0 and ptr not in alive_at_end:
            later = bisect.bisect_right(waits, time_ns)
            out.append((waits[later] if later < len(waits) else op_end, ptr, -size))
    return out


def replay_allocations(events: Iterable[tuple[int, int]]) -> list[int]:
    """The running total of live bytes after each ``(address, size)`` event (size < 0: a
    free). An allocation at a live address ends the buffer there (its free was not seen);
    a free of an address not allocated in the span (made before it) is ignored."""
    live: dict[int, int] = {}
    total, totals = 0, []
    for ptr, size in events:
        total -= live.pop(ptr, 0)
        if size > 0:
            live[ptr] = size
            total += size
        totals.append(total)
    return totals


class TensorMemoryProbe:
    """Call ``step(n)`` after training step ``n``; measures ``measured_step`` on a CPU rank
    and writes it to ``<dump_folder>/tensor_memory_rank<r>.json``."""

    def __init__(self, measured_step: int, first_step: int, rank: int, device: torch.device, dump_folder: str):
        self.measured_step = measured_step if device.type == "cpu" else 0
        if measured_step and device.type != "cpu":
            logger.warning("metrics.tensor_memory_step measures CPU ranks; a GPU's peak is in the memory column")
        self.first_step, self.rank = first_step, rank
        self.out = Path(dump_folder) / f"tensor_memory_rank{rank}.json"
        self.prof: profile | None = None
        self.start_bytes = 0
        self.result: TensorMemory | None = None

    def __enter__(self) -> TensorMemoryProbe:
        if self.measured_step == self.first_step:
            self._start()
        return self

    def __exit__(self, *exc) -> None:
        if self.prof is not None:  # stopped before the measured step finished
            self.prof.__exit__(None, None, None)
            self.prof = None

    def step(self, n: int) -> None:
        if self.measured_step and n == self.measured_step - 1:
            self._start()
        elif self.prof is not None and n == self.measured_step:
            self._finish()

    def _start(self) -> None:
        gc.collect()  # what the step starts with, not garbage of the step before
        self.start_bytes = live_tensor_bytes()
        self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.prof.__enter__()

    def _finish(self) -> None:
        assert self.prof is not None
        self.prof.__exit__(None, None, None)
        totals = _allocation_totals(self.prof, set(live_storages()))
        self.prof = None
        self.result = TensorMemory(
            step=self.measured_step,
            rank=self.rank,
            start_bytes=self.start_bytes,
            peak_bytes=self.start_bytes + max([0, *totals]),
            end_bytes=self.start_bytes + (totals[-1] if totals else 0),
        )
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(asdict(self.result)) + "\n")
        r = self.result
        logger.info(
            f"tensor memory of step {r.step}: peak {r.peak_bytes / GIB:.3f} GiB (start {r.start_bytes / GIB:.3f}, "
            f"end {r.end_bytes / GIB:.3f}; storages freed in the step but made before it count as live), "
            f"written to {self.out}"
        )
