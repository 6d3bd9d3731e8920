"""What the report, the diff and the figures share: loading, grouping, units, warnings."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from torchtitan_autoparallel.errors import UserError
from torchtitan_autoparallel.planner.cost.step_terms import plan_terms
from torchtitan_autoparallel.planner.plan.memory import OPTIMIZER_STATE_COPIES
from torchtitan_autoparallel.planner.plan.plan import Plan

GIB = 2**30
# A gather to this size on every device is where a plan starts to risk OOM on
# an 80 GB GPU that also holds weights, optimizer state and activations.
DEFAULT_WARN_GIB = 1.0
# Kinds whose result is the full (gathered or reduced) buffer on every rank.
MATERIALISING = ("all_gather", "all_reduce")

_LAYER = re.compile(r"^(.*?layers)\.(\d+)\.(.+)$")


def load_plan(path: str | Path) -> Plan:
    """``Plan.from_json`` with one-line errors for a missing or malformed file."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"plan file {str(path)!r} does not exist; accepted: a plan.json written by a planning run")
    try:
        return Plan.from_json(p)
    except (ValueError, TypeError, KeyError) as e:
        raise UserError(f"plan file {str(path)!r} is not a plan.json ({type(e).__name__}: {e})") from None


def predicted_step_us(plan: Plan) -> float:
    """Compute plus communication, less what overlapping them saves, plus host and optimizer time.

    Plans written before the host and optimizer terms count them as 0
    (``planner/cost/step_terms.py``).
    """

    return plan_terms(plan).total_us


def peak_activation_bytes(plan: Plan) -> float | None:
    """None for plans written before the estimate existed."""
    return plan.predicted.get("peak_activation_bytes_per_device")


# ---------------------------------------------------------------- layers


@dataclass
class Block:
    """A run of consecutive layers placed alike, or the parameters outside any layer."""

    name: str  # "layers.0-5", "layers.6" or "(not in a layer)"
    cells: list[tuple[str, str]]  # (short parameter name, placements joined)
    first_fqns: list[str]  # the full names of the run's first layer, cell by cell


def short_name(rest: str) -> str:
    """'attention.wq.weight' -> 'wq'; a bias or norm keeps its last two parts."""
    parts = rest.split(".")
    if parts[-1] == "weight" and len(parts) > 1:
        return parts[-2]
    return ".".join(parts[-2:])


def split_layer(fqn: str) -> tuple[str, int, str] | None:
    """'layers.3.attention.wq.weight' -> ('layers', 3, 'attention.wq.weight')."""
    m = _LAYER.match(fqn)
    return (m.group(1), int(m.group(2)), m.group(3)) if m else None


def group_blocks(parameters: dict[str, list[str]]) -> list[Block]:
    """Merge consecutive layers whose parameters are placed identically, as ``Plan.table`` does."""
    layers: dict[tuple[str, int], list[tuple[str, str, str]]] = {}
    others: list[tuple[str, str, str]] = []
    for fqn, ps in parameters.items():
        cell = "".join(ps)
        parts = split_layer(fqn)
        if parts is None:
            others.append((fqn.removesuffix(".weight"), cell, fqn))
        else:
            layers.setdefault(parts[:2], []).append((short_name(parts[2]), cell, fqn))
    blocks: list[Block] = []
    start = prev = None
    for key in sorted(layers):
        sig = [c[:2] for c in layers[key]]
        if prev is not None and prev[0] == key[0] and prev[1] == key[1] - 1 and blocks[-1].cells == sig:
            blocks[-1].name = f"{start[0]}.{start[1]}-{key[1]}"
        else:
            start = key
            blocks.append(Block(f"{key[0]}.{key[1]}", sig, [c[2] for c in layers[key]]))
        prev = key
    if others:
        blocks.append(Block("(not in a layer)", [c[:2] for c in others], [c[2] for c in others]))
    return blocks


# ---------------------------------------------------------------- warnings


@dataclass
class LargeBuffer:
    """A collective whose result, on every rank of its mesh dim, exceeds the threshold."""

    kind: str
    mesh_dim: str
    bytes: float
    count: int
    purpose: str

    def message(self, threshold_bytes: float) -> str:
        return (
            f"{self.kind} over {self.mesh_dim} ({self.purpose}) materialises {fmt_bytes(self.bytes)} "
            f"on every device, {self.count}x per step (threshold {fmt_bytes(threshold_bytes)})"
        )


def large_buffers(plan: Plan, threshold_bytes: float) -> list[LargeBuffer]:
    """Gathers and all-reduces whose per-device result is larger than ``threshold_bytes``, largest first."""
    found = [
        LargeBuffer(c.kind, c.mesh_dim, c.bytes, c.count, c.purpose)
        for c in plan.collectives
        if c.kind in MATERIALISING and c.bytes > threshold_bytes
    ]
    return sorted(found, key=lambda b: -b.bytes)



