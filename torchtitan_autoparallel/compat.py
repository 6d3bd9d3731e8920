"""Everything that differs between the torch and torchtitan releases we support.

Supported: torch 2.11 to 2.15, each with the torchtitan that imports on it:
torchtitan 0.3 where torch has ``torch.distributed.fsdp.DataParallelMeshDims``
(torch 2.12 and later), torchtitan 0.2.2 on torch 2.11. Each difference is
found by looking for the feature, never by comparing version numbers, so a
release in between takes whichever path its features allow:

- torchtitan's model API. 0.3 builds a model from a config object
  (``llama3_configs[flavor]()``, ``config.layers``, ``config.build()``); 0.2
  from a dataclass of arguments (``llama3_args[flavor]``, ``Transformer(args)``).
  ``ModelConfig`` reads both the same way for the rest of the project.
- torchtitan's hand-written parallelisms (``models/parallelize.py``): 0.3
  takes its config pieces as keywords, 0.2 a whole ``JobConfig``.
- DTensor's sharding rules: torch 2.14 registers most ops as single-dim rules
  (``op_single_dim_strategy_funcs``), torch 2.11 only a few; the planner asks
  ``torch_single_dim_rule`` and otherwise follows the op's full-mesh strategy.
- ``torch.distributed.set_timeout`` (public in newer torch; torch 2.11 has
  the private ``_set_pg_timeout``).
- Activation checkpointing under ``make_fx``: ``torch.utils.checkpoint``
  takes any proxy mode for torch.compile's tracing, where a selective policy
  only tags nodes. Newer torch has ``torch.compiler._non_strict_tracing_context``
  to say the trace runs it for real; on torch 2.11 ``checkpoint_for_real``
  answers checkpoint's own question (``_is_compiling``) instead.

``check_versions`` is the gate: an unsupported pair ends in one line, before
any rank starts, instead of an ImportError somewhere inside torchtitan.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from types import ModuleType
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.utils.checkpoint as checkpoint_module
from torch import nn

from torchtitan_autoparallel.errors import UserError

TORCH_SUPPORTED = ((2, 11), (2, 15))  # first and last minor release, both included
TORCHTITAN_SUPPORTED = ((0, 2, 2), (0, 3, 99))
SUPPORTED = "torch 2.11 to 2.15 with torchtitan 0.3 (torch 2.12 and later) or torchtitan 0.2.2 (torch 2.11)"
FAMILIES = ("llama3", "qwen3")


class VersionError(UserError):
    """The installed torch or torchtitan is outside the supported range."""


def _release(version: str) -> tuple[int, ...]:
    """'2.11.0+cu130' -> (2, 11, 0); pre-releases count as their release."""
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3])


def installed(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_versions() -> None:
    """Raise ``VersionError`` (one line) unless torch and torchtitan are a supported pair
    and torchtitan's language models import on this torch."""
    torch_v, titan_v = installed("torch") or torch.__version__, installed("torchtitan")
    pair = f"torch {torch_v} with torchtitan {titan_v or '(not installed)'}"
    low, high = TORCH_SUPPORTED
    if not low <= _release(torch_v)[:2] <= high:
        raise VersionError(f"unsupported {pair}; supported: {SUPPORTED}")
    if titan_v is None or not TORCHTITAN_SUPPORTED[0] <= _release(titan_v) <= TORCHTITAN_SUPPORTED[1]:
        raise VersionError(f"unsupported {pair}; supported: {SUPPORTED}")
    try:
        for family in FAMILIES:
            import_model_module(f"torchtitan.models.{family}")
    except ImportError as err:
        raise VersionError(
            f"torchtitan {titan_v} does not import on torch {torch_v} ({err}); supported: {SUPPORTED}"
        ) from None


# ---------------------------------------------------------------- torch


