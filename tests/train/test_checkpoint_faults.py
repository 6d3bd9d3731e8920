"""Checkpoint faults end in one line naming the cause, and lose nothing (issue 75).

In-process checks on a one-rank gloo group and a small model: a save that hits a
full disk or a folder it may not write (sync and async), the pre-launch check of
the checkpoint folder, checksums (a changed, truncated or missing file), a
planted ``.metadata`` pickle, a damaged ``train_state.json``, a latest step
folder without one, and the divergence message's checkpoint. Then launches of
the debug model on 2 CPU ranks (``multirank``): a full disk (a small tmpfs,
where this user may mount one), and a damaged and a planted checkpoint refused
by the ranks in one line.
"""

from __future__ import annotations

import errno
import json
import math
import os
import pickle
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from _run import LLAMA3_CONFIG, flip_byte, run_launcher
from torch import nn

from torchtitan_autoparallel.config import load_config
from torchtitan_autoparallel.launch import preflight
from torchtitan_autoparallel.train import checkpoint

MODEL_ID = "m"


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    return model, torch.optim.AdamW(model.parameters())


def _save(folder: Path, step: int, **kwargs) -> None:
    model, optimizer = _model()
    checkpoint.save(folder, step, model, optimizer, {"model_id": MODEL_ID, "data": {"sample": 0}}, **kwargs)


def _load(folder: Path, step: int) -> None:
    model, optimizer = _model()
    checkpoint.load(folder, step, model, optimizer, MODEL_ID)


def _one_line(e: pytest.ExceptionInfo) -> str:
    message = str(e.value)
    assert "\n" not in message and "Traceback" not in message, message
    return message


# ---------------------------------------------------------------- 1. save failures


