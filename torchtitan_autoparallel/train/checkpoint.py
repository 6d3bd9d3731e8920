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
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from concurrent.futures import Future
from pathlib import Path

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

from torchtitan_autoparallel.errors import UserError

logger = logging.getLogger("torchtitan_autoparallel")
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(UserError):
    pass


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


def latest_step(folder: Path) -> int | None:
    """The latest complete checkpoint that can be resumed from (model-only saves cannot)."""
    steps = [int(m.group(1)) for p in folder.glob("step-*") if (m := _STEP_DIR.match(p.name))]
    resumable = [s for s in steps if _resumable(folder / f"step-{s}" / "train_state.json")]
    return max(resumable) if resumable else None


def _resumable(state_file: Path) -> bool:
    return state_file.is_file() and not json.loads(state_file.read_text()).get("model_only", False)


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
    if hf_adapter is not None:
        from torchtitan_autoparallel.train import hf_checkpoint

        hf_checkpoint.save(path, state["model"], hf_adapter, model_only_dtype)
    elif behind:
        return done.track(dcp.async_save(state, checkpoint_id=str(path), process_group=background))
    else:
        dcp.save(state, checkpoint_id=str(path))
    done.wait()
    return None


class PendingSave:
    """A save whose shards are written (or being written); ``wait`` marks it complete."""

    def __init__(self, folder: Path, step: int, train_state: dict, keep_latest_k: int, kind: str) -> None:
        self.folder, self.step, self.train_state = folder, step, train_state
        self.keep_latest_k, self.kind = keep_latest_k, kind
        self.future: Future | None = None  # the background write, if any
        self.started = time.perf_counter()
        self.written_s: float | None = None  # how long that write took

    def track(self, future: Future) -> PendingSave:
        """Wait for ``future`` (a background write) in ``wait``; time it."""
        self.future = future
        future.add_done_callback(lambda _: setattr(self, "written_s", time.perf_counter() - self.started))
        return self

    def wait(self) -> None:
        """On every rank: wait for the write, then write train_state.json and prune."""
        path = self.folder / f"step-{self.step}"
        if self.future is not None:
            try:
                self.future.result()
            except Exception as e:  # a full disk, a lost mount: one line, not a thread's traceback
                raise CheckpointError(f"writing checkpoint {path} failed: {e}") from None
            self.kind += f" (written in the background in {self.written_s:.1f} s)"
        # train_state.json is written last: its presence marks a complete checkpoint.
        if dist.get_rank() == 0:
            (path / "train_state.json").write_text(json.dumps(self.train_state))
        dist.barrier()
        logger.info(f"saved checkpoint {path}{self.kind}")
        if self.keep_latest_k and dist.get_rank() == 0:
            removed = purge_old(self.folder, self.keep_latest_k)
            if removed:
                names = ", ".join(p.name for p in removed)
                logger.info(f"removed checkpoint(s) {names} (checkpoint.keep_latest_k = {self.keep_latest_k})")


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
        from torchtitan_autoparallel.train import hf_checkpoint

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
    state_file = path / "train_state.json"
    if not state_file.is_file():
        where = f"{key} {str(path)!r}: no complete checkpoint there" if key else f"no complete checkpoint at {path}"
        raise CheckpointError(f"{where}; accepted: a step folder with train_state.json")
    state = json.loads(state_file.read_text())
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
    _load_into(path, model, None if fresh_optimizer else optimizer)
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
        from torchtitan_autoparallel.train import hf_checkpoint

        hf_checkpoint.load(path, model, hf_adapter)
        return None
    if not model_only:
        _load_into(path, model, None if fresh_optimizer else optimizer)
        logger.info(f"started from checkpoint {path} (step {state['step']}: weights, optimizer and data)")
        return state
    _load_into(path, model, None)
    logger.info(f"started from the weights of checkpoint {path} (saved at step {state['step']}); step 1 next")
    return None


def _load_into(path: Path, model: nn.Module, optimizer) -> None:
    """DCP-load the model, and the optimizer unless it is None, in place.

    The target state dict holds this run's DTensors, so DCP reads into each
    rank's shards of the current placements whatever plan or mesh saved them,
    converting the saved dtype to the model's.
    """
    target = _state(model, optimizer) if optimizer is not None else {"model": model.state_dict()}
    try:
        dcp.load(target, checkpoint_id=str(path))
    except CheckpointException as e:  # a BaseException: one line, not a traceback per rank
        raise CheckpointError(
            f"checkpoint {path} does not fit this model: {first_failure(e)}; "
            f"accepted: a checkpoint of the same model and flavor"
        ) from None
    model.load_state_dict(target["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, target["optimizer"], options=_OPTIM_OPTIONS)
        _check_state_placed_like_params(optimizer)


def first_failure(e: CheckpointException) -> str:
    for failure in e.failures.values():
        exc = failure[0] if isinstance(failure, tuple) else failure
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return str(e)


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