def torch_single_dim_rule(op: object) -> Callable | None:
    """DTensor's single-mesh-dim sharding rule of ``op``, where this torch has one."""
    from torch.distributed.tensor import DTensor

    info = DTensor._op_dispatcher.sharding_propagator.op_single_dim_strategy_funcs.get(op)
    return info.func if info is not None else None


def set_timeout(timeout: timedelta, group: dist.ProcessGroup) -> None:
    """Set ``group``'s timeout for the collectives to come."""
    setter = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
    setter(timeout, group)


# ---------------------------------------------------------------- torchtitan's models


@contextmanager
def checkpoint_for_real() -> Iterator[None]:
    """``torch.utils.checkpoint`` saves and recomputes for real under ``make_fx`` (the
    module docstring), instead of tagging nodes for a compiler's partitioner."""
    flag = getattr(torch.compiler, "_non_strict_tracing_context", None)
    if flag is not None:
        with flag():
            yield
        return
    asked = checkpoint_module._is_compiling
    checkpoint_module._is_compiling = lambda func, args, kwargs: False
    try:
        yield
    finally:
        checkpoint_module._is_compiling = asked


def model_api() -> str:
    """'config' (torchtitan 0.3: models built from config objects) or 'args' (0.2)."""
    llama3 = import_model_module("torchtitan.models.llama3")
    return "config" if hasattr(llama3, "llama3_configs") else "args"


def import_model_module(name: str) -> ModuleType:
    """``importlib.import_module(name)`` with import-time ``torch.compile`` calls made lazy.

    torchtitan's attention module compiles FlexAttention when it is imported (a
    ``torch.compile`` class attribute), which imports inductor, about 0.5 s in
    every process, for a kernel the SDPA attention we use never calls; the
    compile now happens at the first call, if any.
    """
    real = torch.compile

    def deferred(model=None, **options):
        if model is None:  # used as @torch.compile(...)
            return lambda fn: deferred(fn, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = real(model, **options)
            return compiled(*args, **kwargs)

        return call

    torch.compile = deferred
    try:
        return importlib.import_module(name)
    finally:
        torch.compile = real


def _flavor_table(family: str) -> dict[str, Any]:
    """torchtitan's flavors of ``family``: name -> config factory (0.3) or args (0.2)."""
    module = import_model_module(f"torchtitan.models.{family}")
    table = getattr(module, f"{family}_configs", None) or getattr(module, f"{family}_args")
    # Mixture-of-experts flavors need expert parallelism, which we do not plan yet.
    return {k: v for k, v in table.items() if "moe" not in k and "-A" not in k}


def flavors(family: str) -> list[str]:
    return list(_flavor_table(family))


@dataclass
class ModelConfig:
    """One torchtitan model's config, read alike on torchtitan 0.2 and 0.3.

    ``native`` is torchtitan's own object (a config on 0.3, model args on 0.2),
    for the torchtitan functions that take it (state-dict adapters, parallelize).
    Attention is causal SDPA on both: it runs forward and backward on CPU and
    GPU, where torchtitan's default FlexAttention has no CPU backward.
    """

    family: str
    flavor: str
    native: Any

    @classmethod
    def of(cls, family: str, flavor: str) -> ModelConfig:
        """``flavor`` of ``family``; raises KeyError for a flavor torchtitan lacks."""
        entry = _flavor_table(family)[flavor]
        if callable(entry):  # 0.3: a factory; ask for flex, then swap each layer to SDPA
            from torchtitan.models.common.attention import ScaledDotProductAttention

            native = entry(attn_backend="flex")
            for layer in native.layers:
                layer.attention.inner_attention = ScaledDotProductAttention.Config()
        else:  # 0.2: a shared dataclass instance; copy it before changing it
            native = dataclasses.replace(entry, attn_type="sdpa", attn_mask_type="causal")
        return cls(family, flavor, native)

    @property
    def per_layer(self) -> bool:
        """torchtitan 0.3's form: a config per layer (``native.layers``); 0.2's is one flat set of args."""
        return hasattr(self.native, "layers")

    @property
    def n_layers(self) -> int:
        return len(self.native.layers) if self.per_layer else self.native.n_layers

    def truncate(self, n_layers: int) -> None:
        """Keep the first ``n_layers`` transformer blocks."""
        if self.per_layer:
            self.native.layers = self.native.layers[:n_layers]
        else:
            self.native.n_layers = n_layers

    @property
    def heads(self) -> tuple[int, int]:
        """(attention heads, key/value heads)."""
        attention = self.native.layers[0].attention if self.per_layer else self.native
        return attention.n_heads, attention.n_kv_heads or attention.n_heads

    @property
    def vocab_size(self) -> int:
        return self.native.vocab_size

    @property
    def max_seq_len(self) -> int:
        """The longest sequence the model's rotary embedding is built for (its cache's length)."""
        if self.per_layer:  # 0.3: each attention's RoPE config holds it
            return self.native.layers[0].attention.rope.max_seq_len
        return self.native.max_seq_len

    def fit_rope(self, seq_len: int) -> None:
        """Build the rotary embedding's cache for ``seq_len`` positions, not the flavor's maximum.

        torchtitan's own trainer does this (``update_from_config``); without it torchtitan 0.3
        keeps a cache of 131072 positions in every layer of a LLaMA3 (64 MiB a layer at 8B,
        2 GiB a device), which nothing reads past ``seq_len``. The cache is a non-persistent
        buffer whose first ``seq_len`` rows do not depend on its length: numerics and
        checkpoints are unchanged.
        """
        if self.per_layer:  # 0.3: a RoPE config per attention
            for layer in self.native.layers:
                layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=seq_len)
        else:
            self.native.max_seq_len = seq_len

    def build(self) -> nn.Module:
        """The model, on the current default device (build under ``torch.device("meta")``)."""
        if hasattr(self.native, "build"):
            return self.native.build()
        module = import_model_module(f"torchtitan.models.{self.family}")
        model_class = module.Transformer if self.family == "llama3" else module.Qwen3Model
        return model_class(self.native)

    def nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        return self.native.get_nparams_and_flops(model, seq_len)

    @property
    def output_name(self) -> str:
        """The output projection's module name (``lm_head`` on 0.3, ``output`` on 0.2)."""
        return "lm_head" if self.per_layer else "output"


