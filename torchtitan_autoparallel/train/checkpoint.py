"""Distributed checkpoints (DCP) of the sharded model and optimizer, and resume.

Each save is ``<folder>/step-<N>/``: the DCP shards of model and optimizer
state (resharding on load, so another mesh can read them) plus
``train_state.json`` with the step, the data loader position and the model
identity, written by rank 0.

Parameters and optimizer state are saved as DTensors under the model's own
FQNs, so a checkpoint does not record a plan: loading fills the DTensors of
the running plan (hand-written or automatic, any mesh) and DCP reshards.

A model-only save (``last_save_model_only``: the last step's) holds the
weights alone, in ``export_dtype``, and says so in ``train_state.json``; it
cannot be resumed from, so resuming skips it, but any run of the same model
can start from its weights (``initial_load_path``), as from any checkpoint's.

What a save writes besides DCP's files, and how a load checks them before it
trusts them (a checksum manifest, ``.metadata`` read without running code), is
``checkpoint_files.py``'s. A save that fails (a full disk, a folder it may not
write) is one error naming the cause; its partial step folder is removed, and
the last complete checkpoint stays the one a resume picks.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from torchtitan_autoparallel.models.registry import build_meta_model
from torchtitan_autoparallel.train import checkpoint_files as files
from torchtitan_autoparallel.train import hf_checkpoint
from torchtitan_autoparallel.train.checkpoint_files import METADATA, STATE_FILE, CheckpointError, first_failure

logger = logging.getLogger("torchtitan_autoparallel")
_STEP_DIR = re.compile(r"^step-(\d+)$")


def model_id(family: str, flavor: str, n_layers: int = 0) -> str:
    """What a checkpoint must match to load: hand-written and automatic runs of
    one family, flavor and depth share it (same tensors under the same FQNs)."""
    return f"{family}:{flavor}" + (f":{n_layers}layers" if n_layers else "")


def job_model_id(job, family: str) -> str:
    """``model_id`` of the model ``job`` trains."""
    return model_id(family, job.model.flavor, job.model.n_layers)


def parse_model_id(text: str) -> tuple[str, str, int]:
    """``model_id``'s (family, flavor, n_layers) back from its text."""
    family, flavor, *depth = text.split(":")
    return family, flavor, int(depth[0].removesuffix("layers")) if depth else 0


def job_folder(job) -> Path:
    return Path(job.job.dump_folder) / job.checkpoint.folder


def step_to_load(job) -> int | None:
    """The step a run of ``job`` resumes from (None: start fresh)."""
    if not job.checkpoint.enable:
        return None
    if job.checkpoint.load_step >= 0:
        return job.checkpoint.load_step
    return latest_step(job_folder(job))


def initial_load_path(job) -> Path | None:
    """The checkpoint a run of ``job`` starts from when it resumes none (None: its own init)."""
    if not job.checkpoint.initial_load_path or step_to_load(job) is not None:
        return None
    return Path(job.checkpoint.initial_load_path)


def check_resume(job, family: str) -> None:
    """Refuse, before any rank starts, a checkpoint this run could not load."""
    step = step_to_load(job)
    wanted = job_model_id(job, family)
    if step is not None:
        read_train_state(job_folder(job), step, wanted)
    elif (path := initial_load_path(job)) is not None:
        c = job.checkpoint
        check_initial(path, wanted, c.initial_load_model_only, c.initial_load_in_hf)


# What one checkpoint takes on disk, a parameter at a time: the weights in fp32 (training
# keeps fp32 weights whatever mixed_precision_param computes in) and AdamW's two fp32
# moments. DCP adds a header per tensor and shard and the .metadata: 1.6% of the debug
# model's checkpoint on 2 ranks, so 2% is added (the tensors of larger models are larger).
_BYTES_PER_PARAMETER = 4 + 2 * 4
_OVERHEAD = 1.02


