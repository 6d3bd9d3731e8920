"""Automatic plans train like one device: 5-step loss parity through ``./run_train.sh`` (gloo, fp32).

The debug models cut to two blocks (``--model.n_layers 2``). For llama3, the
planner's plan on 2 ranks DDP, 2 ranks FSDP, 2 ranks TP, 4 ranks FSDP 2 x TP 2,
4 ranks HSDP 2 x 2 and 8 ranks HSDP 2 x 2 x TP 2 (the trainer's 3-D mesh,
planned by the approximate solver), and for qwen3 on FSDP 2 x TP 2 and HSDP
2 x 2, logs the 1-rank losses at the same global batch within 1e-4 relative;
so does FSDP on 2 ranks accumulating gradients over two micro-batches. A
second start of the same job reuses the cached plan. Weights built once on
rank 0 and scattered give the same run, bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _run import CONFIGS, FEW_LAYERS, RunCache, check_records, read_metrics, run_launcher

pytestmark = pytest.mark.multirank

GLOBAL_BATCH = 4
SEQ_LEN = 64
STEPS = 5
LOSS_REL = 1e-4
GRAD_NORM_REL = 1e-3  # sharded fp32 norms sum in another order; see test_train.py

_DP_REPLICATE = "--parallelism.data_parallel_replicate_degree"
_DP_SHARD = "--parallelism.data_parallel_shard_degree"
_TP = "--parallelism.tensor_parallel_degree"
_LAYERS = ("--model.n_layers", str(FEW_LAYERS))

# plan -> (ranks, overrides, mesh sizes the plan must report)
PLANS = {
    "ddp": (2, [_DP_REPLICATE, "2", _DP_SHARD, "1"], [2]),
    "fsdp": (2, [], [2]),
    "tp": (2, [_DP_SHARD, "1", _TP, "2"], [2]),
    "fsdp_tp": (4, [_TP, "2"], [2, 2]),
    "hsdp": (4, [_DP_REPLICATE, "2", _DP_SHARD, "2"], [2, 2]),
    # The ILP takes about half a minute on this 3-D problem here, approx about a second;
    # its plan must run exactly like any other.
    "hsdp_tp": (8, [_DP_REPLICATE, "2", _DP_SHARD, "2", _TP, "2", "--autoparallel.solver", "approx"], [2, 2, 2]),
}
# qwen3 differs from llama3 in its blocks (qk norms, head layout), which the 2-D plans shard.
CASES = [("llama3", p) for p in PLANS] + [("qwen3", "fsdp_tp"), ("qwen3", "hsdp")]


class Runs(RunCache):
    def reference(self, model: str) -> list[dict]:
        return self.get(f"{model}-ref", model=model, ngpu=1, steps=STEPS, seq_len=SEQ_LEN,
                        local_batch_size=GLOBAL_BATCH)

    def auto(self, model: str, plan: str) -> list[dict]:
        ngpu, extra, mesh = PLANS[plan]
        dp = ngpu // (int(extra[extra.index(_TP) + 1]) if _TP in extra else 1)
        return self.get(
            f"{model}-auto_{plan}", "--model.name", f"{model}_auto_parallel", *extra,
            model=model, ngpu=ngpu, steps=STEPS, seq_len=SEQ_LEN, local_batch_size=GLOBAL_BATCH // dp,
        )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("auto"), n_layers=FEW_LAYERS)


@pytest.mark.parametrize("model,plan", CASES)
def test_auto_parallel_loss_parity_with_one_rank(runs: Runs, model: str, plan: str) -> None:
    ref = runs.reference(model)
    got = runs.auto(model, plan)
    check_records(got, STEPS)
    # The first loss is on untrained weights: the placed initialisation must match too.
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=LOSS_REL)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in ref], rel=GRAD_NORM_REL)
    assert len({round(r["loss"], 6) for r in got}) == STEPS  # the weights moved
    plan_json = json.loads((runs.root / f"{model}-auto_{plan}" / "plan.json").read_text())
    assert plan_json["replicated_ops"] == []
    assert plan_json["mesh"]["sizes"] == PLANS[plan][2]


def test_auto_parallel_gradient_accumulation_matches_one_rank(runs: Runs) -> None:
    """FSDP on 2 ranks, 1 sample per rank per micro-batch, 2 micro-batches a step: the
    1-rank losses at global batch 4 (the planned step runs on a quarter of it each time)."""
    ref = runs.reference("llama3")
    got = runs.get(
        "llama3-auto_fsdp_accumulate", "--model.name", "llama3_auto_parallel",
        "--training.global_batch_size", str(GLOBAL_BATCH),
        model="llama3", ngpu=2, steps=STEPS, seq_len=SEQ_LEN, local_batch_size=1,
    )
    check_records(got, STEPS)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=LOSS_REL)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in ref], rel=GRAD_NORM_REL)
    assert len({round(r["loss"], 6) for r in got}) == STEPS
    # the plan check prices two planned steps and one optimizer step
    assert all(r["micro_batches"] == 2 for r in got)
    for r in got:
        planned = (r["predicted_compute_s"] + r["predicted_comm_s"] - r["predicted_overlap_s"]
                   + r["predicted_host_s"] + r["predicted_alloc_s"])
        assert planned > 0
        assert r["predicted_step_s"] == pytest.approx(2 * planned + r["predicted_optimizer_s"], rel=1e-9)


def test_weights_scattered_from_rank0_train_bit_for_bit_alike(runs: Runs) -> None:
    """``training.full_init_max_gib = 0``: rank 0 alone builds the model (the path of
    models too large to build on every rank), and each tensor is scattered over the
    2 x 2 mesh; the plan and every logged number equal the run whose ranks each built it."""
    whole = runs.auto("llama3", "fsdp_tp")
    ngpu, extra, _ = PLANS["fsdp_tp"]
    folder = runs.root / "llama3-auto_fsdp_tp-scattered"
    run = run_launcher(
        ["--job.dump_folder", folder, "--model.name", "llama3_auto_parallel", *extra,
         "--training.full_init_max_gib", "0", "--training.steps", STEPS, "--training.seq_len", SEQ_LEN,
         "--training.local_batch_size", GLOBAL_BATCH // 2,
         "--metrics.enable_tensorboard", "false", "--metrics.peak_tflops", "1", *_LAYERS],
        ngpu=ngpu, config=CONFIGS["llama3"],
    )  # fmt: skip
    assert run.returncode == 0, run.tail()
    assert "once in rank 0's host memory, then scattering each tensor" in run.stdout + run.stderr, run.tail()
    plans = [json.loads((runs.root / name / "plan.json").read_text())["parameters"]
             for name in ("llama3-auto_fsdp_tp", folder.name)]  # fmt: skip
    assert plans[0] == plans[1]
    scattered = read_metrics(folder)
    assert [r["loss"] for r in scattered] == [r["loss"] for r in whole]
    assert [r["grad_norm"] for r in scattered] == [r["grad_norm"] for r in whole]


def test_auto_parallel_second_start_hits_the_plan_cache(runs: Runs) -> None:
    first = runs.auto("llama3", "fsdp")
    folder = runs.root / "llama3-auto_fsdp"
    assert list((folder / "plan_cache").glob("*.json")), "the first start stored no plan"
    run = _restart_fsdp(folder)
    assert "plan cache hit" in run.stdout + run.stderr, run.tail()
    assert "compiled-step cache hit" in run.stdout + run.stderr, run.tail()
    again = read_metrics(folder)
    # the stored graph is the compiled one, node for node: the same numbers, bitwise
    assert [r["loss"] for r in again] == [r["loss"] for r in first]
    assert [r["grad_norm"] for r in again] == [r["grad_norm"] for r in first]

    # One rank's stored graph spoiled: it is ignored, every rank compiles, training is unchanged.
    (folder / "plan_cache" / "graphs").joinpath(_rank_entry(folder, 1)).write_bytes(b"not a graph")
    run = _restart_fsdp(folder, log_rank="0,1")
    out = run.stdout + run.stderr
    assert "compiled-step cache entry" in out and "ignored: unreadable" in out, run.tail()
    assert "another rank has no valid entry; compiling on every rank" in out, run.tail()
    assert [r["loss"] for r in read_metrics(folder)] == [r["loss"] for r in first]


def _restart_fsdp(folder: Path, log_rank: str = "0"):
    """The 2-rank FSDP job of ``runs.auto("llama3", "fsdp")`` started again in its folder."""
    (folder / "metrics.jsonl").unlink()
    run = run_launcher(
        ["--job.dump_folder", folder, "--model.name", "llama3_auto_parallel",
         "--training.steps", STEPS, "--training.seq_len", SEQ_LEN,
         "--training.local_batch_size", GLOBAL_BATCH // 2,
         "--metrics.enable_tensorboard", "false", "--metrics.peak_tflops", "1", *_LAYERS],
        ngpu=2, config=CONFIGS["llama3"], log_rank=log_rank,
    )
    assert run.returncode == 0, run.tail()
    return run


def _rank_entry(folder: Path, rank: int) -> str:
    names = [p.name for p in (folder / "plan_cache" / "graphs").glob(f"rank{rank}-*.pt")]
    assert len(names) == 1, names
    return names[0]
