"""Model registry: names users type in ``[model] name`` mapped to torchtitan models.

The models themselves come from the ``torchtitan`` package; this module only
picks the config for a flavor (through ``torchtitan_autoparallel.compat``,
which reads every supported torchtitan alike and swaps in an attention backend
that runs on CPU), and records which names are planned automatically.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from torchtitan_autoparallel import compat
from torchtitan_autoparallel.compat import ModelConfig
from torchtitan_autoparallel.errors import ConfigError


@dataclass(frozen=True)
class ModelEntry:
    name: str
    family: str  # "llama3" | "qwen3"
    auto_parallel: bool  # True: the planner chooses every placement


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
    return compat.flavors(family)


def build_model_config(family: str, flavor: str, n_layers: int | None = None) -> ModelConfig:
    """torchtitan's model config for ``family``/``flavor``, with CPU-capable attention.

    ``n_layers`` truncates the stack (planning benchmarks use 2 or 8 layers of
    an 8B model; ``model.n_layers``); None or 0 keeps the flavor's depth.
    """
    try:
        config = ModelConfig.of(family, flavor)
    except KeyError:
        raise ConfigError(
            f"unknown model.flavor {flavor!r} for {family}; accepted: {', '.join(flavors(family))}"
        ) from None
    if n_layers:
        if not 1 <= n_layers <= config.n_layers:
            raise ConfigError(
                f"model.n_layers {n_layers} out of range for {family} {flavor}; "
                f"accepted: 0 (all {config.n_layers}) or 1..{config.n_layers}"
            )
        config.truncate(n_layers)
    return config


def build_meta_model(family: str, flavor: str, n_layers: int | None = None) -> nn.Module:
    """The unsharded model on the meta device: shapes only, no memory."""
    config = build_model_config(family, flavor, n_layers)
    with torch.device("meta"):
        return config.build()