def checkpoint_bytes(job, family: str) -> tuple[int, int]:
    """(bytes one checkpoint of ``job``'s model takes, its parameter count)."""

    model = build_meta_model(family, job.model.flavor, job.model.n_layers)
    params = sum(p.numel() for p in model.parameters())
    return int(params * _BYTES_PER_PARAMETER * _OVERHEAD), params


def check_destination(job, family: str) -> None:
    """Before any rank starts: refuse a checkpoint folder this user cannot write, or whose
    file system has less room than one checkpoint, rather than fail at the first save."""
    if not job.checkpoint.enable:
        return
    folder = job_folder(job).absolute()
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    accepted = "accepted: a checkpoint.folder (or job.dump_folder) this user can create and write"
    if not existing.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} cannot be made: {existing} is not a folder; {accepted}")
    try:  # probed by making and removing a folder, so a refused job leaves nothing behind
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=existing))
    except OSError as e:
        raise CheckpointError(
            f"checkpoint folder {folder} cannot be written ({e.strerror} in {existing}); {accepted}"
        ) from None
    needed, params = checkpoint_bytes(job, family)
    free = shutil.disk_usage(existing).free
    if free < needed:
        raise CheckpointError(
            f"checkpoint folder {folder}: {_size(free)} free on its file system, one checkpoint of this model "
            f"needs {_size(needed)} ({params:,} parameters x {_BYTES_PER_PARAMETER} bytes: fp32 weights and "
            f"AdamW's two moments, plus 2%); accepted: a checkpoint.folder with {_size(needed)} free, "
            f"or checkpoint.enable = false"
        )


def _size(n: int) -> str:
    return f"{n:,} bytes ({n / 2**30:.2f} GiB)"


def latest_step(folder: Path) -> int | None:
    """The latest complete checkpoint that can be resumed from (model-only saves cannot).

    A save cut short while DCP wrote its shards (no ``.metadata``) is passed over: it
    cannot be loaded, and the next save of its step replaces it. A newer folder whose
    shards and ``.metadata`` are all there but whose train_state.json is not (lost, or a
    save stopped just before writing it) is refused: resuming an older step would
    overwrite it when the run got there.
    """
    newer_incomplete = None
    for step in sorted(_steps(folder), reverse=True):
        path = folder / f"step-{step}"
        if not (path / STATE_FILE).is_file():
            if newer_incomplete is None and (path / METADATA).is_file():
                newer_incomplete = path
        elif not files.read_state_file(path).get("model_only", False):
            _refuse_incomplete(newer_incomplete, step)
            return step
    _refuse_incomplete(newer_incomplete, None)
    return None


def _steps(folder: Path) -> list[int]:
    return [int(m.group(1)) for p in folder.glob("step-*") if (m := _STEP_DIR.match(p.name)) and p.is_dir()]


def _refuse_incomplete(path: Path | None, older: int | None) -> None:
    if path is None:
        return
    instead = f"checkpoint.load_step = {older} (the latest complete checkpoint)" if older is not None else (
        "another checkpoint.folder"
    )
    raise CheckpointError(
        f"checkpoint {path} has its shards and {METADATA} but no {STATE_FILE} (the file was lost, or the "
        f"save stopped just before writing it), so it cannot be resumed, and a run from "
        f"{'step-' + str(older) if older is not None else 'step 1'} would overwrite it; accepted: {instead}, "
        f"or remove {path}"
    )


def resumable_steps(folder: Path) -> list[int]:
    """The steps of ``folder`` a run could resume, oldest first; unreadable ones left out (never raises)."""
    found = []
    for step in _steps(folder):
        try:
            if not files.read_state_file(folder / f"step-{step}").get("model_only", False):
                found.append(step)
        except (OSError, CheckpointError):
            continue
    return sorted(found)


def last_verified(folder: Path, before: int) -> int | None:
    """On every rank at once: the latest resumable step of ``folder`` below ``before`` whose
    files match its manifest (one saved before manifests, which cannot be checked, counts)."""
    for step in reversed(resumable_steps(folder)):
        if step >= before:
            continue
        try:
            if files.verify(folder / f"step-{step}") is None:
                return step
        except CheckpointError:  # a damaged manifest: not this one
            continue
    return None


