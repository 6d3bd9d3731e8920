"""torchtitan's job-file keys that this trainer reads under another name, or only accepts.

A job file written for torchtitan (0.2.2, the last version that reads TOML, or
the mid-2025 files before it) loads as it is. Every key falls in one of:

- honoured: the key is ours too, same section and name (``job_config.py``);
- ``MAPPED``: we have the setting under another name, and read it there;
- ``ACCEPTED``: a feature this trainer lacks. The key is accepted; where its
  value would make torchtitan behave differently from this run, one warning
  says what torchtitan would do and that it has no effect here.

A key in none of them is an error naming the known keys. The one table keeps
the knowledge in one place: docs/torchtitan_keys.md is generated from it
(``tt_keys_doc.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# torchtitan's key -> ours (both dotted)
MAPPED: dict[str, str] = {
    "job.print_config": "job.print_args",  # 0.2's name
    "model.hf_assets_path": "model.tokenizer_path",  # a folder holding tokenizer.json
    "debug.seed": "training.seed",  # 0.2 moved both to [debug]
    "debug.deterministic": "training.deterministic",
    "checkpoint.enable_checkpoint": "checkpoint.enable",  # mid-2025 names from here on
    "checkpoint.initial_load_model_weights_only": "checkpoint.initial_load_model_only",
    "checkpoint.last_save_model_weights_only": "checkpoint.last_save_model_only",
    "checkpoint.model_weights_only": "checkpoint.last_save_model_only",
    "validation.enabled": "validation.enable",
    "training.compile": "compile.enable",
    "training.batch_size": "training.local_batch_size",
    "lr_scheduler.lr_min": "lr_scheduler.min_lr_factor",
}

Lookup = Callable[[str], Any]  # a dotted key's value in the job being loaded


@dataclass(frozen=True)
class Accepted:
    """A torchtitan key without a feature here.

    ``same``: the value at which torchtitan would do what this trainer does (mostly
    its default, the feature off); ``does``: what torchtitan does with the key;
    ``matters``: whether the key is read at all given the rest of the job (float8
    details only with a float8 converter), None: always.
    """

    same: Any
    does: str
    matters: Callable[[Lookup], bool] | None = None

    @property
    def hint(self) -> Any:
        """The type a command-line value is read as."""
        if isinstance(self.same, list):
            return list[str]
        return str if self.same is None else type(self.same)

    def warns(self, value: Any, get: Lookup) -> bool:
        return value != self.same and (self.matters is None or self.matters(get))


def _converted(get: Lookup) -> bool:
    return bool(get("model.converters"))


def _selective(get: Lookup) -> bool:
    return get("activation_checkpoint.mode") == "selective"


def _never(get: Lookup) -> bool:  # the key changes nothing about training in torchtitan either
    return False


def _above_one(key: str) -> Callable[[Lookup], bool]:
    return lambda get: get(key) > 1


def _enabled(key: str) -> Callable[[Lookup], bool]:
    return lambda get: bool(get(key))


_FLOAT8 = "is read by the float8 converter (model.converters), which is not supported here"
_MX = "is read by the MX converter (model.converters), which is not supported here"
_PP = "shapes pipeline parallelism, which is not supported here (pipeline_parallel_degree = 1)"
_CP = "shapes context parallelism, which is not supported here (context_parallel_degree = 1)"
_FT = "configures torchft fault tolerance (fault_tolerance.enable), not supported here"
_PIPELINED = _above_one("parallelism.pipeline_parallel_degree")  # refused here: never
_CONTEXT = _above_one("parallelism.context_parallel_degree")  # refused here: never
_LOADER = "sets the torch DataLoader's {}; the loader here is in-process and deterministic"

ACCEPTED: dict[str, Accepted] = {
    "job.save_config_file": Accepted(None, "writes the resolved configuration to that file; here it is always <dump_folder>/job_config.toml"),
    "job.custom_config_module": Accepted("", "imports that module to extend JobConfig with its own keys"),
    "job.use_for_integration_test": Accepted(False, "marks the file for torchtitan's own integration tests", _never),
    "profiling.profiler_active": Accepted(1, "sets how many steps each profiler trace records; here one"),
    "profiling.profiler_warmup": Accepted(3, "sets the profiler's warm-up steps before a trace; here up to 3"),
    "metrics.disable_color_printing": Accepted(False, "turns off colours in the console log; here it has none", _never),
    "metrics.save_for_all_ranks": Accepted(False, "writes TensorBoard/W&B logs on every rank; here rank 0 writes them"),
    "model.converters": Accepted([], "swaps modules for float8 or MX training (torchao), which is not supported here"),
    "model.print_after_conversion": Accepted(False, "prints the model after its converters ran", _never),
    "optimizer.implementation": Accepted("fused", "picks AdamW's kernel (for-loop, foreach, fused); here torch's default, the same arithmetic"),
    "optimizer.early_step_in_backward": Accepted(False, "steps each parameter's optimizer during the backward to free gradients early"),
    "lr_scheduler.total_steps": Accepted(None, "sets the schedule's length apart from training.steps; here it is training.steps"),
    "training.enable_cpu_offload": Accepted(False, "offloads parameters, gradients and optimizer state to the CPU (FSDP2)"),
    "training.dtype": Accepted("float32", "sets the model's parameter dtype outside FSDP's mixed precision; here mixed_precision_param"),
    "training.gc_debug": Accepted(False, "collects garbage every step to find reference cycles"),
    "training.dataloader.num_workers": Accepted(0, _LOADER.format("worker processes")),
    "training.dataloader.persistent_workers": Accepted(False, _LOADER.format("persistent workers")),
    "training.dataloader.pin_memory": Accepted(False, _LOADER.format("pinned memory")),
    "training.dataloader.prefetch_factor": Accepted(None, _LOADER.format("prefetching")),
    "parallelism.disable_loss_parallel": Accepted(False, "computes the loss on the TP-sharded logits unless set; here the plan decides"),
    "parallelism.enable_async_tensor_parallel": Accepted(False, "overlaps TP's collectives with its matmuls (symmetric memory); not supported here"),
    "parallelism.enable_compiled_autograd": Accepted(False, "compiles the backward with compiled autograd"),
    "parallelism.module_fqns_per_model_part": Accepted(None, _PP, _PIPELINED),
    "parallelism.pipeline_parallel_first_stage_less_layers": Accepted(1, _PP, _PIPELINED),
    "parallelism.pipeline_parallel_last_stage_less_layers": Accepted(1, _PP, _PIPELINED),
    "parallelism.pipeline_parallel_layers_per_stage": Accepted(None, _PP, _PIPELINED),
    "parallelism.pipeline_parallel_schedule": Accepted("1F1B", _PP, _PIPELINED),
    "parallelism.pipeline_parallel_schedule_csv": Accepted("", _PP, _PIPELINED),
    "parallelism.pipeline_parallel_microbatch_size": Accepted(1, _PP, _PIPELINED),
    "parallelism.pipeline_parallel_expert_parallel_overlap": Accepted(True, _PP, _PIPELINED),
    "parallelism.pipeline_parallel_split_points": Accepted([], _PP, _PIPELINED),
    "parallelism.context_parallel_load_balancer": Accepted("headtail", _CP, _CONTEXT),
    "parallelism.context_parallel_rotate_method": Accepted("allgather", _CP, _CONTEXT),
    "parallelism.expert_parallel_degree": Accepted(1, "shards MoE experts; the models here are dense"),
    "parallelism.expert_tensor_parallel_degree": Accepted(1, "tensor-shards MoE experts; the models here are dense"),
    "parallelism.expert_parallel_comm_backend": Accepted("standard", "picks MoE's all-to-all (DeepEP); the models here are dense"),
    "checkpoint.enable_ft_dataloader_checkpoints": Accepted(True, "saves per-replica loader state for torchft", _enabled("fault_tolerance.enable")),
    "checkpoint.initial_load_in_hf_quantized": Accepted(False, "loads quantized Hugging Face weights (dequantizing them)"),
    "checkpoint.create_seed_checkpoint": Accepted(False, "writes step 0's weights on one rank and exits, to seed pipeline-parallel runs"),
    "checkpoint.load_only": Accepted(False, "loads a checkpoint but never saves one"),
    "activation_checkpoint.selective_ac_option": Accepted(
        "op", "checkpoints every N-th block ('N') or by its per-op policy ('op'); here selective is the per-op policy", _selective
    ),
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": Accepted(
        ["moe.router.gate"], "recomputes these modules' matmuls under the per-op policy (MoE routers)", _selective
    ),
    "activation_checkpoint.early_stop": Accepted(False, "stops a checkpointed block's recomputation once its needed outputs exist"),
    "activation_checkpoint.memory_budget": Accepted(0.5, "is the budget of mode = 'memory_budget', not supported here", _never),
    "activation_checkpoint.visualize_memory_budget_pareto": Accepted(False, "plots mode = 'memory_budget''s trade-off, not supported here", _never),
    "activation_checkpoint.preserve_rng_state": Accepted(True, "replays the RNG state in recomputation; here always"),
    "activation_checkpoint.determinism_check": Accepted("default", "checks recomputed tensors against the forward's"),
    "activation_checkpoint.debug": Accepted(False, "logs the recomputation", _never),
    "quantize.linear.float8.enable_fsdp_float8_all_gather": Accepted(False, _FLOAT8, _converted),
    "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp": Accepted(False, _FLOAT8, _converted),
    "quantize.linear.float8.recipe_name": Accepted(None, _FLOAT8, _converted),
    "quantize.linear.float8.filter_fqns": Accepted([], _FLOAT8, _converted),
    "quantize.linear.float8.emulate": Accepted(False, _FLOAT8, _converted),
    "quantize.linear.mx.mxfp8_dim1_cast_kernel_choice": Accepted("triton", _MX, _converted),
    "quantize.linear.mx.recipe_name": Accepted("mxfp8_cublas", _MX, _converted),
    "quantize.linear.mx.filter_fqns": Accepted(["output"], _MX, _converted),
    "quantize.grouped_mm.float8.fqns": Accepted([], _FLOAT8 + " (MoE grouped matmuls)", _converted),
    "quantize.grouped_mm.mx.recipe_name": Accepted("mxfp8", _MX + " (MoE grouped matmuls)", _converted),
    "quantize.grouped_mm.mx.fqns": Accepted([], _MX + " (MoE grouped matmuls)", _converted),
    "float8.enable_fsdp_float8_all_gather": Accepted(False, _FLOAT8, _converted),  # mid-2025 [float8]
    "float8.precompute_float8_dynamic_scale_for_fsdp": Accepted(False, _FLOAT8, _converted),
    "float8.recipe_name": Accepted(None, _FLOAT8, _converted),
    "float8.filter_fqns": Accepted([], _FLOAT8, _converted),
    "float8.emulate": Accepted(False, _FLOAT8, _converted),
    "float8.force_recompute_fp8_weight_in_bwd": Accepted(False, _FLOAT8, _converted),
    "mx.recipe_name": Accepted("mxfp8", _MX, _converted),
    "mx.filter_fqns": Accepted(["output"], _MX, _converted),
    "mx.use_fp8_dim1_cast_triton_kernel": Accepted(True, _MX, _converted),
    "comm.trace_buf_size": Accepted(20000, "sizes the NCCL flight recorder's buffer"),
    "comm.save_traces_folder": Accepted("comm_traces", "is where the NCCL flight recorder writes"),
    "comm.save_traces_file_prefix": Accepted("rank_", "names the NCCL flight recorder's files"),
    "comm.mode": Accepted(
        "default", "runs without real communication (fake_backend: a dry run; local_tensor); "
        "here the environment does that: COMM_MODE=fake_backend ./run_train.sh"
    ),
    "memory_estimation.enable": Accepted(False, "estimates memory under FakeTensorMode before training; here the plan's check does"),
    "memory_estimation.enabled": Accepted(False, "estimates memory under FakeTensorMode before training; here the plan's check does"),
    "memory_estimation.disable_fake_mode": Accepted(False, "runs that estimate on real tensors", _enabled("memory_estimation.enable")),
    "fault_tolerance.enable": Accepted(False, "replicates training with torchft so that a lost replica does not stop the job"),
    "fault_tolerance.process_group": Accepted("gloo", _FT, _enabled("fault_tolerance.enable")),
    "fault_tolerance.process_group_timeout_ms": Accepted(10000, _FT, _enabled("fault_tolerance.enable")),
    "fault_tolerance.replica_id": Accepted(0, _FT, _enabled("fault_tolerance.enable")),
    "fault_tolerance.group_size": Accepted(0, _FT, _enabled("fault_tolerance.enable")),
    "fault_tolerance.min_replica_size": Accepted(1, _FT, _enabled("fault_tolerance.enable")),
    "fault_tolerance.semi_sync_method": Accepted(None, _FT, _enabled("fault_tolerance.enable")),
    "fault_tolerance.sync_steps": Accepted(5, _FT, _enabled("fault_tolerance.enable")),
    "fault_tolerance.should_quantize": Accepted(False, _FT, _enabled("fault_tolerance.enable")),
    "fault_tolerance.fragment_sync_delay": Accepted(0, _FT, _enabled("fault_tolerance.enable")),
    "fault_tolerance.fragment_update_alpha": Accepted(0.0, _FT, _enabled("fault_tolerance.enable")),
    "experimental.custom_import": Accepted("", "imports that module first (to register a model of one's own); here model.name picks one of ours"),
    "experimental.custom_args_module": Accepted("", "imports that module to extend JobConfig with its own keys"),
    "validation.dataloader.num_workers": Accepted(0, _LOADER.format("worker processes")),
    "validation.dataloader.persistent_workers": Accepted(False, _LOADER.format("persistent workers")),
    "validation.dataloader.pin_memory": Accepted(False, _LOADER.format("pinned memory")),
    "validation.dataloader.prefetch_factor": Accepted(None, _LOADER.format("prefetching")),
    "debug.deterministic_warn_only": Accepted(False, "warns instead of failing on a non-deterministic op", _enabled("training.deterministic")),
    "debug.moe_force_load_balance": Accepted(False, "routes MoE tokens round-robin for benchmarking; the models here are dense"),
}

# sections only torchtitan has, such as [quantize] or the mid-2025 [float8]
ACCEPTED_SECTIONS: tuple[str, ...] = tuple(dict.fromkeys(k.split(".")[0] for k in ACCEPTED))
