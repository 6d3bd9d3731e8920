"""Per-step metrics: the console line, ``metrics.jsonl``, TensorBoard and Weights & Biases.

tps is tokens per second per device; tflops and mfu use the model's FLOPs per
token (6N plus attention, from torchtitan) against the device's peak.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger("torchtitan_autoparallel")

# Dense peak TFLOPs per GPU (datasheets). fp32 matmuls run on the FP32 cores at torch's
# default float32_matmul_precision ("highest", which the trainer keeps) and on TF32
# tensor cores ("tf32") where the precision allows.
GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bfloat16": 989.0, "tf32": 494.0, "float32": 67.0},
    "H100": {"bfloat16": 989.0, "tf32": 494.0, "float32": 67.0},
    "A100": {"bfloat16": 312.0, "tf32": 156.0, "float32": 19.5},
    "L40S": {"bfloat16": 362.0, "tf32": 183.0, "float32": 91.6},
    "A10G": {"bfloat16": 70.0, "tf32": 35.0, "float32": 31.2},
}


@dataclass(frozen=True)
class Peak:
    tflops: float
    source: str  # how it was obtained, for the log


def measure_cpu_peak_tflops(windows: int = 5, n: int = 1024) -> float:
    """Best fp32 matmul throughput of this process over a few short windows.

    The best window, not the mean: ranks start at the same time and share the
    cores, and a peak measured during that contention would overstate MFU.
    """
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)  # warm-up: the first call pays for the thread pool's start
    best = 0.0
    for _ in range(windows):
        start = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * n**3 / (time.perf_counter() - start) / 1e12)
    return best


def resolve_peak(configured: float | None, device: torch.device, dtype: str) -> Peak:
    if configured is not None:
        return Peak(configured, "[metrics] peak_tflops")
    if device.type == "cuda":
        if dtype == "float32" and torch.get_float32_matmul_precision() != "highest":
            dtype = "tf32"
        name = torch.cuda.get_device_name(device)
        for key, table in GPU_PEAK_TFLOPS.items():
            if key in name:
                return Peak(table[dtype], f"datasheet {dtype} peak of {key}")
        return Peak(GPU_PEAK_TFLOPS["A100"][dtype], f"unknown GPU {name!r}: assumed A100")
    return Peak(measure_cpu_peak_tflops(), "measured by a start-up fp32 matmul benchmark")


def memory_gib(device: torch.device) -> tuple[float, float]:
    """(peak memory in GiB, percent of the device's capacity)."""
    if device.type == "cuda":
        used = torch.cuda.max_memory_allocated(device)
        total = torch.cuda.get_device_properties(device).total_memory
    else:  # peak resident set of this process against the machine's RAM
        used = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return used / 2**30, 100.0 * used / total


def json_line(record: dict) -> str:
    """``record`` as one line of strict JSON: json.dumps writes NaN and inf as bare
    ``NaN``/``Infinity``, which JSON has not (strict readers, jq, JavaScript refuse the
    line), so a value that is not finite (a diverged loss) is written as null."""
    finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    return json.dumps(finite, allow_nan=False) + "\n"


class MetricsLogger:
    """Writes one record per logged step; only the logging rank writes files."""

    def __init__(
        self,
        dump_folder: str,
        *,
        flops_per_token: float,
        peak: Peak,
        world_size: int,
        device: torch.device,
        writes: bool,
        tensorboard_folder: str | None,
        wandb_run=None,  # a started wandb run (``wandb_log.start_run``), on the writing rank
    ) -> None:
        self.flops_per_token = flops_per_token
        self.peak = peak
        self.world_size = world_size
        self.device = device
        self.writes = writes
        self.jsonl = None
        self.tb = None
        self.wandb = wandb_run
        if writes:
            Path(dump_folder).mkdir(parents=True, exist_ok=True)
            self.jsonl = open(Path(dump_folder) / "metrics.jsonl", "a", buffering=1)
            if tensorboard_folder:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(tensorboard_folder)
        self._tokens = 0
        self._last = self._step_start = time.perf_counter()
        self.plan_check = None  # train/plan_check.PlanCheck of a planned run
        self._logged_step = 0

    def attach_plan(self, plan, micro_batches: int = 1) -> None:
        """Log the plan's predicted step time beside the measured one; put the plan in TensorBoard.

        ``micro_batches``: planned steps per optimizer step (gradient accumulation).
        """
        from torchtitan_autoparallel.train.plan_check import PlanCheck, write_plan_to_tensorboard

        self.plan_check = PlanCheck.of(plan, micro_batches)
        if self.tb is not None:
            write_plan_to_tensorboard(self.tb, plan, micro_batches)
        self._step_start = time.perf_counter()

    def use_compiled_graph(self, cost, profile) -> None:
        """Reprice the prediction from the compiled step's graph (``execute.graph_cost.GraphCost``).

        Called during the step that compiles; TensorBoard gets the repriced terms at that step.
        """
        if self.plan_check is None:
            return
        from torchtitan_autoparallel.train.plan_check import write_graph_terms_to_tensorboard

        self.plan_check.use_graph(cost, profile)
        logger.info(f"plan check: predicted step repriced from the compiled graph: {self.plan_check.terms_text()}")
        if self.tb is not None:
            write_graph_terms_to_tensorboard(self.tb, self.plan_check, self._logged_step + 1)

    def add_tokens(self, global_tokens: int) -> None:
        """Called once per step, after it: also times the step for the plan check."""
        self._tokens += global_tokens
        if self.plan_check is not None:
            if self.device.type == "cuda":  # the step's kernels are queued, not done
                torch.cuda.synchronize(self.device)
            now = time.perf_counter()
            self.plan_check.add_step(now - self._step_start)
            self._step_start = now

    def log(self, step: int, loss: float, grad_norm: float, lr: float) -> dict:
        now = time.perf_counter()
        elapsed, self._last = now - self._last, now
        tps = self._tokens / max(elapsed, 1e-9) / self.world_size
        self._tokens = 0
        tflops = self.flops_per_token * tps / 1e12
        mem, mem_pct = memory_gib(self.device)
        record = {
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            "tps": tps,
            "tflops": tflops,
            "mfu": 100.0 * tflops / self.peak.tflops,
            "memory_gib": mem,
            "memory_pct": mem_pct,
            "lr": lr,
            "step_time_s": elapsed,
            "time": time.time(),  # wall clock, so start-up time can be read off the first record
        }
        plan_note = ""
        if self.plan_check is not None:
            record.update(self.plan_check.fields())
            plan_note = self.plan_check.step_note()
        self._logged_step = step
        logger.info(
            f"step: {step:2d}  loss: {loss:7.4f}  grad_norm: {grad_norm:7.4f}  "
            f"memory: {mem:5.2f}GiB({mem_pct:.2f}%)  tps: {tps:,.0f}  "
            f"tflops: {tflops:,.3f}  mfu: {record['mfu']:.2f}%{plan_note}"
        )
        if self.jsonl is not None:
            self.jsonl.write(json_line(record))
        scalars = {f"train/{k}": v for k, v in record.items() if k not in ("step", "time")}
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(key, value, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)
        return record

    def log_validation(self, result) -> None:
        """Log a ``validate.ValidationResult``; its time is kept out of the step timings."""
        self._last += result.seconds
        self._step_start += result.seconds
        logger.info(
            f"validate step: {result.step:2d}  loss: {result.loss:7.4f}  "
            f"({result.batches} batch(es), {result.seconds:.2f} s)"
        )
        record = {
            "step": result.step,
            "validation_loss": result.loss,
            "validation_batches": result.batches,
            "validation_s": result.seconds,
            "time": time.time(),
        }
        if self.jsonl is not None:
            self.jsonl.write(json_line(record))
        if self.tb is not None:
            self.tb.add_scalar("validation/loss", result.loss, result.step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log({"validation/loss": result.loss}, step=result.step)

    def close(self) -> None:
        if self.plan_check is not None and self.writes:
            from torchtitan_autoparallel.train.plan_check import write_summary_to_tensorboard

            logger.info(self.plan_check.summary())
            if self.tb is not None:
                write_summary_to_tensorboard(self.tb, self.plan_check, self._logged_step)
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