def _write_fails(monkeypatch, err: int) -> None:
    """Every DCP shard write fails with ``err``, as on a full disk or a folder it may not write."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    real = FileSystem.create_stream

    @contextmanager
    def create_stream(self, path, mode):
        if str(path).endswith(".distcp"):
            raise OSError(err, os.strerror(err), str(path))
        with real(self, path, mode) as stream:
            yield stream

    monkeypatch.setattr(FileSystem, "create_stream", create_stream)


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("err,cause", [(errno.ENOSPC, "no space left on device"), (errno.EACCES, "permission denied")])
def test_a_failed_save_is_one_line_and_keeps_the_last_checkpoint(
    gloo_one, tmp_path: Path, monkeypatch, background: bool, err: int, cause: str
) -> None:
    import torch.distributed as dist

    folder = tmp_path / "ckpt"
    _save(folder, 2)
    _write_fails(monkeypatch, err)
    group = dist.new_group(backend="gloo") if background else None
    with pytest.raises(checkpoint.CheckpointError) as info:
        model, optimizer = _model()
        pending = checkpoint.save(folder, 4, model, optimizer, {"model_id": MODEL_ID}, background=group)
        if pending is not None:
            pending.wait()
    message = _one_line(info)
    assert message.startswith(f"saving checkpoint {folder / 'step-4'} failed: {cause} writing "), message
    assert f"the last complete checkpoint, {folder / 'step-2'}, is kept" in message, message
    assert not (folder / "step-4").exists()  # the partial save is gone
    assert checkpoint.latest_step(folder) == 2


def _skip_unless_chmod_blocks_writes(tmp_path: Path) -> None:
    """Root (with CAP_DAC_OVERRIDE) writes into a folder chmod 0o500 leaves it: skip there."""
    probe = tmp_path / "probe"
    probe.mkdir(mode=0o500)
    try:
        (probe / "file").touch()
    except PermissionError:
        return
    finally:
        probe.chmod(0o700)
    pytest.skip("this user writes into a read-only folder (root): the EACCES cases above cover it")


def test_a_save_into_a_read_only_folder_is_one_line(gloo_one, tmp_path: Path) -> None:
    _skip_unless_chmod_blocks_writes(tmp_path)
    folder = tmp_path / "ckpt"
    _save(folder, 2)
    folder.chmod(0o500)
    try:
        with pytest.raises(checkpoint.CheckpointError) as info:
            _save(folder, 4)
    finally:
        folder.chmod(0o700)
    assert "permission denied" in _one_line(info)
    assert checkpoint.latest_step(folder) == 2


# ---------------------------------------------------------------- 2. before the launch


def _job(dump: Path, *overrides: str):
    return load_config(["--job.dump_folder", str(dump), "--checkpoint.enable", "true", *overrides],
                       config_file=str(LLAMA3_CONFIG))


def _preflight(dump: Path, capsys, *overrides: str) -> str:
    args = ["--job.config_file", str(LLAMA3_CONFIG), "--job.dump_folder", str(dump),
            "--checkpoint.enable", "true", *overrides]
    assert preflight.main(["--ngpu", "2", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err, err
    return err


def test_preflight_refuses_a_checkpoint_folder_it_cannot_make(tmp_path: Path, capsys) -> None:
    (tmp_path / "file").write_text("a regular file where a folder should be")
    err = _preflight(tmp_path, capsys, "--checkpoint.folder", str(tmp_path / "file" / "ckpt"))
    assert f"checkpoint folder {tmp_path / 'file' / 'ckpt'} cannot be made: {tmp_path / 'file'} is not a folder" in err


def test_preflight_refuses_a_checkpoint_folder_it_cannot_write(tmp_path: Path, capsys) -> None:
    _skip_unless_chmod_blocks_writes(tmp_path)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        err = _preflight(tmp_path, capsys, "--checkpoint.folder", str(locked / "ckpt"))
    finally:
        locked.chmod(0o700)
    assert f"checkpoint folder {locked / 'ckpt'} cannot be written (Permission denied in {locked})" in err, err


def test_preflight_refuses_a_disk_without_room_for_one_checkpoint(tmp_path: Path, capsys, monkeypatch) -> None:
    needed, params = checkpoint.checkpoint_bytes(_job(tmp_path), "llama3")
    assert params == 6_163_712 and needed == int(params * 12 * 1.02)  # the debug model
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=needed - 1))
    err = _preflight(tmp_path, capsys)
    assert f"checkpoint folder {tmp_path / 'checkpoint'}: {needed - 1:,} bytes" in err, err
    assert f"needs {needed:,} bytes" in err and "accepted: a checkpoint.folder with" in err, err
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=needed))
    preflight.check(_job(tmp_path), 2)  # exactly enough: accepted


# ---------------------------------------------------------------- 3. checksums


@pytest.mark.parametrize("damage,why", [
    ("flip", "__0_0.distcp does not match its sha256 checksum in checksums.json"),
    ("truncate", "__0_0.distcp is truncated"),
    ("remove", "__0_0.distcp is missing"),
    ("state", "train_state.json does not match its sha256 checksum"),
])
def test_a_damaged_checkpoint_names_the_file_and_the_last_that_verifies(
    gloo_one, tmp_path: Path, damage: str, why: str
) -> None:
    for step in (2, 4, 6):
        _save(tmp_path, step)
    flip_byte(tmp_path / "step-4" / "__0_0.distcp", 5000)  # an older one damaged too: not offered
    shard = tmp_path / "step-6" / "__0_0.distcp"
    if damage == "flip":
        flip_byte(shard, shard.stat().st_size // 2)  # in a tensor's bytes: DCP would load it silently
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif damage == "remove":
        shard.unlink()
    else:  # still valid JSON of the same size: another data position
        state = tmp_path / "step-6" / "train_state.json"
        state.write_text(state.read_text().replace('"sample": 0', '"sample": 9'))
    with pytest.raises(checkpoint.CheckpointError) as info:
        _load(tmp_path, 6)
    message = _one_line(info)
    assert message.startswith(f"checkpoint {tmp_path / 'step-6'} is damaged: {why}"), message
    assert message.endswith(f"accepted: checkpoint.load_step = 2 ({tmp_path / 'step-2'}, the latest older "
                            "checkpoint that verifies)"), message
    _load(tmp_path, 2)


def test_a_checkpoint_without_a_manifest_loads_with_a_warning(gloo_one, tmp_path: Path, caplog) -> None:
    _save(tmp_path, 2)
    manifest = json.loads((tmp_path / "step-2" / "checksums.json").read_text())
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "train_state.json"]
    (tmp_path / "step-2" / "checksums.json").unlink()  # as saved before checksums
    with caplog.at_level("WARNING", logger="torchtitan_autoparallel"):
        _load(tmp_path, 2)
    warnings = [r.getMessage() for r in caplog.records if "cannot be verified" in r.getMessage()]
    assert warnings == [f"warning: checkpoint {tmp_path / 'step-2'} has no checksums.json (saved before "
                        "checkpoints were checksummed): its files cannot be verified; loading it as it is"]


# ---------------------------------------------------------------- 4. a planted .metadata


class _Planted:
    """A pickle whose loading creates ``marker``, as any pickle may run code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no_manifest"])
