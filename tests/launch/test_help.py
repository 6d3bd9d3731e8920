"""``./run_train.sh --help``: every key with its type, default, meaning and accepted values."""

from __future__ import annotations

from dataclasses import fields

from _run import LLAMA3_CONFIG, run_launcher

from torchtitan_autoparallel.config.job_config import AutoParallel, JobConfig, Training
from torchtitan_autoparallel.launch.help import field_notes, help_for


def test_launcher_help_lists_every_key_and_the_jobs_values(tmp_path) -> None:
    run = run_launcher(["--help", "--training.steps", "7"], config=LLAMA3_CONFIG, timeout=120)
    assert run.returncode == 0, run.tail()
    out = run.stdout
    assert out.startswith("usage: [NGPU=N] [CONFIG_FILE=job.toml] ./run_train.sh"), run.tail()
    job = JobConfig()
    for section in fields(JobConfig):
        assert f"\n[{section.name}]\n" in out
        for f in fields(getattr(job, section.name)):
            assert f"  --{section.name}.{f.name} " in out, f"{section.name}.{f.name} missing"
    assert "  --training.steps int (default 10), this job: 7\n" in out  # the command line over the file
    assert "  --training.local_batch_size int (default 8), this job: 4\n" in out  # the file's value
    assert "  --autoparallel.solver str (default 'ilp')\n      accepted: ilp, approx, auto\n" in out
    assert "accepted: llama3, qwen3, llama3_auto_parallel, qwen3_auto_parallel" in out
    assert "error" not in run.stderr.lower()


def test_notes_are_the_comments_above_and_beside_each_field() -> None:
    notes = field_notes(Training)
    assert notes["global_batch_size"].startswith("-1: local_batch_size x dp degree; a multiple of that accumulates")
    assert notes["local_batch_size"] == "per data-parallel rank and micro-batch"
    assert "steps" not in notes  # no comment, no note
    auto = field_notes(AutoParallel)
    assert auto["compile"].startswith("Run the step as one graph over local tensors")  # lines above
    assert "ilp_backend" not in auto


def test_help_of_a_job_that_does_not_load_shows_the_defaults() -> None:
    text = help_for(["--training.steps", "zero", "-h"])
    assert "  --training.steps int (default 10)\n" in text
    assert "this job" not in text
