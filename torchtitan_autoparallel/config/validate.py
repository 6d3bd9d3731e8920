"""Value checks that need nothing but the config itself (no torch, no world size)."""

from __future__ import annotations

from torchtitan_autoparallel.config.job_config import JobConfig
from torchtitan_autoparallel.errors import ConfigError

DTYPES = ("float32", "bfloat16")
EXPORT_DTYPES = ("float32", "bfloat16", "float16")
EXCLUDABLE = ("optimizer", "dataloader")  # of a resume: the rest (weights, step) always loads
ASYNC_MODES = ("disabled", "async")  # torchtitan's async_with_pinned_mem: not yet
DECAY_TYPES = ("linear", "cosine", "sqrt")
AC_MODES = ("none", "full", "selective", "auto")
OPTIMIZERS = ("AdamW", "Adam")
SOLVERS = ("ilp", "approx", "auto")
ILP_BACKENDS = ("highs", "cbc")
COMPILE_COMPONENTS = ("model", "loss")
# torch.compile backends that run on any device with nothing more installed
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
RESHARD_AFTER_FORWARD = ("default", "always", "never")
# read whole into memory (c4_test: torchtitan's local test set); any other name is streamed
LOCAL_DATASETS = ("default", "text", "jsonl", "c4_test")


def _choice(name: str, value: str, accepted: tuple[str, ...]) -> None:
    if value not in accepted:
        raise ConfigError(f"{name} = {value!r} is not accepted; accepted: {', '.join(accepted)}")


def _at_least(name: str, value: float, low: float) -> None:
    if value < low:
        raise ConfigError(f"{name} = {value} is too small; accepted: >= {low}")


def validate(c: JobConfig) -> None:
    t = c.training
    _at_least("training.steps", t.steps, 1)
    _at_least("training.local_batch_size", t.local_batch_size, 1)
    if t.global_batch_size != -1:
        _at_least("training.global_batch_size", t.global_batch_size, 1)
    _at_least("training.seq_len", t.seq_len, 2)
    _at_least("training.gc_freq", t.gc_freq, 1)
    _at_least("training.full_init_max_gib", t.full_init_max_gib, 0)
    _at_least("training.max_norm", t.max_norm, 0)
    _choice("training.mixed_precision_param", t.mixed_precision_param, DTYPES)
    _choice("training.mixed_precision_reduce", t.mixed_precision_reduce, ("float32",))
    _choice("training.float32_matmul_precision", t.float32_matmul_precision, ("highest", "high", "medium"))
    _validate_parallelism(c)
    _choice("optimizer.name", c.optimizer.name, OPTIMIZERS)
    _at_least("optimizer.lr", c.optimizer.lr, 0)
    s = c.lr_scheduler
    _at_least("lr_scheduler.warmup_steps", s.warmup_steps, 0)
    _choice("lr_scheduler.decay_type", s.decay_type, DECAY_TYPES)
    if s.decay_ratio is not None and not 0 <= s.decay_ratio <= 1:
        raise ConfigError(f"lr_scheduler.decay_ratio = {s.decay_ratio}; accepted: 0..1 or none")
    if not 0 <= s.min_lr_factor <= 1:
        raise ConfigError(f"lr_scheduler.min_lr_factor = {s.min_lr_factor}; accepted: 0..1")
    _at_least("metrics.log_freq", c.metrics.log_freq, 1)
    _at_least("metrics.tensor_memory_step", c.metrics.tensor_memory_step, 0)
    if c.metrics.peak_tflops is not None:
        _at_least("metrics.peak_tflops", c.metrics.peak_tflops, 1e-9)
    _at_least("checkpoint.interval", c.checkpoint.interval, 1)
    _at_least("checkpoint.keep_latest_k", c.checkpoint.keep_latest_k, 0)
    _validate_checkpoint(c)
    _at_least("profiling.profile_freq", c.profiling.profile_freq, 1)
    _at_least("comm.init_timeout_seconds", c.comm.init_timeout_seconds, 1)
    _at_least("comm.train_timeout_seconds", c.comm.train_timeout_seconds, 1)
    _validate_validation(c)
    _choice("activation_checkpoint.mode", c.activation_checkpoint.mode, AC_MODES)
    for item in c.compile.components:
        _choice("compile.components item", item, COMPILE_COMPONENTS)
    _choice("compile.backend", c.compile.backend, COMPILE_BACKENDS)
    a = c.autoparallel
    _choice("autoparallel.solver", a.solver, SOLVERS)
    _choice("autoparallel.ilp_backend", a.ilp_backend, ILP_BACKENDS)
    _at_least("autoparallel.time_limit_s", a.time_limit_s, 1e-3)
    if a.memory_budget_gib is not None:
        _at_least("autoparallel.memory_budget_gib", a.memory_budget_gib, 1e-9)
    _at_least("autoparallel.report_warn_gib", a.report_warn_gib, 0)
    if a.mip_gap is not None and not 0 <= a.mip_gap < 1:
        raise ConfigError(
            f"autoparallel.mip_gap = {a.mip_gap} is not accepted; accepted: a relative gap "
            "in [0, 1) (0.01: stop within 1% of the optimum), or none"
        )