def state_dict_adapter(config: ModelConfig):
    """torchtitan's Hugging Face state-dict adapter for ``config`` (no HF assets folder)."""
    name = {"llama3": "Llama3StateDictAdapter", "qwen3": "Qwen3StateDictAdapter"}[config.family]
    module = import_model_module(f"torchtitan.models.{config.family}")
    adapter = getattr(module, name, None)
    if adapter is None:  # 0.3 keeps it in a submodule it does not re-export
        adapter = getattr(importlib.import_module(f"{module.__name__}.state_dict_adapter"), name)
    return adapter(config.native, None)


# ---------------------------------------------------------------- torchtitan's hand-written parallelisms


@dataclass(frozen=True, kw_only=True)
class HandPlan:
    """What torchtitan's parallelize functions are told, in our terms."""

    degrees: tuple[int, int, int]  # (dp_replicate, dp_shard, tp)
    seq_len: int
    local_batch_size: int
    max_norm: float
    mixed_precision_param: str
    mixed_precision_reduce: str
    enable_sequence_parallel: bool
    fsdp_reshard_after_forward: str
    compile_enable: bool
    compile_components: tuple[str, ...]
    compile_backend: str
    ac_mode: str  # "none" | "full" | "selective" (per op)
    dump_folder: str


def _job_config_0_2(plan: HandPlan):
    """torchtitan 0.2's JobConfig for ``plan``: its parallelize functions read a whole one."""
    from torchtitan.config import JobConfig

    job = JobConfig()
    rep, shard, tp = plan.degrees
    p, t = job.parallelism, job.training
    p.data_parallel_replicate_degree, p.data_parallel_shard_degree, p.tensor_parallel_degree = rep, shard, tp
    p.enable_sequence_parallel = plan.enable_sequence_parallel
    p.fsdp_reshard_after_forward = plan.fsdp_reshard_after_forward
    t.seq_len, t.local_batch_size, t.max_norm = plan.seq_len, plan.local_batch_size, plan.max_norm
    t.mixed_precision_param, t.mixed_precision_reduce = plan.mixed_precision_param, plan.mixed_precision_reduce
    job.compile.enable, job.compile.components = plan.compile_enable, list(plan.compile_components)
    job.compile.backend = plan.compile_backend
    job.activation_checkpoint.mode = plan.ac_mode
    job.activation_checkpoint.selective_ac_option = "op"
    job.job.dump_folder = plan.dump_folder
    return job


