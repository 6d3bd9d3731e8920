"""A torchtitan 0.2 job file through the launcher, as its user runs it: planned for its
own world size under COMM_MODE=fake_backend, and trained on 2 CPU ranks with only
``--model.name llama3_auto_parallel`` added (and, to keep the test short, a smaller
step; experiments/tt_configs runs it whole). One warning each, one rank tag a line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _run import REPO, read_metrics, run_launcher

JOB = REPO / "experiments" / "tt_configs" / "torchtitan" / "llama3_debug_model_0.2.toml"
AC_WARNING = "warning: activation_checkpoint.selective_ac_option = '2' in "


@pytest.mark.multirank
def test_a_0_2_job_file_plans_for_its_world_size(tmp_path: Path) -> None:
    run = run_launcher(["--model.name", "llama3_auto_parallel", "--job.dump_folder", tmp_path],
                       ngpu=8, config=JOB, comm_mode="fake_backend", timeout=600)
    assert run.returncode == 0, run.tail()
    out = run.stdout + run.stderr
    assert "batch 64 x 2048" in out and (tmp_path / "plan.json").is_file(), run.tail()
    assert out.count(AC_WARNING) == 1, run.tail()


@pytest.mark.multirank
def test_a_0_2_job_file_trains_on_2_cpu_ranks(tmp_path: Path) -> None:
    run = run_launcher(["--model.name", "llama3_auto_parallel", "--job.dump_folder", tmp_path,
                        "--training.steps", "2", "--training.seq_len", "128", "--training.local_batch_size", "2"],
                       ngpu=2, config=JOB, timeout=600)
    assert run.returncode == 0, run.tail()
    out = run.stdout + run.stderr
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert out.count(AC_WARNING) == 1, run.tail()  # by the launcher, not again by the ranks
    assert out.count("torchtitan's test tokenizer) is not here") == 1, run.tail()
    assert out.count("training on the shipped corpus instead") == 1, run.tail()
    assert "cost profile cpu_gloo's built-in float32 peak" in out, run.tail()
    # torchrun tags each line [rank0]:; the trainer's own format no longer repeats it
    assert re.search(r"^\[rank0\]:\d{4}-\d\d-\d\d .* step:  1  loss:", out, re.M), run.tail()
    assert not re.search(r"^\[rank\d+\]:\[rank\d+\]", out, re.M), run.tail()  # torch's own lines too
