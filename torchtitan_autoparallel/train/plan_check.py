"""The plan's predicted step time next to the measured one, and the plan in TensorBoard.

``MetricsLogger`` owns one ``PlanCheck`` when the run trains a planned
(automatic) model. The measured step time is the median wall time of the
steps after the first ``WARMUP_STEPS`` (which pay for lazy initialisation,
the allocator's growth, the compile of the step and, on GPU, kernel
autotuning), so the ratio compares the cost model with the steady state it
models. The median, not the mean: on a shared machine a single step slowed
by other work (seconds, against a step of hundreds of ms) would move a mean
of a dozen steps by tens of percent.

The prediction starts as the plan's (``planner/cost/step_terms.py``: compute,
communication, host time per node, optimizer). Once the step is compiled,
``use_graph`` reprices the communication and the host time from the graph
the executor runs (bucketed collectives, its own node count), so the
prediction prices the program that is measured. With gradient accumulation
an optimizer step runs the planned step once per micro-batch: everything but
the optimizer's time counts that many times.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace

from torchtitan_autoparallel.planner.cost.step_terms import StepTerms, alloc_us, host_us, plan_terms
from torchtitan_autoparallel.planner.plan.plan import Plan
from torchtitan_autoparallel.report.common import peak_activation_bytes
from torchtitan_autoparallel.report.figures import plan_image
from torchtitan_autoparallel.report.text import words_text

WARMUP_STEPS = 2
# A measured step this far from the prediction, either way, points at the cost profile's
# rates rather than at the plan's shape: the summary then names the calibrator.
HINT_FACTOR = 2.0
CALIBRATE_HINT = ("the cost profile's rates may not be this machine's; `CALIBRATE=1 NGPU=<ranks> ./run_train.sh "
                  "--out profile.json` measures them, `--autoparallel.cost_profile profile.json` uses them")
# StepTerms field -> metrics key stem (predicted_<stem>_s)
_TERM_KEYS = {"compute_us": "compute", "comm_us": "comm", "overlap_savings_us": "overlap",
              "host_us": "host", "optimizer_us": "optimizer", "alloc_us": "alloc"}


def step_us(terms: StepTerms, micro_batches: int) -> float:
    """An optimizer step: the planned step once per micro-batch, then the optimizer once."""
    return (terms.total_us - terms.optimizer_us) * micro_batches + terms.optimizer_us


@dataclass
class PlanCheck:
    terms: StepTerms
    micro_batches: int = 1  # planned steps per optimizer step (gradient accumulation)
    source: str = "plan"  # or "compiled graph", once use_graph ran
    step_seconds: list[float] = field(default_factory=list)  # wall time of each step, step 1 first

    @classmethod
    def of(cls, plan: Plan, micro_batches: int = 1) -> PlanCheck:
        return cls(plan_terms(plan), micro_batches)

    @property
    def predicted_step_s(self) -> float:
        return step_us(self.terms, self.micro_batches) / 1e6

    def use_graph(self, cost, profile) -> None:
        """Price what the compiled step runs (an ``execute.graph_cost.GraphCost``) instead of the plan's estimate."""
        self.terms = replace(self.terms, comm_us=cost.comm_us, host_us=host_us(cost.nodes, profile),
                             alloc_us=alloc_us(cost.fresh_bytes, profile))
        self.source = "compiled graph"

    def add_step(self, seconds: float) -> None:
        self.step_seconds.append(seconds)

    def measured_step_s(self) -> float | None:
        """Median over the steady-state steps so far; None until there is one."""
        steady = self.step_seconds[WARMUP_STEPS:]
        return statistics.median(steady) if steady else None

    def fields(self) -> dict[str, float]:
        """What each metrics record gains: the prediction and its terms, and the measurement once steady."""
        out = {"predicted_step_s": self.predicted_step_s}
        if self.micro_batches > 1:
            out["micro_batches"] = self.micro_batches
        out.update({f"predicted_{stem}_s": getattr(self.terms, k) / 1e6 for k, stem in _TERM_KEYS.items()})
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

    def terms_text(self) -> str:
        t = self.terms
        overlap = f" - overlap {t.overlap_savings_us / 1e3:.1f}" if t.overlap_savings_us else ""
        planned = (f"compute {t.compute_us / 1e3:.1f} + comm {t.comm_us / 1e3:.1f}{overlap} + host {t.host_us / 1e3:.1f} "
                   f"+ fresh memory {t.alloc_us / 1e3:.1f}")
        if self.micro_batches > 1:
            planned = f"{self.micro_batches} micro-batches x ({planned})"
        return f"{planned} + optimizer {t.optimizer_us / 1e3:.1f} ms, from the {self.source}"

    def summary(self) -> str:
        measured = self.measured_step_s()
        predicted = f"plan check: predicted {self.predicted_step_s * 1e3:.3f} ms/step ({self.terms_text()})"
        if measured is None:
            return (
                f"{predicted}; measured: none, {len(self.step_seconds)} step(s) leave no steady state "
                f"(the first {WARMUP_STEPS} are warm-up)"
            )
        n = len(self.step_seconds) - WARMUP_STEPS
        f = self.fields()
        ratio = f["measured_over_predicted"]
        hint = "" if 1 / HINT_FACTOR <= ratio <= HINT_FACTOR else f"; {CALIBRATE_HINT}"
        return (
            f"{predicted}, measured {measured * 1e3:.3f} ms/step "
            f"(median of steps {WARMUP_STEPS + 1}-{WARMUP_STEPS + n}), measured/predicted {ratio:.2f}{hint}"
        )


