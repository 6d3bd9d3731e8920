"""Per-step metrics: the console line, ``metrics.jsonl``, TensorBoard and Weights & Biases.

tps is tokens per second per device; tflops and mfu use the model's FLOPs per
token (6N plus attention, from torchtitan) against a fixed peak (``resolve_peak``).
TensorBoard and W&B get torchtitan's tags for what torchtitan logs
(``TORCHTITAN_TAGS``) and ours, under ``train/``, for the rest.
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

from torchtitan_autoparallel.planner.cost.profiles import load_profile
from torchtitan_autoparallel.train.plan_check import (
    PlanCheck,
    write_graph_terms_to_tensorboard,
    write_plan_to_tensorboard,
    write_summary_to_tensorboard,
)

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


def resolve_peak(configured: float | None, device: torch.device, dtype: str, cost_profile: str = "auto") -> Peak:
    """The fixed peak MFU is measured against, never re-measured per run (a benchmark at
    start-up on a shared host read 0.02 to 0.1 TFLOP/s, so MFU swung past 100%):
    ``metrics.peak_tflops``; else the cost profile's (``autoparallel.cost_profile``, a
    calibrated .json or a built-in one); with ``auto``, a GPU's datasheet peak and on
    CPU the built-in ``cpu_gloo`` profile's."""
    if configured is not None:
        return Peak(configured, "[metrics] peak_tflops")
    if device.type == "cuda" and cost_profile == "auto":
        return _datasheet_peak(device, dtype)

    name = "cpu_gloo" if cost_profile == "auto" else cost_profile
    profile = load_profile(name)  # float32 at the TF32 rate where the matmul precision allows
    peak = profile.peak_tflops.get(dtype, profile.peak_tflops["float32"])
    if name.endswith(".json"):
        return Peak(peak, f"the {dtype} peak of the calibrated cost profile {name} (its measured matmul rate)")
    if device.type == "cpu":
        return Peak(peak, f"cost profile {name}'s built-in {dtype} peak, a fixed figure for a small CPU host, not "
                          "measured here; CALIBRATE=1 ./run_train.sh measures this host, --autoparallel.cost_profile FILE.json uses it")
    return Peak(peak, f"cost profile {name}'s {dtype} peak")


def _datasheet_peak(device: torch.device, dtype: str) -> Peak:
    if dtype == "float32" and torch.get_float32_matmul_precision() != "highest":
        dtype = "tf32"
    name = torch.cuda.get_device_name(device)
    for key, table in GPU_PEAK_TFLOPS.items():
        if key in name:
            return Peak(table[dtype], f"datasheet {dtype} peak of {key}")
    return Peak(GPU_PEAK_TFLOPS["A100"][dtype], f"unknown GPU {name!r}: assumed A100")


def memory_gib(device: torch.device) -> tuple[float, float]:
    """(peak memory in GiB, percent of the device's capacity)."""
    if device.type == "cuda":
        used = torch.cuda.max_memory_allocated(device)
        total = torch.cuda.get_device_properties(device).total_memory
    else:  # peak resident set of this process against the machine's RAM
        used = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return used / 2**30, 100.0 * used / total


def cuda_memory_scalars(device: torch.device) -> dict[str, float]:
    """torchtitan's memory tags (its DeviceMemoryMonitor's), since the start of the run."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    total = torch.cuda.get_device_properties(device).total_memory
    active, reserved = stats.get("active_bytes.all.peak", 0), stats.get("reserved_bytes.all.peak", 0)
    return {
        "memory/max_active(GiB)": active / 2**30,
        "memory/max_active(%)": 100.0 * active / total,
        "memory/max_reserved(GiB)": reserved / 2**30,
        "memory/max_reserved(%)": 100.0 * reserved / total,
        "memory/num_alloc_retries": stats.get("num_alloc_retries", 0),
        "memory/num_ooms": stats.get("num_ooms", 0),
    }


# metrics.jsonl's fields -> the tag torchtitan gives the same value in TensorBoard and
# W&B, so that a torchtitan user's dashboards read these runs; fields it does not log
# keep ours under train/
TORCHTITAN_TAGS = {
    "loss": "loss_metrics/global_avg_loss",
    "grad_norm": "grad_norm",
    "tps": "throughput(tps)",
    "tflops": "tflops",
    "mfu": "mfu(%)",
    "lr": "lr",
    "n_tokens_seen": "n_tokens_seen",
    "end_to_end_s": "time_metrics/end_to_end(s)",
}
NOT_SCALARS = ("step", "time")


def scalars_of(record: dict, device: torch.device) -> dict[str, float]:
    """The TensorBoard / W&B scalars of a step's record: torchtitan's tags, then ours."""
    scalars = {TORCHTITAN_TAGS[k]: v for k, v in record.items() if k in TORCHTITAN_TAGS}
    scalars.update(cuda_memory_scalars(device))
    scalars.update({f"train/{k}": v for k, v in record.items() if k not in TORCHTITAN_TAGS and k not in NOT_SCALARS})
    return scalars


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
        self._tokens_seen = 0  # all steps', all ranks' (torchtitan's n_tokens_seen)
        self._steps = 0  # since the last log
        self._last = self._step_start = time.perf_counter()
        self.plan_check = None  # train/plan_check.PlanCheck of a planned run
        self._logged_step = 0

    def attach_plan(self, plan, micro_batches: int = 1) -> None:
        """Log the plan's predicted step time beside the measured one; put the plan in TensorBoard.

        ``micro_batches``: planned steps per optimizer step (gradient accumulation).
        """

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

        self.plan_check.use_graph(cost, profile)
        logger.info(f"plan check: predicted step repriced from the compiled graph: {self.plan_check.terms_text()}")
        if self.tb is not None:
            write_graph_terms_to_tensorboard(self.tb, self.plan_check, self._logged_step + 1)

    def add_tokens(self, global_tokens: int) -> None:
        """Called once per step, after it: also times the step for the plan check."""
        self._tokens += global_tokens
        self._tokens_seen += global_tokens
        self._steps += 1
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
        steps, self._tokens, self._steps = max(self._steps, 1), 0, 0
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
            "n_tokens_seen": self._tokens_seen,
            "step_time_s": elapsed,  # since the last logged step (log_freq steps)
            "end_to_end_s": elapsed / steps,  # per step, as torchtitan's time_metrics/end_to_end(s)
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
        scalars = scalars_of(record, self.device)
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
            self.tb.add_scalar("validation_metrics/loss", result.loss, result.step)  # torchtitan's tag
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log({"validation_metrics/loss": result.loss}, step=result.step)

    def close(self) -> None:
        if self.plan_check is not None and self.writes:

            logger.info(self.plan_check.summary())
            if self.tb is not None:
                write_summary_to_tensorboard(self.tb, self.plan_check, self._logged_step)
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