def test_a_planted_metadata_pickle_runs_no_code(gloo_one, tmp_path: Path, manifest: bool) -> None:
    _save(tmp_path, 2)
    marker = tmp_path / "planted-code-ran"
    (tmp_path / "step-2" / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    if not manifest:
        (tmp_path / "step-2" / "checksums.json").unlink()
    with pytest.raises(checkpoint.CheckpointError) as info:
        _load(tmp_path, 2)
    message = _one_line(info)
    assert not marker.exists()
    if manifest:
        assert f"checkpoint {tmp_path / 'step-2'} is damaged: .metadata is truncated" in message, message
    else:
        assert message.startswith(f"checkpoint {tmp_path / 'step-2' / '.metadata'} is not DCP metadata "
                                  "(io.open is not part of DCP's metadata)"), message
    # no older step to go back to: the message says to remove the planted one
    assert message.endswith(f"or remove {tmp_path / 'step-2'} (no older checkpoint in {tmp_path} verifies)"), message


def test_metadata_is_read_by_the_restricted_unpickler_as_dcp_reads_it(gloo_one, tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    from torchtitan_autoparallel.train import checkpoint_files

    _save(tmp_path, 2)
    ours = checkpoint_files.read_metadata(tmp_path / "step-2")
    theirs = FileSystemReader(tmp_path / "step-2").read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data


# ---------------------------------------------------------------- 5. train_state.json


def _fake_step(folder: Path, step: int, state: str | None, metadata: bool = True) -> Path:
    path = folder / f"step-{step}"
    path.mkdir(parents=True)
    if metadata:
        (path / ".metadata").write_bytes(b"shards and metadata written")
    if state is not None:
        (path / "train_state.json").write_text(state)
    return path


def test_malformed_train_state_is_one_line_naming_the_file(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "checkpoint"
    path = _fake_step(folder, 2, '{"step": 2, "model_id": ')
    err = _preflight(tmp_path, capsys)
    assert err.startswith(f"error: checkpoint {path / 'train_state.json'} is not valid JSON ("), err
    assert f"checkpoint.load_step = <an older step>, or remove {path}" in err, err


def test_a_step_that_disagrees_with_its_folder_is_one_line(tmp_path: Path, capsys) -> None:
    path = _fake_step(tmp_path / "checkpoint", 10, json.dumps({"step": 15, "model_id": "llama3:debugmodel"}))
    err = _preflight(tmp_path, capsys)
    assert f"checkpoint {path / 'train_state.json'} says step 15, but its folder is step-10" in err, err
    assert f"checkpoint.load_step = <an older step>, or remove {path}" in err, err


def test_a_latest_step_without_train_state_is_not_passed_over(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "checkpoint"
    _fake_step(folder, 2, json.dumps({"step": 2, "model_id": "llama3:debugmodel"}))
    _fake_step(folder, 6, None, metadata=False)  # a save cut short while writing shards: passed over
    lost = _fake_step(folder, 4, None)
    err = _preflight(tmp_path, capsys)
    assert f"checkpoint {lost} has its shards and .metadata but no train_state.json" in err, err
    assert f"accepted: checkpoint.load_step = 2 (the latest complete checkpoint), or remove {lost}" in err, err
    shutil.rmtree(lost)
    assert checkpoint.latest_step(folder) == 2
    alone = _fake_step(tmp_path / "other", 4, None)  # with no complete one to go back to
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.latest_step(tmp_path / "other")
    assert f"a run from step 1 would overwrite it; accepted: another checkpoint.folder, or remove {alone}" in (
        _one_line(info)
    )


# ---------------------------------------------------------------- 6. divergence


def test_divergence_names_the_last_verified_checkpoint_saved_before_the_loss_went_bad(
    gloo_one, tmp_path: Path
) -> None:
    from torchtitan_autoparallel.errors import TrainingDiverged
    from torchtitan_autoparallel.launch.main import _check_finite

    job = _job(tmp_path)
    folder = checkpoint.job_folder(job)
    for step in (2, 4, 6, 8):
        _save(folder, step)
    flip_byte(folder / "step-4" / "__0_0.distcp", 3000)
    # last finite loss logged at step 6, not finite at 8: step-6's and step-8's weights made bad losses
    with pytest.raises(TrainingDiverged) as info:
        _check_finite(job, 8, math.nan, 1.0, finite_at=6)
    message = _one_line(info)
    assert "resume from checkpoint step-2 (checkpoint.load_step = 2: the latest that verifies" in message, message
    with pytest.raises(TrainingDiverged) as info:
        _check_finite(job, 2, math.inf, 1.0, finite_at=0)
    assert f"restart after moving the step folders of {folder} aside" in _one_line(info)


# ---------------------------------------------------------------- launches on 2 ranks

LAUNCH = ["--model.name", "llama3", "--training.seq_len", "32", "--training.local_batch_size", "1", "--metrics.peak_tflops", "1",
          "--metrics.enable_tensorboard", "false", "--model.n_layers", "2",
          "--checkpoint.enable", "true", "--checkpoint.interval", "2"]


def _error_line(run) -> str:
    assert run.returncode == 2, run.tail()
    assert "Traceback" not in run.stdout + run.stderr, run.tail()
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, run.tail()
    return errors[0]


@pytest.fixture
def tmpfs(tmp_path: Path):
    """A 40 MiB file system: room for one checkpoint of the 2-layer debug model, not two."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); "
                    "the in-process ENOSPC test covers the save")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.multirank
@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_full_disk_stops_the_run_in_one_line_and_a_resume_takes_the_last_save(tmpfs: Path, mode: str) -> None:
    dump = tmpfs / "out"
    run = run_launcher([*LAUNCH, "--job.dump_folder", dump, "--training.steps", "4", "--checkpoint.async_mode", mode],
                       ngpu=2, config=LLAMA3_CONFIG, timeout=300)
    error = _error_line(run)
    step4, step2 = dump / "checkpoint" / "step-4", dump / "checkpoint" / "step-2"
    assert error.startswith(f"error: saving checkpoint {step4} failed: no space left on device"), error
    assert f"the last complete checkpoint, {step2}, is kept" in error, error
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-2"]
    assert checkpoint.latest_step(dump / "checkpoint") == 2


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A 2-rank run's checkpoints at steps 2 and 4."""
    dump = tmp_path_factory.mktemp("faults") / "saved"
    run = run_launcher([*LAUNCH, "--job.dump_folder", dump, "--training.steps", "4"], ngpu=2,
                       config=LLAMA3_CONFIG, timeout=300)
    assert run.returncode == 0, run.tail()
    return dump


@pytest.mark.multirank
def test_the_predicted_checkpoint_size_covers_a_saved_one(saved: Path) -> None:
    needed, _ = checkpoint.checkpoint_bytes(_job(saved, "--model.n_layers", "2"), "llama3")
    written = sum(p.stat().st_size for p in (saved / "checkpoint" / "step-4").iterdir())
    assert written <= needed < 1.1 * written, (written, needed)


@pytest.mark.multirank
@pytest.mark.parametrize("damage", ["flip", "plant"])
def test_ranks_refuse_a_damaged_or_planted_checkpoint_in_one_line(saved: Path, tmp_path: Path, damage: str) -> None:
    dump = tmp_path / "out"
    shutil.copytree(saved, dump)
    step4 = dump / "checkpoint" / "step-4"
    marker = tmp_path / "planted-code-ran"
    if damage == "flip":
        flip_byte(step4 / "__1_0.distcp", (step4 / "__1_0.distcp").stat().st_size // 2)
    else:  # no manifest to catch it: the restricted unpickler must
        (step4 / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
        (step4 / "checksums.json").unlink()
    run = run_launcher([*LAUNCH, "--job.dump_folder", dump, "--training.steps", "6"], ngpu=2,
                       config=LLAMA3_CONFIG, timeout=300)
    error = _error_line(run)
    if damage == "flip":
        assert error == (f"error: checkpoint {step4} is damaged: __1_0.distcp does not match its sha256 checksum "
                         f"in checksums.json (changed since it was saved); accepted: checkpoint.load_step = 2 "
                         f"({dump / 'checkpoint' / 'step-2'}, the latest older checkpoint that verifies)"), error
    else:
        assert f"checkpoint {step4 / '.metadata'} is not DCP metadata" in error, error
        assert not marker.exists()
    assert not (dump / "checkpoint" / "step-6").exists()
