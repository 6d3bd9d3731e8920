"""Model registry: names users type in ``[model] name`` mapped to torchtitan models.

The models themselves come from the ``torchtitan`` package; this module only
picks the config for a flavor, swaps in an attention backend that runs on CPU
(see ``torchtitan_autoparallel.cpu_compat``), and records which names are
planned automatically.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from torchtitan_autoparallel.errors import ConfigError


@dataclass(frozen=True)
class ModelEntry:
    name: str
    family: str  # "llama3" | "qwen3"
    auto_parallel: bool  # True: the planner chooses every placement


def _llama3_configs() -> dict[str, Callable]:
    from torchtitan_autoparallel.cpu_compat import import_model_module

    return import_model_module("torchtitan.models.llama3").llama3_configs


def _qwen3_configs() -> dict[str, Callable]:
    from torchtitan_autoparallel.cpu_compat import import_model_module

    qwen3_configs = import_model_module("torchtitan.models.qwen3").qwen3_configs

    # Mixture-of-experts flavors need expert parallelism, which we do not plan yet.
    return {k: v for k, v in qwen3_configs.items() if "moe" not in k and "-A" not in k}


_FAMILIES: dict[str, Callable[[], dict[str, Callable]]] = {
    "llama3": _llama3_configs,
    "qwen3": _qwen3_configs,
}

MODELS: dict[str, ModelEntry] = {
    "llama3": ModelEntry("llama3", "llama3", auto_parallel=False),
    "qwen3": ModelEntry("qwen3", "qwen3", auto_parallel=False),
    "llama3_auto_parallel": ModelEntry("llama3_auto_parallel", "llama3", auto_parallel=True),
    "qwen3_auto_parallel": ModelEntry("qwen3_auto_parallel", "qwen3", auto_parallel=True),
}


def get_entry(name: str) -> ModelEntry:
    if name not in MODELS:
        raise ConfigError(f"unknown model.name {name!r}; accepted: {', '.join(MODELS)}")
    return MODELS[name]


def flavors(family: str) -> list[str]:
    return list(_FAMILIES[family]())


def build_model_config(family: str, flavor: str, n_layers: int | None = None):
    """torchtitan's model config for ``family``/``flavor``, with CPU-capable attention.

    ``n_layers`` truncates the stack (planning benchmarks use 2 or 8 layers of
    an 8B model; ``model.n_layers``); None or 0 keeps the flavor's depth.
    """
    from torchtitan_autoparallel.cpu_compat import use_sdpa_attention

    configs = _FAMILIES[family]()
    if flavor not in configs:
        raise ConfigError(
            f"unknown model.flavor {flavor!r} for {family}; accepted: {', '.join(configs)}"
        )
    config = configs[flavor](attn_backend="flex")
    if n_layers:
        if not 1 <= n_layers <= len(config.layers):
            raise ConfigError(
                f"model.n_layers {n_layers} out of range for {family} {flavor}; "
                f"accepted: 0 (all {len(config.layers)}) or 1..{len(config.layers)}"
            )
        config.layers = config.layers[:n_layers]
    use_sdpa_attention(config)
    return config


def build_meta_model(family: str, flavor: str, n_layers: int | None = None) -> nn.Module:
    """The unsharded model on the meta device: shapes only, no memory."""
    config = build_model_config(family, flavor, n_layers)
    with torch.device("meta"):
        return config.build()