def _term_scalars(terms: StepTerms, micro_batches: int) -> dict[str, float]:
    return {
        "plan/predicted_compute_ms": terms.compute_us / 1e3,
        "plan/predicted_comm_ms": terms.comm_us / 1e3,
        "plan/predicted_overlap_ms": terms.overlap_savings_us / 1e3,
        "plan/predicted_host_ms": terms.host_us / 1e3,
        "plan/predicted_optimizer_ms": terms.optimizer_us / 1e3,
        "plan/predicted_alloc_ms": terms.alloc_us / 1e3,
        "plan/predicted_step_ms": step_us(terms, micro_batches) / 1e3,
    }


def write_plan_to_tensorboard(tb, plan: Plan, micro_batches: int) -> None:
    """Plan scalars (ms, at step 0), the plan in words and its table as text, and the plan figure."""
    scalars = _term_scalars(plan_terms(plan), micro_batches)
    scalars["plan/param_gib_per_device"] = plan.predicted["param_bytes_per_device"] / 2**30
    peak = peak_activation_bytes(plan)
    if peak is not None:
        scalars["plan/peak_activation_gib_per_device"] = peak / 2**30
    for tag, value in scalars.items():
        tb.add_scalar(tag, value, 0)
    # Four leading spaces make TensorBoard's markdown keep the table's columns.
    text = f"{words_text(plan)}\n{plan.table()}"
    tb.add_text("plan/table", "\n".join("    " + line for line in text.splitlines()), 0)
    tb.add_image("plan/figure", plan_image(plan), 0, dataformats="HWC")
    tb.flush()


def write_graph_terms_to_tensorboard(tb, check: PlanCheck, step: int) -> None:
    """The prediction repriced from the compiled graph, at the step that compiled it."""
    for tag, value in _term_scalars(check.terms, check.micro_batches).items():
        tb.add_scalar(tag, value, step)
    tb.flush()


def write_summary_to_tensorboard(tb, check: PlanCheck, step: int) -> None:
    measured = check.measured_step_s()
    if measured is None:
        return
    tb.add_scalar("plan/measured_step_ms", measured * 1e3, step)
    tb.add_scalar("plan/measured_over_predicted", check.fields()["measured_over_predicted"], step)
    tb.flush()
