"""The planner's options: one frozen object, built once from the job and passed through.

Every stage reads what it needs from it, and the plan cache keys on it, so a
knob is declared here once instead of in each caller's keyword list.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from torchtitan_autoparallel.models.loss import cross_entropy_loss
from torchtitan_autoparallel.planner.cost.profiles import HardwareProfile
from torchtitan_autoparallel.planner.trace.trace import BatchSpec, LossFn

SolverName = Literal["ilp", "approx", "auto"]
IlpBackend = Literal["highs", "cbc"]
Recompute = Literal["none", "full", "selective", "auto"]

# Fields a solution does not depend on, left out of the plan cache's key.
_NOT_KEYED = ("export_problem", "loss_fn", "batch")


@dataclass(frozen=True, kw_only=True)
class PlannerOptions:
    """What to plan (batch, dtypes, cost profile) and how (solver, limits, modelling switches).

    ``solver``: ``ilp`` (exact, HiGHS or CBC per ``ilp_backend``), ``approx``
    (TRW-S and local search) or ``auto`` (picks by problem size). ``optimality_check`` adds the LP bound to the plan's
    ``lower_bound``; ``mip_gap`` stops the exact search once the plan is proven
    within that relative gap. ``memory_budget_gib`` bounds the whole predicted
    peak per device, and lets the solver keep weights replicated where it allows
    (None: every parameter sharded where it can be, and the peak bounded by
    ``device_memory_gib``, the device's memory, or the profile's when None, less
    ``api.FIT_RESERVE``; not bounded when neither is known).
    ``activation_checkpoint`` traces each transformer block recomputed in the
    backward ("auto": each block's mode chosen by the solve that fits the device:
    ``api.plan_fitting``); ``strided_sharding`` lets matmuls take the strided shards views
    produce; ``overlap`` credits gathers and reductions hidden behind compute.
    ``loss_fn`` and ``batch`` replace cross-entropy over a token batch for
    models that are not language models.
    """

    global_batch_size: int
    seq_len: int
    profile: HardwareProfile
    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    solver: SolverName = "ilp"
    ilp_backend: IlpBackend = "highs"
    time_limit_s: float | None = 300
    optimality_check: bool = False
    mip_gap: float | None = None
    memory_budget_gib: float | None = None
    export_problem: str | None = None
    activation_checkpoint: Recompute = "none"
    # each transformer block's mode, in place of activation_checkpoint's one for all
    # (the trace "auto" plans: api.plan_fitting)
    block_recompute: tuple[str, ...] | None = None
    device_memory_gib: float | None = None
    strided_sharding: bool = False
    overlap: bool = False
    loss_fn: LossFn = cross_entropy_loss
    batch: BatchSpec | None = None

    def __post_init__(self) -> None:
        for name, kind in (("solver", SolverName), ("ilp_backend", IlpBackend),
                           ("activation_checkpoint", Recompute)):
            value = getattr(self, name)
            if value not in get_args(kind):
                raise ValueError(f"planner option {name} = {value!r}; accepted: {', '.join(get_args(kind))}")
        for name in ("global_batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"planner option {name} = {getattr(self, name)}; accepted: a positive integer")

    def replace(self, **changes: Any) -> PlannerOptions:
        return dataclasses.replace(self, **changes)

    def cache_settings(self) -> dict[str, Any]:
        """The options a solution depends on, for the plan cache's key."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _NOT_KEYED}
