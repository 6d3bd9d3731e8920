"""Distributed checkpoints (DCP) of the sharded model and optimizer, and resume.

Each save is ``<folder>/step-<N>/``: the DCP shards of model and optimizer
state (resharding on load, so another mesh can read them) plus
``train_state.json`` with the step, the data loader position and the model
identity, written by rank 0.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from torchtitan_autoparallel.errors import UserError

logger = logging.getLogger("torchtitan_autoparallel")
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(UserError):
    pass


def latest_step(folder: Path) -> int | None:
    steps = [int(m.group(1)) for p in folder.glob("step-*") if (m := _STEP_DIR.match(p.name))]
    complete = [s for s in steps if (folder / f"step-{s}" / "train_state.json").is_file()]
    return max(complete) if complete else None


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


def save(folder: Path, step: int, model: nn.Module, optimizer, train_state: dict) -> None:
    path = folder / f"step-{step}"
    dcp.save(_state(model, optimizer), checkpoint_id=str(path))
    # train_state.json is written last: its presence marks a complete checkpoint.
    if dist.get_rank() == 0:
        (path / "train_state.json").write_text(json.dumps({"step": step, **train_state}))
    dist.barrier()
    logger.info(f"saved checkpoint {path}")


def load(folder: Path, step: int, model: nn.Module, optimizer, model_id: str) -> dict:
    """Restore model and optimizer in place; return the saved train state."""
    path = folder / f"step-{step}"
    state_file = path / "train_state.json"
    if not state_file.is_file():
        raise CheckpointError(f"no complete checkpoint at {path}; accepted: a step folder with train_state.json")
    state = json.loads(state_file.read_text())
    if state.get("model_id") != model_id:
        raise CheckpointError(
            f"checkpoint {path} holds model {state.get('model_id')!r}, this run trains "
            f"{model_id!r}; accepted: a checkpoint of the same model and flavor"
        )
    target = _state(model, optimizer)
    dcp.load(target, checkpoint_id=str(path))
    model.load_state_dict(target["model"])
    set_optimizer_state_dict(model, optimizer, target["optimizer"], options=_OPTIM_OPTIONS)
    logger.info(f"resumed from checkpoint {path} (step {state['step']})")
    return state
