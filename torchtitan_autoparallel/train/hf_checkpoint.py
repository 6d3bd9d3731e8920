"""Weights in Hugging Face's safetensors layout: the last save, and a run's starting point.

The name mapping (and LLaMA's rotary permutation of the query and key
weights) is torchtitan's own state-dict adapter for the model family, applied
to the DTensors of whatever plan is running; DCP's Hugging Face storage
writer and reader move the bytes, each rank writing and reading its shards.
The export is one ``model-00001-of-00001.safetensors`` with its index (no
``config.json``: pair it with the model's Hugging Face config), and our
``train_state.json`` beside it; a folder downloaded from the Hub loads as it is.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException

from torchtitan_autoparallel.errors import ConfigError

logger = logging.getLogger("torchtitan_autoparallel")


def adapter(family: str, model_config):
    """torchtitan's state-dict adapter of ``family`` (no HF assets: one safetensors file)."""
    if family == "llama3":
        from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter as Adapter
    elif family == "qwen3":
        from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter as Adapter
    else:
        raise ValueError(f"no Hugging Face layout known for model family {family!r}")
    return Adapter(model_config, None)


def save(path: Path, weights: dict, hf_adapter) -> None:
    """Write ``weights`` (the model's state dict, already in the export dtype) under HF names."""
    writer = HuggingFaceStorageWriter(path=str(path), save_distributed=True, enable_consolidation=True)
    dcp.save(hf_adapter.to_hf(weights), storage_writer=writer)
    if dist.get_rank() == 0:  # the per-rank pieces the consolidated file was made from
        shutil.rmtree(path / "sharded", ignore_errors=True)


def check_folder(path: Path) -> None:
    """Refuse, before any rank starts, a folder without safetensors files."""
    if not path.is_dir() or not any(path.glob("*.safetensors")):
        raise ConfigError(
            f"checkpoint.initial_load_path {str(path)!r} holds no .safetensors file "
            f"(checkpoint.initial_load_in_hf is true); accepted: a folder of Hugging Face "
            f"safetensors weights of this model"
        )


def load(path: Path, model: nn.Module, hf_adapter) -> None:
    """Fill the model's parameters (any plan) from the HF safetensors in ``path``."""
    from torchtitan_autoparallel.train.checkpoint import CheckpointError, first_failure

    target = hf_adapter.to_hf(model.state_dict())
    try:
        dcp.load(target, storage_reader=HuggingFaceStorageReader(str(path)))
    except CheckpointException as e:  # a BaseException: one line, not a traceback per rank
        raise CheckpointError(
            f"Hugging Face weights in {path} do not fit this model: {first_failure(e)}; "
            f"accepted: safetensors of the same model and flavor"
        ) from None
    with torch.no_grad():
        model.load_state_dict(hf_adapter.from_hf(target))
    logger.info(f"started from the Hugging Face weights in {path}; step 1 next")
