"""``[profiling]``: torch profiler traces and CUDA memory snapshots of chosen steps.

As torchtitan does: with ``enable_profiling`` every step that is a multiple of
``profile_freq`` is traced (after up to 3 warm-up steps that the profiler
discards) and written per rank to
``<dump_folder>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json``
(Chrome trace format: chrome://tracing or https://ui.perfetto.dev), with a
table of the busiest ops beside it (``rank<r>_ops.txt``) for a quick read
without a trace viewer. The planned step's collectives show in the trace as
the c10d ops that issue them (``c10d::allgather_into_tensor_coalesced_``,
``c10d::reduce_scatter_tensor_coalesced_``, ...), their waits as
``_c10d_functional::wait_tensor``, and on gloo as ``gloo:all_gather`` too.

``enable_memory_snapshot`` records the CUDA caching allocator's history and
dumps it at the same steps (``rank<r>_memory_snapshot.pickle``, for
https://pytorch.org/memory_viz). It needs CUDA: on CPU ranks it only warns.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from torchtitan_autoparallel.config import JobConfig

logger = logging.getLogger("torchtitan_autoparallel")

WARMUP_STEPS = 3  # profiled but discarded: the traced step is not the first one the profiler sees
_OPS_ROWS = 30
_MEMORY_HISTORY_ENTRIES = 100_000


class StepProfiler:
    """Call ``step(n)`` after training step ``n``; a no-op unless ``[profiling]`` asks for something."""

    def __init__(self, job: JobConfig, rank: int, device: torch.device, first_step: int) -> None:
        p = job.profiling
        self.freq = p.profile_freq
        self.rank = rank
        self.traces = Path(job.job.dump_folder) / p.save_traces_folder
        self.snapshots = Path(job.job.dump_folder) / p.save_memory_snapshot_folder
        self.first_step = first_step  # the step that runs first (a resumed run starts later)
        self.completed = first_step - 1
        self.prof = self._profiler(device) if p.enable_profiling else None
        self.memory = p.enable_memory_snapshot and device.type == "cuda"
        if p.enable_memory_snapshot and not self.memory:
            logger.warning("profiling.enable_memory_snapshot records CUDA memory: no effect on CPU ranks")

    def __enter__(self) -> StepProfiler:
        if self.prof is not None:
            self.prof.__enter__()
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=_MEMORY_HISTORY_ENTRIES)
        return self

    def __exit__(self, *exc) -> None:
        if self.prof is not None:
            self.prof.__exit__(*exc)
        if self.memory:
            torch.cuda.memory._record_memory_history(enabled=None)

    def step(self, step: int) -> None:
        self.completed = step
        if self.prof is not None:
            self.prof.step()
        if self.memory and step % self.freq == 0:
            path = self._iteration_folder(self.snapshots, step) / f"rank{self.rank}_memory_snapshot.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
            logger.info(f"memory snapshot of step {step} written to {path}")

    def _profiler(self, device: torch.device) -> torch.profiler.profile:
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        else:
            # Kineto's own log lines on a CPU-only machine: start/stop markers and a
            # spurious "gpuGetDeviceCount failed" ERROR each cycle. Read when it starts.
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        # each traced step is its own cycle, written out whole: nothing to accumulate
        warnings.filterwarnings("ignore", message="Warning: Profiler clears events at the end of each cycle")
        return torch.profiler.profile(
            activities=activities, schedule=self._action, on_trace_ready=self._write_trace, record_shapes=True
        )

    def _action(self, index: int) -> ProfilerAction:
        """What the profiler does in its ``index``-th step (0: the first this run trains)."""
        position = (self.first_step + index) % self.freq
        if position == 0:
            return ProfilerAction.RECORD_AND_SAVE
        if position >= self.freq - WARMUP_STEPS:
            return ProfilerAction.WARMUP
        return ProfilerAction.NONE

    def _write_trace(self, prof: torch.profiler.profile) -> None:
        step = self.completed
        if step % self.freq:  # the run ended in warm-up: torch hands over what it has; not a traced step
            return
        folder = self._iteration_folder(self.traces, step)
        start = time.perf_counter()
        trace = folder / f"rank{self.rank}_trace.json"
        prof.export_chrome_trace(str(trace))
        sort_by = "self_cuda_time_total" if ProfilerActivity.CUDA in prof.activities else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort_by, row_limit=_OPS_ROWS)
        (folder / f"rank{self.rank}_ops.txt").write_text(table + "\n")
        logger.info(f"profile of step {step} written to {trace} in {time.perf_counter() - start:.1f} s")

    @staticmethod
    def _iteration_folder(root: Path, step: int) -> Path:
        folder = root / f"iteration_{step}"
        folder.mkdir(parents=True, exist_ok=True)
        return folder
