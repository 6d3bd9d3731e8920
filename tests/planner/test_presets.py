"""The cluster job files shipped beside the debug ones (``train_configs/``).

Each names its cluster in its header; here each passes the launcher's check for
that many ranks, planning only (``COMM_MODE=fake_backend``, where the
tokenizer path, the cluster's, need not exist here), and LLaMA3-70B's is
planned end to end: its whole predicted peak fits an H100.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _run import REPO, run_launcher

from torchtitan_autoparallel.config import load_config
from torchtitan_autoparallel.errors import ConfigError
from torchtitan_autoparallel.launch.preflight import check

PRESETS = {"llama3_8b": 64, "llama3_70b": 64, "llama3_405b": 128, "qwen3_32b": 8}
FOLDER = REPO / "train_configs"


def _job(name: str, tmp_path: Path, *overrides: str):
    return load_config(["--job.dump_folder", str(tmp_path), *overrides], config_file=str(FOLDER / f"{name}.toml"))


def test_every_cluster_job_file_is_checked_here() -> None:
    shipped = {p.stem for p in FOLDER.glob("*.toml")} - {"llama3_debugmodel", "qwen3_debugmodel"}
    assert shipped == set(PRESETS)


@pytest.mark.parametrize("name,ngpu", PRESETS.items())
def test_a_cluster_job_file_checks_out_for_its_ranks(name: str, ngpu: int, tmp_path: Path, capsys) -> None:
    job = _job(name, tmp_path)
    assert job.model.name.endswith("_auto_parallel") and f"{ngpu} GPUs" in job.job.description
    assert f"NGPU={ngpu} " in (FOLDER / f"{name}.toml").read_text()  # the header's command
    check(job, ngpu, fake=True)
    warned = capsys.readouterr().err.strip().splitlines()
    assert len(warned) == 1 and warned[0].startswith("warning: model.tokenizer_path"), warned
    with pytest.raises(ConfigError, match="model.tokenizer_path"):
        check(job, ngpu, fake=False)  # a real run needs the tokenizer


def test_a_hand_written_plan_needs_its_tokenizer_even_when_only_checked(tmp_path: Path) -> None:
    # its fake-backend run builds the data loader, so the path must exist here
    job = _job("llama3_8b", tmp_path, "--model.name", "llama3")
    with pytest.raises(ConfigError, match="model.tokenizer_path"):
        check(job, 64, fake=True)


def test_llama3_70b_plans_for_64_gpus_and_fits_an_h100(tmp_path: Path) -> None:
    """The whole predicted peak fits: the executor reduces each gradient as the backward makes
    it, so the unreduced fp32 gradients of the 80 blocks are never live at once."""
    run = run_launcher(
        ["--job.dump_folder", tmp_path], config=FOLDER / "llama3_70b.toml", ngpu=64,
        comm_mode="fake_backend", timeout=600,
    )
    assert run.returncode == 0, run.tail()
    assert "plan: at the step's peak (" in run.stderr, run.tail()  # what fills it, in one line
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["mesh"]["names"] == ["dp_shard", "tp"] and plan["mesh"]["sizes"] == [8, 8]
    assert plan["status"] == "optimal"
    assert plan["predicted"]["peak_bytes_per_device"] <= plan["device_memory_bytes"]
    assert "more than the device holds" not in run.stderr, run.tail()