@dataclass
class MemoryFit:
    """What one device holds at the step's peak, against its memory. An estimate:
    the allocator's slack and the CUDA context come on top."""

    state_bytes: float  # parameters and AdamW's state
    # the planner's peak of what the step keeps live, gradients included
    # (planner/plan/memory.py; 0 where the plan lacks it)
    activation_bytes: float
    device_bytes: float
    # of activation_bytes: weights cast or gathered in the forward and kept for the backward
    weight_copy_bytes: float = 0.0
    shard_ranks: int = 1  # the mesh's data_parallel_shard size, over which weights gather

    @property
    def total_bytes(self) -> float:
        return self.state_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.device_bytes

    def summary(self) -> str:
        return (
            f"parameters and AdamW state {fmt_bytes(self.state_bytes)} + the step's peak (activations "
            f"and gradients) {fmt_bytes(self.activation_bytes)} = {fmt_bytes(self.total_bytes)} per device "
            f"(estimate), of {fmt_bytes(self.device_bytes)}"
        )

    def message(self) -> str:
        kept_weights = 2 * self.weight_copy_bytes > self.activation_bytes and self.shard_ranks > 1
        if self.activation_bytes > self.state_bytes and kept_weights:
            # Measured on LLaMA3-405B at 2048 ranks: FSDP 256 x TP 8 keeps 94 GiB of weight
            # copies (a re-gather over 256 ranks prices dearer); HSDP 16 x 16 x TP 8 fits.
            advice = (
                f"most of the step's peak is weights kept for the backward ({fmt_bytes(self.weight_copy_bytes)}): "
                f"the plan finds gathering them again over {self.shard_ranks} shard ranks dearer than keeping "
                "them; shrink the shard group with HSDP (parallelism.data_parallel_replicate_degree > 1)"
            )
        elif self.activation_bytes > self.state_bytes:  # more devices would barely help
            advice = (
                "the step's peak is most of it: lower training.local_batch_size "
                "(training.global_batch_size keeps the batch by accumulating gradients) or "
                "training.seq_len, or recompute with activation_checkpoint.mode = \"full\""
            )
        else:
            advice = (
                "shard parameters over more mesh dims (parallelism.data_parallel_shard_degree, "
                "tensor_parallel_degree) or lower autoparallel.memory_budget_gib"
            )
        return f"{self.summary()}: more than the device holds; {advice}"


def peak_summary(plan: Plan, parts: int = 3) -> str | None:
    """The largest groups of tensors live at the predicted peak, on one line (None for
    plans written before the planner listed them)."""
    if not plan.peak_contents:
        return None
    shown = "; ".join(
        f"{fmt_bytes(c['bytes'])} in {c['count']} x {c['what']}" for c in plan.peak_contents[:parts]
    )
    return f"at the step's peak ({plan.peak_at}): {shown}"


def state_bytes(plan: Plan) -> float:
    """Parameters and AdamW's state, per device."""
    return plan.param_bytes_per_device * (1 + OPTIMIZER_STATE_COPIES)


def predicted_peak_bytes(plan: Plan) -> float | None:
    """The plan's whole per-device peak: parameters and AdamW state plus the step's peak of
    activations and gradients; None for plans written before the activation estimate."""
    if "peak_bytes_per_device" in plan.predicted:
        return plan.predicted["peak_bytes_per_device"]
    activations = peak_activation_bytes(plan)
    return None if activations is None else state_bytes(plan) + activations


def memory_fit(plan: Plan) -> MemoryFit | None:
    """None when the plan names no device memory (CPU ranks, older plans)."""
    if not plan.device_memory_bytes:
        return None
    state = state_bytes(plan)
    sizes = dict(zip(plan.mesh["names"], plan.mesh["sizes"]))
    return MemoryFit(
        state,
        peak_activation_bytes(plan) or 0.0,
        float(plan.device_memory_bytes),
        plan.predicted.get("peak_weight_copy_bytes_per_device", 0.0),
        sizes.get("dp_shard", 1),
    )


def plan_warnings(plan: Plan, threshold_bytes: float) -> list[str]:
    """Every warning the plan earns, one line each: the large gathers, then the memory fit."""
    found = [big.message(threshold_bytes) for big in large_buffers(plan, threshold_bytes)]
    fit = memory_fit(plan)
    if fit is not None and not fit.fits:
        found.append(fit.message())
    return found


# ---------------------------------------------------------------- units and colours


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


@dataclass(frozen=True)
class TimeUnit:
    """The one unit a table's times are shown in, named in its header."""

    name: str  # "ms" or "s"
    us: float  # microseconds in one

    def __call__(self, us: float) -> str:
        return f"{us / self.us:.3f}"


MS = TimeUnit("ms", 1e3)
SECONDS = TimeUnit("s", 1e6)


def time_unit(values_us) -> TimeUnit:
    """Seconds when the table's largest time is a second or more, else milliseconds."""
    largest = max((abs(v) for v in values_us), default=0.0)
    return SECONDS if largest >= 1e6 else MS


# Distinguishable on white and legible with black text; more placements than
# colours wrap around (a plan rarely has more than a handful).
PALETTE = (
    (141, 211, 199), (255, 255, 179), (190, 186, 218), (251, 128, 114), (128, 177, 211),
    (253, 180, 98), (179, 222, 105), (252, 205, 229), (217, 217, 217), (188, 128, 189),
    (204, 235, 197), (255, 237, 111),
)


def placement_colors(plan: Plan) -> dict[str, tuple[int, int, int]]:
    """One colour per distinct placement string, in sorted order so two plans agree where they can."""
    labels = sorted({"".join(ps) for ps in plan.parameters.values()})
    return {lab: PALETTE[i % len(PALETTE)] for i, lab in enumerate(labels)}
