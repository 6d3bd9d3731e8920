"""Weights in Hugging Face's safetensors layout: the last save, and a run's starting point.

The name mapping (and LLaMA's rotary permutation of the query and key
weights) is torchtitan's own state-dict adapter for the model family, applied
to the DTensors of whatever plan is running; DCP's Hugging Face storage
writer and reader move the bytes, each rank writing and reading its shards.
The export is one ``model-00001-of-00001.safetensors`` with its index, a
``config.json`` that transformers' ``from_pretrained`` reads (written from
torchtitan's model config: sizes, norms, RoPE), and our ``train_state.json``;
a folder downloaded from the Hub loads as it is.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException

from torchtitan_autoparallel import compat
from torchtitan_autoparallel.compat import ModelConfig
from torchtitan_autoparallel.errors import ConfigError
from torchtitan_autoparallel.train.checkpoint_files import CheckpointError, first_failure

logger = logging.getLogger("torchtitan_autoparallel")


def adapter(family: str, model_config: ModelConfig):
    """torchtitan's state-dict adapter of ``family`` (no HF assets: one safetensors file)."""
    if family not in compat.FAMILIES:
        raise ValueError(f"no Hugging Face layout known for model family {family!r}")
    return compat.state_dict_adapter(model_config)


def save(path: Path, weights: dict, hf_adapter, dtype: torch.dtype) -> None:
    """Write ``weights`` (the model's state dict, already in ``dtype``) under HF names, and config.json."""
    writer = HuggingFaceStorageWriter(path=str(path), save_distributed=True, enable_consolidation=True)
    dcp.save(hf_adapter.to_hf(weights), storage_writer=writer)
    if dist.get_rank() == 0:  # the per-rank pieces the consolidated file was made from
        shutil.rmtree(path / "sharded", ignore_errors=True)
        write_config(path, hf_adapter, dtype)


def write_config(folder: Path, hf_adapter, dtype: torch.dtype) -> None:
    """``folder/config.json`` for the model ``hf_adapter`` converts (none for an unknown RoPE)."""
    config = config_json(hf_adapter, dtype)
    if config is None:
        logger.warning(f"no config.json written to {folder}: no Hugging Face config is known for this RoPE or this torchtitan release (0.3 has one)")
        return
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def config_json(hf_adapter, dtype: torch.dtype) -> dict | None:
    """transformers' config of the model: LlamaForCausalLM or Qwen3ForCausalLM."""
    c = hf_adapter.model_config
    if not hasattr(c, "layers"):  # torchtitan 0.2's model args: not mapped to transformers' config
        return None
    attention = c.layers[0].attention
    rope = attention.rope
    if rope.scaling not in ("none", "llama"):
        return None
    qwen = type(hf_adapter).__name__.startswith("Qwen3")
    parameters = {"rope_type": "default", "rope_theta": rope.theta}
    if rope.scaling == "llama":
        parameters.update(
            rope_type="llama3", factor=rope.scaling_factor, low_freq_factor=rope.low_freq_factor,
            high_freq_factor=rope.high_freq_factor,
            original_max_position_embeddings=rope.original_max_position_embeddings,
        )
    legacy_scaling = {k: v for k, v in parameters.items() if k != "rope_theta"} if rope.scaling == "llama" else None
    return {
        "architectures": ["Qwen3ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen3" if qwen else "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.dim,
        "intermediate_size": c.layers[0].feed_forward.w1.out_features,
        "num_hidden_layers": len(c.layers),
        "num_attention_heads": attention.n_heads,
        "num_key_value_heads": attention.n_kv_heads or attention.n_heads,
        "head_dim": rope.dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.norm.eps,
        "max_position_embeddings": rope.max_seq_len,
        "tie_word_embeddings": bool(c.enable_weight_tying),
        "attention_bias": False,
        **({} if qwen else {"mlp_bias": False}),
        # transformers 5 reads rope_parameters; 4.x reads rope_theta and rope_scaling
        "rope_parameters": parameters,
        "rope_theta": rope.theta,
        "rope_scaling": legacy_scaling,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


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
