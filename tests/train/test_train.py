"""End-to-end training through ``./run_train.sh`` on CPU ranks (gloo), on the debug
models cut to two blocks (``--model.n_layers 2``) but for the default job.

* loss parity: every hand-written plan reproduces the 1-rank losses (and grad
  norms) at the same global batch, read at full precision from metrics.jsonl;
* activation checkpointing (full, selective) keeps FSDP's losses;
* gradient accumulation: two micro-batches a step give the same losses;
* determinism: two identical 1-rank runs log identical losses;
* checkpoint resume: a run stopped at step 2 and resumed continues exactly as
  an uninterrupted one;
* the default job's metrics.jsonl and TensorBoard events agree, and the loss falls.

The automatic plans have their own module, ``test_auto_parity.py``. Each
launch costs ~30-45 s of start-up here, so runs are shared between tests
through a module-scoped cache.
"""

from __future__ import annotations

import pytest
from _run import FEW_LAYERS, RUNS, RunCache, check_records, read_metrics, train

pytestmark = pytest.mark.multirank

GLOBAL_BATCH = 4
SEQ_LEN = 64
STEPS = 3
LOSS_REL = 1e-4
# The logged grad norm is torch's fp32 norm, whose CPU accumulation is itself
# off by ~1e-4 relative on a 0.5M-element tensor, and a sharded norm sums in
# another order (measured: lm_head.weight's norm differs by 9e-5 between one
# [2048, 256] tensor and two [1024, 256] shards of the same gradient, while the
# gradients agree to 1e-5). 1e-3 still catches any scaling mistake (x2, /2, sqrt 2).
GRAD_NORM_REL = 1e-3

# plan id -> (ngpu, extra overrides); data-parallel degree 2 in each, so local batch 2.
PLANS = {
    "ddp": (2, ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]),
    "fsdp": (2, []),
    "fsdp_tp": (4, ["--parallelism.tensor_parallel_degree", "2"]),
}
DP_DEGREE = {"ddp": 2, "fsdp": 2, "fsdp_tp": 2}
# The llama3 reference and FSDP runs go one step further: they double as the
# determinism check and as the uninterrupted run of the checkpoint test.
LONG_STEPS = 4


class Runs(RunCache):
    def reference(self, model: str) -> list[dict]:
        steps = LONG_STEPS if model == "llama3" else STEPS
        return self.get(f"{model}-ref", model=model, ngpu=1, steps=steps, seq_len=SEQ_LEN, local_batch_size=GLOBAL_BATCH)

    def plan(self, model: str, plan: str) -> list[dict]:
        ngpu, extra = PLANS[plan]
        steps = LONG_STEPS if (model, plan) == ("llama3", "fsdp") else STEPS
        return self.get(
            f"{model}-{plan}", *extra, model=model, ngpu=ngpu, steps=steps, seq_len=SEQ_LEN,
            local_batch_size=GLOBAL_BATCH // DP_DEGREE[plan],
        )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("train"), n_layers=FEW_LAYERS)


# qwen3's hand-written plans are torchtitan's own; its 2-D one stands for the rest.
@pytest.mark.parametrize("model,plan", [("llama3", p) for p in PLANS] + [("qwen3", "fsdp_tp")])
def test_loss_parity_with_one_rank(runs: Runs, model: str, plan: str) -> None:
    ref = runs.reference(model)
    got = runs.plan(model, plan)
    check_records(got, len(got))
    ref, got = ref[:STEPS], got[:STEPS]
    # The first loss is on untrained weights: initialisation must match too.
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=LOSS_REL)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in ref], rel=GRAD_NORM_REL)
    assert [r["lr"] for r in got] == pytest.approx([r["lr"] for r in ref], rel=1e-12)
    # ...and training moved the weights: the losses are not all the same.
    assert len({round(r["loss"], 6) for r in got}) == STEPS


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_the_losses(runs: Runs, mode: str) -> None:
    """torchtitan's block wrappers rename the parameters (``_checkpoint_wrapped_module``);
    the weights must still start as a 1-rank run's, and recomputing changes no value."""
    ref = runs.plan("llama3", "fsdp")[:STEPS]
    ngpu, extra = PLANS["fsdp"]
    got = runs.get(
        f"llama3-fsdp-ac-{mode}", *extra, "--activation_checkpoint.mode", mode, model="llama3", ngpu=ngpu,
        steps=STEPS, seq_len=SEQ_LEN, local_batch_size=GLOBAL_BATCH // DP_DEGREE["fsdp"],
    )
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-6)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in ref], rel=1e-6)