# Optimizer state keyed by flat parameter FQNs, as torchtitan stores it.
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _state(model: nn.Module, optimizer) -> dict:
    # The model's own state_dict, not torch's get_model_state_dict: torchtitan's
    # fused QKV module renames wqkv to wq/wk/wv in a state-dict hook, which the
    # generic helper cannot map back to module paths.
    return {
        "model": model.state_dict(),
        "optimizer": get_optimizer_state_dict(model, optimizer, options=_OPTIM_OPTIONS),
    }


def _weights(model: nn.Module, dtype: torch.dtype) -> dict:
    """The model's state dict with floating-point tensors in ``dtype`` (complex buffers kept)."""
    return {
        k: v.to(dtype) if v.is_floating_point() and v.dtype != dtype else v
        for k, v in model.state_dict().items()
    }


def save(
    folder: Path,
    step: int,
    model: nn.Module,
    optimizer,
    train_state: dict,
    keep_latest_k: int = 0,
    model_only_dtype: torch.dtype | None = None,
    hf_adapter=None,
    background: dist.ProcessGroup | None = None,
) -> PendingSave | None:
    """Save ``step`` (the weights alone, in ``model_only_dtype``, when that is given; in
    Hugging Face's layout too with ``hf_adapter``), then (rank 0) remove what
    ``keep_latest_k`` no longer keeps (0: nothing).

    With ``background`` (a gloo group) the state is copied now and written by a
    thread while training goes on: the returned ``PendingSave``'s ``wait`` (on
    every rank) completes it. Hugging Face exports are always written at once.
    """
    path = folder / f"step-{step}"
    # a step saved before (a resume went back past it, or its weights-only save): start clean
    if dist.get_rank() == 0 and path.exists():
        shutil.rmtree(path)
    dist.barrier()  # on every rank, whatever its file system shows
    if model_only_dtype is None:
        state, kind = _state(model, optimizer), ""
    else:
        dtype = str(model_only_dtype).removeprefix("torch.")
        state = {"model": _weights(model, model_only_dtype)}
        layout = "hf" if hf_adapter is not None else "dcp"
        train_state = {**train_state, "model_only": True, "dtype": dtype, "format": layout}
        kind = f" (weights only, {dtype}{', Hugging Face safetensors' if hf_adapter is not None else ''})"
    done = PendingSave(folder, step, {"step": step, **train_state}, keep_latest_k, kind)
    behind = background is not None and hf_adapter is None
    logger.info(f"saving checkpoint {path}{kind}{' in the background' if behind else ''} ...")
    try:
        if hf_adapter is not None:
            hf_checkpoint.save(path, state["model"], hf_adapter, model_only_dtype)
            done.hf = True
        elif behind:
            return done.track(dcp.async_save(state, checkpoint_id=str(path), process_group=background))
        else:
            dcp.save(state, checkpoint_id=str(path))
    except (CheckpointException, OSError) as e:  # a BaseException in some torch versions
        done.fail(e)
    if hf_adapter is None:
        done.hash_own_shards()
    done.wait()
    return None