def _validate_checkpoint(c: JobConfig) -> None:
    k = c.checkpoint
    _choice("checkpoint.export_dtype", k.export_dtype, EXPORT_DTYPES)
    _choice("checkpoint.async_mode", k.async_mode, ASYNC_MODES)
    for item in k.exclude_from_loading:
        _choice("checkpoint.exclude_from_loading item", item, EXCLUDABLE)
    if k.last_save_in_hf and not k.last_save_model_only:
        raise ConfigError(
            "checkpoint.last_save_in_hf = true needs checkpoint.last_save_model_only = true "
            "(Hugging Face safetensors hold the weights only); accepted: both true, or "
            "last_save_in_hf = false"
        )
    if k.initial_load_in_hf and not (k.initial_load_path and k.initial_load_model_only):
        raise ConfigError(
            "checkpoint.initial_load_in_hf = true needs checkpoint.initial_load_path set and "
            "checkpoint.initial_load_model_only = true (Hugging Face safetensors hold the "
            "weights only); accepted: those, or initial_load_in_hf = false"
        )


def _validate_validation(c: JobConfig) -> None:
    v = c.validation
    _at_least("validation.freq", v.freq, 1)
    if v.local_batch_size != -1:
        _at_least("validation.local_batch_size", v.local_batch_size, 1)
    if v.seq_len != -1:
        _at_least("validation.seq_len", v.seq_len, 2)
    if v.steps != -1:
        _at_least("validation.steps", v.steps, 1)
    if v.enable and v.steps == -1 and v.dataset not in LOCAL_DATASETS:
        raise ConfigError(
            f"validation.steps = -1 (one pass) needs a local dataset, not {v.dataset!r}: "
            f"a streamed one has no known length; accepted: steps >= 1, or dataset one of "
            f"{', '.join(LOCAL_DATASETS)}"
        )


def _validate_parallelism(c: JobConfig) -> None:
    p = c.parallelism
    _at_least("parallelism.data_parallel_replicate_degree", p.data_parallel_replicate_degree, 1)
    _at_least("parallelism.tensor_parallel_degree", p.tensor_parallel_degree, 1)
    if p.data_parallel_shard_degree != -1:
        _at_least("parallelism.data_parallel_shard_degree", p.data_parallel_shard_degree, 1)
    _choice("parallelism.fsdp_reshard_after_forward", p.fsdp_reshard_after_forward, RESHARD_AFTER_FORWARD)
    for name in ("context_parallel_degree", "pipeline_parallel_degree"):
        value = getattr(p, name)
        if value != 1:
            raise ConfigError(
                f"parallelism.{name} = {value} is not supported yet; accepted: 1"
            )


def resolve_degrees(c: JobConfig, world_size: int) -> tuple[int, int, int]:
    """(dp_replicate, dp_shard, tp) for ``world_size`` ranks, with -1 filled in."""
    p = c.parallelism
    rep, tp = p.data_parallel_replicate_degree, p.tensor_parallel_degree
    shard = p.data_parallel_shard_degree
    if shard == -1:
        if world_size % (rep * tp):
            raise ConfigError(
                f"data_parallel_replicate_degree ({rep}) x tensor_parallel_degree ({tp}) "
                f"= {rep * tp} does not divide NGPU={world_size}; accepted: degrees whose "
                f"product divides {world_size}"
            )
        shard = world_size // (rep * tp)
    if rep * shard * tp != world_size:
        raise ConfigError(
            f"parallel degrees replicate {rep} x shard {shard} x tensor {tp} = "
            f"{rep * shard * tp} do not match NGPU={world_size}; accepted: a product "
            f"equal to {world_size} (data_parallel_shard_degree = -1 fills in the rest)"
        )
    return rep, shard, tp


def accumulation_steps(c: JobConfig, degrees: tuple[int, int, int]) -> int:
    """Micro-batches per optimizer step: global_batch_size / (local_batch_size x data-parallel degree)."""
    t = c.training
    micro = t.local_batch_size * degrees[0] * degrees[1]
    if t.global_batch_size == -1:
        return 1
    if t.global_batch_size % micro:
        raise ConfigError(
            f"training.global_batch_size = {t.global_batch_size} is not a multiple of "
            f"local_batch_size ({t.local_batch_size}) x data-parallel degree "
            f"({degrees[0] * degrees[1]}) = {micro}; accepted: -1 or a multiple of {micro}"
        )
    return t.global_batch_size // micro


def validation_shape(c: JobConfig) -> tuple[int, int]:
    """(local batch, sequence length) of the validation batches (-1: training's)."""
    v, t = c.validation, c.training
    return (
        t.local_batch_size if v.local_batch_size == -1 else v.local_batch_size,
        t.seq_len if v.seq_len == -1 else v.seq_len,
    )


def check_planned_validation_shape(c: JobConfig) -> None:
    """A planned step runs the batch shape it was planned for: validation must use it."""
    if not c.validation.enable:
        return
    t = c.training
    for key, value, trained in zip(("local_batch_size", "seq_len"), validation_shape(c), (t.local_batch_size, t.seq_len)):
        if value != trained:
            raise ConfigError(
                f"validation.{key} = {value} differs from training.{key} = {trained}, and model.name = "
                f"{c.model.name!r} validates with the step planned for the training shape; "
                f"accepted: -1 or {trained}"
            )
