"""The smoke job of each supported torch (``make smoke`` runs it on torch 2.11 with torchtitan 0.2.2).

What must hold on every torch and torchtitan we support, end to end through
``./run_train.sh`` on gloo: the debug model plans with no op replicated for
lack of a rule, a 2-rank automatic plan logs the 1-rank losses, and both
automatically planned models train 3 steps of the shipped debug configs.
The full suite (``make test``) covers the rest on the locked set.
"""

from __future__ import annotations

import json
import math

import pytest
from _run import FEW_LAYERS, RunCache, check_records, run_launcher

pytestmark = [pytest.mark.multirank, pytest.mark.smoke]

LOSS_REL = 1e-4
STEPS = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> RunCache:
    return RunCache(tmp_path_factory.mktemp("smoke"))


def test_debug_model_plans_on_a_fake_mesh(tmp_path) -> None:
    rc, out, err = run_launcher(
        ["--model.name", "llama3_auto_parallel", "--job.dump_folder", str(tmp_path),
         "--parallelism.tensor_parallel_degree", "2"],
        ngpu=8, comm_mode="fake_backend",
    )
    assert rc == 0, err[-3000:]
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["mesh"]["sizes"] == [4, 2]
    assert plan["replicated_ops"] == []
    assert plan["status"] == "optimal"


def test_two_rank_plan_logs_the_one_rank_losses(runs: RunCache) -> None:
    kw = dict(model="llama3", steps=5, seq_len=64, n_layers=FEW_LAYERS)
    ref = runs.get("ref", ngpu=1, local_batch_size=4, **kw)
    got = runs.get("fsdp", "--model.name", "llama3_auto_parallel", ngpu=2, local_batch_size=2, **kw)
    check_records(got, 5)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=LOSS_REL)
    assert len({round(r["loss"], 6) for r in got}) == 5  # the weights moved


@pytest.mark.parametrize("model", ["llama3", "qwen3"])
def test_planned_debug_model_trains_three_steps(runs: RunCache, model: str) -> None:
    records = runs.get(model, "--model.name", f"{model}_auto_parallel", model=model, ngpu=2, steps=STEPS)
    check_records(records, STEPS)
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in records)
    assert records[-1]["loss"] < records[0]["loss"]
    assert json.loads((runs.root / model / "plan.json").read_text())["replicated_ops"] == []