class PendingSave:
    """A save whose shards are written (or being written); ``wait`` marks it complete."""

    def __init__(self, folder: Path, step: int, train_state: dict, keep_latest_k: int, kind: str) -> None:
        self.folder, self.step, self.train_state = folder, step, train_state
        self.keep_latest_k, self.kind = keep_latest_k, kind
        self.path = folder / f"step-{step}"
        self.future: Future | None = None  # the background write, if any
        self.started = time.perf_counter()
        self.written_s: float | None = None  # how long that write took
        self.hf = False  # a Hugging Face export: no DCP shards to list in a manifest
        # this rank's shards' manifest entries, or why they could not be read (a failure)
        self.own: dict | BaseException = {}
        self.hashed = threading.Event()
        self.hashed.set()

    def track(self, future: Future) -> PendingSave:
        """Wait for ``future`` (a background write) in ``wait``; time it, and hash this
        rank's shards in the writing thread once it is done, not in the training loop."""
        self.future, rank = future, dist.get_rank()
        self.hashed.clear()

        def written(f: Future) -> None:
            self.written_s = time.perf_counter() - self.started
            try:
                if f.exception() is None:
                    self.hash_own_shards(rank)
            finally:
                self.hashed.set()

        future.add_done_callback(written)
        return self

    def hash_own_shards(self, rank: int | None = None) -> None:
        try:  # a failure is gathered in ``_complete``: every rank stops, none waits for this one
            self.own = files.own_shards(self.path, dist.get_rank() if rank is None else rank)
        except OSError as e:
            self.own = e

    def wait(self) -> None:
        """On every rank: wait for the write, then write the manifest and train_state.json
        (rank 0), and prune."""
        path = self.path
        if self.future is not None:
            try:
                self.future.result()
            except (CheckpointException, Exception) as e:  # a full disk, a lost mount: one line
                self.fail(e)
            self.hashed.wait()
            self.kind += f" (written in the background in {self.written_s:.1f} s)"
        self._complete()
        logger.info(f"saved checkpoint {path}{self.kind}")
        if self.keep_latest_k and dist.get_rank() == 0:
            removed = purge_old(self.folder, self.keep_latest_k)
            if removed:
                names = ", ".join(p.name for p in removed)
                logger.info(f"removed checkpoint(s) {names} (checkpoint.keep_latest_k = {self.keep_latest_k})")

    def _complete(self) -> None:
        """Gather the shards' checksums; rank 0 writes the manifest, then train_state.json
        (written last: its presence marks a complete checkpoint). Every rank learns
        whether that worked, so all fail alike rather than wait on one that failed."""
        own = self.own if isinstance(self.own, dict) else files.save_failure(self.path, self.own)
        gathered = [own]
        if dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, own)
        failed = next((g for g in gathered if not isinstance(g, dict)), None)
        if failed is None and dist.get_rank() == 0:
            try:
                if self.hf:
                    files.write_atomic(self.path / STATE_FILE, json.dumps(self.train_state).encode())
                else:
                    shards = {name: entry for g in gathered for name, entry in g.items()}
                    files.write_complete(self.path, shards, self.train_state)
            except OSError as e:
                failed = files.save_failure(self.path, e)
        outcome = [failed]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(outcome, src=0)
        if outcome[0] is not None:
            self._raise(*outcome[0])

    def fail(self, e: BaseException) -> NoReturn:
        """On every rank (DCP reports any rank's failure on all): stop, with rank 0's
        reading of the cause, so that every rank says the same."""
        logger.debug(f"checkpoint save failed: {e}")  # every rank's traceback, at the debug level
        why = [files.save_failure(self.path, e) if dist.get_rank() == 0 else None]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(why, src=0)
        self._raise(*why[0])

    def _raise(self, cause: str, fix: str) -> NoReturn:
        if dist.get_rank() == 0:  # the partial save: it holds space, and no resume can use it
            shutil.rmtree(self.path, ignore_errors=True)
        earlier = [s for s in resumable_steps(self.folder) if s != self.step]
        kept = (f"the last complete checkpoint, {self.folder / f'step-{earlier[-1]}'}, is kept"
                if earlier else "no earlier checkpoint exists")
        raise CheckpointError(f"saving checkpoint {self.path} failed: {cause}; {kept}; accepted: {fix}")