def _configs_0_3(plan: HandPlan):
    """torchtitan 0.3's (parallelism, training, compile, activation checkpointing) configs."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    rep, shard, tp = plan.degrees
    parallelism = ParallelismConfig(
        data_parallel_replicate_degree=rep,
        data_parallel_shard_degree=shard,
        tensor_parallel_degree=tp,
        enable_sequence_parallel=plan.enable_sequence_parallel,
        fsdp_reshard_after_forward=plan.fsdp_reshard_after_forward,
        # DTensor on model-parallel axes only: the classic FSDP2 + TP stack.
        spmd_backend="partial_dtensor",
    )
    training = TrainingConfig(
        local_batch_size=plan.local_batch_size,
        seq_len=plan.seq_len,
        max_norm=plan.max_norm,
        mixed_precision_param=plan.mixed_precision_param,
        mixed_precision_reduce=plan.mixed_precision_reduce,
    )
    compile_config = CompileConfig(
        enable=plan.compile_enable, components=list(plan.compile_components), backend=plan.compile_backend
    )
    ac = {"none": None, "full": FullAC.Config(), "selective": SelectiveAC.Config()}[plan.ac_mode]
    return parallelism, training, compile_config, ac


def build_parallel_dims(plan: HandPlan, world_size: int):
    """torchtitan's ParallelDims for ``plan``, its meshes built."""
    from torchtitan.distributed import ParallelDims

    if hasattr(ParallelDims, "from_config"):  # 0.3
        dims = ParallelDims.from_config(_configs_0_3(plan)[0], world_size)
    else:
        rep, shard, tp = plan.degrees
        dims = ParallelDims(dp_replicate=rep, dp_shard=shard, cp=1, tp=tp, pp=1, ep=1, etp=1, world_size=world_size)
    dims.build_mesh()
    return dims


def prepare_model_config(config: ModelConfig, plan: HandPlan) -> None:
    """Let torchtitan fill what its TP plan reads from the model config (sequence length ...)."""
    if config.per_layer:  # 0.3
        from types import SimpleNamespace

        parallelism, training, _, _ = _configs_0_3(plan)
        config.native.update_from_config(config=SimpleNamespace(parallelism=parallelism, training=training))
    else:
        config.native.update_from_config(_job_config_0_2(plan))


def hand_parallelize(model: nn.Module, config: ModelConfig, plan: HandPlan, parallel_dims) -> nn.Module:
    """Apply torchtitan's own parallelize function of ``config.family`` to a meta-device model."""
    module = import_model_module(f"torchtitan.models.{config.family}")
    parallelize = module.parallelize_llama if config.family == "llama3" else module.parallelize_qwen3
    if not config.per_layer:  # 0.2
        return parallelize(model, parallel_dims, _job_config_0_2(plan))
    parallelism, training, compile_config, ac = _configs_0_3(plan)
    return parallelize(
        model,
        parallel_dims=parallel_dims,
        training=training,
        parallelism=parallelism,
        compile_config=compile_config,
        ac_config=ac,
        dump_folder=plan.dump_folder,
    )
