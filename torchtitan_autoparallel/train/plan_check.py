"""The plan's predicted step time next to the measured one, and the plan in TensorBoard.

``MetricsLogger`` owns one ``PlanCheck`` when the run trains a planned
(automatic) model. The measured step time is the mean wall time of the steps
after the first ``WARMUP_STEPS`` (which pay for lazy initialisation, the
allocator's growth and, on GPU, kernel autotuning), so the ratio compares the
cost model with the steady state it models.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan_autoparallel.planner.plan import Plan
from torchtitan_autoparallel.report.common import predicted_step_us

WARMUP_STEPS = 2


@dataclass
class PlanCheck:
    predicted_step_s: float
    step_seconds: list[float] = field(default_factory=list)  # wall time of each step, step 1 first

    @classmethod
    def of(cls, plan: Plan) -> PlanCheck:
        return cls(predicted_step_us(plan) / 1e6)

    def add_step(self, seconds: float) -> None:
        self.step_seconds.append(seconds)

    def measured_step_s(self) -> float | None:
        """Mean over the steady-state steps so far; None until there is one."""
        steady = self.step_seconds[WARMUP_STEPS:]
        return sum(steady) / len(steady) if steady else None

    def fields(self) -> dict[str, float]:
        """What each metrics record gains: the prediction, and the measurement once steady."""
        out = {"predicted_step_s": self.predicted_step_s}
        measured = self.measured_step_s()
        if measured is not None:
            out["measured_step_s"] = measured
            out["measured_over_predicted"] = measured / self.predicted_step_s if self.predicted_step_s > 0 else float("inf")
        return out

    def step_note(self) -> str:
        """The console line's tail: steady-state step time against the plan's."""
        measured = self.measured_step_s()
        shown = "warm-up" if measured is None else f"{measured * 1e3:.1f}ms"
        return f"  step_time: {shown} (plan {self.predicted_step_s * 1e3:.1f}ms)"

    def summary(self) -> str:
        measured = self.measured_step_s()
        if measured is None:
            return (
                f"plan check: predicted {self.predicted_step_s * 1e3:.3f} ms/step; measured: none, "
                f"{len(self.step_seconds)} step(s) leave no steady state (the first {WARMUP_STEPS} are warm-up)"
            )
        n = len(self.step_seconds) - WARMUP_STEPS
        f = self.fields()
        return (
            f"plan check: predicted {self.predicted_step_s * 1e3:.3f} ms/step, measured {measured * 1e3:.3f} ms/step "
            f"(mean of steps {WARMUP_STEPS + 1}-{WARMUP_STEPS + n}), measured/predicted {f['measured_over_predicted']:.2f}"
        )


def write_plan_to_tensorboard(tb, plan: Plan) -> None:
    """Plan scalars (ms, at step 0), the plan table as text and the plan figure."""
    from torchtitan_autoparallel.report.common import peak_activation_bytes
    from torchtitan_autoparallel.report.figures import plan_image

    p = plan.predicted
    scalars = {
        "plan/predicted_compute_ms": p["compute_us"] / 1e3,
        "plan/predicted_comm_ms": p["comm_us"] / 1e3,
        "plan/predicted_overlap_ms": p.get("overlap_savings_us", 0.0) / 1e3,
        "plan/predicted_step_ms": predicted_step_us(plan) / 1e3,
        "plan/param_gib_per_device": p["param_bytes_per_device"] / 2**30,
    }
    peak = peak_activation_bytes(plan)
    if peak is not None:
        scalars["plan/peak_activation_gib_per_device"] = peak / 2**30
    for tag, value in scalars.items():
        tb.add_scalar(tag, value, 0)
    # Four leading spaces make TensorBoard's markdown keep the table's columns.
    tb.add_text("plan/table", "\n".join("    " + line for line in plan.table().splitlines()), 0)
    tb.add_image("plan/figure", plan_image(plan), 0, dataformats="HWC")
    tb.flush()


def write_summary_to_tensorboard(tb, check: PlanCheck, step: int) -> None:
    measured = check.measured_step_s()
    if measured is None:
        return
    tb.add_scalar("plan/measured_step_ms", measured * 1e3, step)
    tb.add_scalar("plan/measured_over_predicted", check.fields()["measured_over_predicted"], step)
    tb.flush()