class Saver:
    """A run's checkpoint writer. With ``async_mode = "async"`` each save is written in
    the background (one at a time: the next save, and the end of training, wait for it)."""

    def __init__(self, folder: Path, keep_latest_k: int, async_mode: str) -> None:
        self.folder, self.keep_latest_k = folder, keep_latest_k
        # async saves run their collectives on a gloo group of their own (NCCL cannot)
        self.group = dist.new_group(backend="gloo") if async_mode == "async" else None
        self.pending: PendingSave | None = None

    def save(self, step: int, model: nn.Module, optimizer, train_state: dict, **kwargs) -> None:
        self.wait()
        self.pending = save(
            self.folder, step, model, optimizer, train_state, self.keep_latest_k, background=self.group, **kwargs
        )

    def wait(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.wait()


def purge_old(folder: Path, keep: int) -> list[Path]:
    """Remove the step folders older than the ``keep`` latest complete checkpoints.

    Incomplete ones (no train_state.json: a save a crash cut short) older than
    those are removed too; anything newer, and anything not named ``step-N``, stays.
    """
    steps = sorted(int(m.group(1)) for p in folder.glob("step-*") if p.is_dir() and (m := _STEP_DIR.match(p.name)))
    complete = [s for s in steps if (folder / f"step-{s}" / "train_state.json").is_file()]
    if len(complete) <= keep:
        return []
    oldest_kept = complete[-keep]
    removed = [folder / f"step-{s}" for s in steps if s < oldest_kept]
    for path in removed:
        shutil.rmtree(path)
    return removed


def read_train_state(folder: Path, step: int, model_id: str) -> dict:
    """The saved train state of ``step``, checked to belong to ``model_id`` and to be resumable."""
    path = folder / f"step-{step}"
    state = _read_state(path, model_id)
    if state.get("model_only"):
        raise CheckpointError(
            f"checkpoint {path} holds the weights only (checkpoint.last_save_model_only) and "
            f"cannot be resumed; accepted: a full checkpoint's step, or this one as "
            f"checkpoint.initial_load_path (its weights, from step 1)"
        )
    return state


def check_initial(path: Path, model_id: str, model_only: bool, in_hf: bool = False) -> dict | None:
    """The train state of the checkpoint a run starts from, checked as ``read_train_state``;
    a model-only save serves only for its weights. Hugging Face weights (``in_hf``) need
    no train state (None: a folder from the Hub)."""
    key = "checkpoint.initial_load_path"
    if in_hf:
        hf_checkpoint.check_folder(path)
        return _read_state(path, model_id, key) if (path / "train_state.json").is_file() else None
    state = _read_state(path, model_id, key)
    if state.get("format") == "hf":
        raise CheckpointError(
            f"{key} {str(path)!r} holds Hugging Face safetensors; accepted: "
            f"checkpoint.initial_load_in_hf = true"
        )
    if state.get("model_only") and not model_only:
        raise CheckpointError(
            f"{key} {str(path)!r} holds the weights only, but "
            f"checkpoint.initial_load_model_only is false; accepted: initial_load_model_only = "
            f"true, or a full checkpoint"
        )
    return state


def _read_state(path: Path, model_id: str, key: str | None = None) -> dict:
    state_file = path / STATE_FILE
    if not state_file.is_file():
        where = f"{key} {str(path)!r}: no complete checkpoint there" if key else f"no complete checkpoint at {path}"
        raise CheckpointError(f"{where}; accepted: a step folder with train_state.json")
    state = files.read_state_file(path)
    if state.get("model_id") != model_id:
        raise CheckpointError(
            f"checkpoint {path} holds model {state.get('model_id')!r}, this run trains "
            f"{model_id!r}; accepted: a checkpoint of the same model and flavor"
        )
    return state


def load(folder: Path, step: int, model: nn.Module, optimizer, model_id: str, fresh_optimizer: bool = False) -> dict:
    """Restore model and optimizer (unless ``fresh_optimizer``) in place; return the saved train state."""
    path = folder / f"step-{step}"
    state = read_train_state(folder, step, model_id)
    _load_into(path, model, None if fresh_optimizer else optimizer, resumed_from=folder)
    saved_on = f", saved on {state['world_size']} rank(s)" if "world_size" in state else ""
    logger.info(f"resumed from checkpoint {path} (step {state['step']}{saved_on})")
    return state


def load_initial(
    path: Path, model: nn.Module, optimizer, model_id: str, model_only: bool, hf_adapter=None,
    fresh_optimizer: bool = False,
) -> dict | None:
    """Start from the checkpoint at ``path``: its weights alone (returns None), or with
    ``model_only`` false everything, as a resume (returns its train state). With
    ``hf_adapter``, ``path`` holds Hugging Face safetensors (weights only)."""
    state = check_initial(path, model_id, model_only, hf_adapter is not None)
    if hf_adapter is not None:
        hf_checkpoint.load(path, model, hf_adapter)
        return None
    if not model_only:
        _load_into(path, model, None if fresh_optimizer else optimizer)
        logger.info(f"started from checkpoint {path} (step {state['step']}: weights, optimizer and data)")
        return state
    _load_into(path, model, None)
    logger.info(f"started from the weights of checkpoint {path} (saved at step {state['step']}); step 1 next")
    return None


def _load_into(path: Path, model: nn.Module, optimizer, resumed_from: Path | None = None) -> None:
    """DCP-load the model, and the optimizer unless it is None, in place, once the files
    are checked (``resumed_from``: the run's checkpoint folder, where an older step may serve).

    The target state dict holds this run's DTensors, so DCP reads into each
    rank's shards of the current placements whatever plan or mesh saved them,
    converting the saved dtype to the model's.
    """
    reader = files.CheckedReader(path, _checked_metadata(path, resumed_from))
    target = _state(model, optimizer) if optimizer is not None else {"model": model.state_dict()}
    try:
        dcp.load(target, checkpoint_id=str(path), storage_reader=reader)
    except CheckpointException as e:  # a BaseException: one line, not a traceback per rank
        raise CheckpointError(
            f"checkpoint {path} does not fit this model: {first_failure(e)}; "
            f"accepted: a checkpoint of the same model and flavor"
        ) from None
    model.load_state_dict(target["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, target["optimizer"], options=_OPTIM_OPTIONS)
        _check_state_placed_like_params(optimizer)


def _checked_metadata(path: Path, resumed_from: Path | None):
    """On every rank: check ``path``'s files against its manifest, then read its
    ``.metadata`` (safely, verified or not)."""
    problem = files.verify(path)
    if problem is not None:
        raise CheckpointError(f"checkpoint {path} is damaged: {problem}; accepted: {_instead(path, resumed_from)}")
    if not (path / files.MANIFEST).is_file() and dist.get_rank() == 0:
        logger.warning(
            f"warning: checkpoint {path} has no {files.MANIFEST} (saved before checkpoints were "
            f"checksummed): its files cannot be verified; loading it as it is"
        )
    try:
        return files.read_metadata(path)
    except CheckpointError as e:  # planted or damaged, on every rank alike: say what to load instead
        if resumed_from is None:
            raise
        raise CheckpointError(f"{e}, or {_instead(path, resumed_from)}") from None


def _instead(path: Path, resumed_from: Path | None) -> str:
    """What to load instead of the damaged checkpoint ``path``."""
    if resumed_from is None:
        return "the file as it was saved, or another checkpoint.initial_load_path"
    step = int(path.name.removeprefix("step-"))
    good = last_verified(resumed_from, before=step)
    if good is None:
        return f"the file as it was saved, or remove {path} (no older checkpoint in {resumed_from} verifies)"
    return f"checkpoint.load_step = {good} ({resumed_from / f'step-{good}'}, the latest older checkpoint that verifies)"


def _check_state_placed_like_params(optimizer) -> None:
    # AdamW's moments must stay sharded like their parameter, or the update
    # would mix placements (or silently keep a full copy on every rank).
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not isinstance(param, DTensor):
                continue
            for key, value in optimizer.state.get(param, {}).items():
                if value.shape == param.shape and (
                    not isinstance(value, DTensor) or tuple(value.placements) != tuple(param.placements)
                ):
                    raise RuntimeError(f"optimizer state {key!r} is not placed like its parameter {param.placements}")