def test_gradient_accumulation_matches_one_rank(runs: Runs) -> None:
    """torchtitan's FSDP on 2 ranks, 1 sample per rank per micro-batch, 2 micro-batches a
    step: the 1-rank losses at the same global batch."""
    ref = runs.reference("llama3")[:STEPS]
    got = runs.get(
        "llama3-fsdp_accumulate", "--training.global_batch_size", str(GLOBAL_BATCH),
        model="llama3", ngpu=2, steps=STEPS, seq_len=SEQ_LEN, local_batch_size=1,
    )
    check_records(got, STEPS)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=LOSS_REL)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in ref], rel=GRAD_NORM_REL)
    assert len({round(r["loss"], 6) for r in got}) == STEPS


def test_determinism_two_identical_runs(runs: Runs) -> None:
    first = runs.reference("llama3")
    second = train(
        runs.root / "llama3-ref-again", model="llama3", ngpu=1, steps=LONG_STEPS, seq_len=SEQ_LEN,
        local_batch_size=GLOBAL_BATCH, n_layers=FEW_LAYERS,
    )
    check_records(second, LONG_STEPS)
    assert [r["loss"] for r in second] == [r["loss"] for r in first]
    assert [r["grad_norm"] for r in second] == [r["grad_norm"] for r in first]


def test_checkpoint_resume_continues_exactly(runs: Runs) -> None:
    uninterrupted = runs.plan("llama3", "fsdp")  # NGPU=2 FSDP, 4 steps
    dump = runs.root / "llama3-fsdp-resumed"
    ngpu, extra = PLANS["fsdp"]
    common = dict(model="llama3", ngpu=ngpu, seq_len=SEQ_LEN, local_batch_size=GLOBAL_BATCH // 2, n_layers=FEW_LAYERS)
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "2", "--checkpoint.folder", "checkpoint"]

    first = train(dump, *extra, *ckpt, steps=2, **common)
    assert [r["step"] for r in first] == [1, 2]
    step2 = dump / "checkpoint" / "step-2"
    assert (step2 / "train_state.json").is_file()
    assert any(step2.glob("*.distcp")), sorted(p.name for p in step2.iterdir())

    train(dump, *extra, *ckpt, steps=LONG_STEPS, **common)
    resumed_run = RUNS[-1]
    assert "resumed from checkpoint" in resumed_run.stdout + resumed_run.stderr, resumed_run.tail()
    records = read_metrics(dump)  # appended: steps 1-2 of the first run, then 3-4
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert (dump / "checkpoint" / "step-4" / "train_state.json").is_file()
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in uninterrupted], rel=1e-5)
    assert [r["grad_norm"] for r in records[2:]] == pytest.approx(
        [r["grad_norm"] for r in uninterrupted[2:]], rel=1e-5  # same mesh: same summation order
    )
    assert [r["lr"] for r in records[2:]] == pytest.approx([r["lr"] for r in uninterrupted[2:]], rel=1e-12)


def test_default_job_tensorboard_and_falling_loss(runs: Runs) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    dump = runs.root / "llama3-default"
    steps = 10
    # The shipped config as is (TensorBoard on, the cost profile's MFU peak, local batch 4),
    # only shorter: NGPU=2, seq_len 128, 10 steps.
    records = train(dump, model="llama3", ngpu=2, steps=steps, seq_len=128, local_batch_size=4,
                    tensorboard=None, fixed_peak=False)
    check_records(records, steps)
    assert all(0 < r["mfu"] for r in records)

    events = list((dump / "tb").rglob("events.out.tfevents.*"))
    assert events, f"no TensorBoard events under {dump / 'tb'}"
    acc = EventAccumulator(str(dump / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    # torchtitan's tags for what torchtitan logs, ours under train/ for the rest
    assert {"loss_metrics/global_avg_loss", "grad_norm", "throughput(tps)", "tflops", "mfu(%)", "train/memory_gib"} <= tags
    tb_loss = acc.Scalars("loss_metrics/global_avg_loss")
    assert [e.step for e in tb_loss] == list(range(1, steps + 1))
    # TensorBoard stores float32 scalars.
    assert [e.value for e in tb_loss] == pytest.approx([r["loss"] for r in records], rel=1e-6)
    assert [e.value for e in acc.Scalars("throughput(tps)")] == pytest.approx([r["tps"] for r in records], rel=1e-6)

    losses = [r["loss"] for r in records]
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses
