"""The job configuration: torchtitan's 2025 TOML sections as typed dataclasses.

Section and key names follow torchtitan's old ``JobConfig`` so that existing
TOML files read the same; ``[autoparallel]`` is ours. This module imports
neither torch nor torchtitan, so checking a config is instant.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class Job:
    dump_folder: str = "./outputs"
    description: str = "torchtitan_autoparallel training job"
    config_file: str = ""
    print_args: bool = False  # log the resolved configuration (as TOML) at start-up


@dataclass
class Model:
    name: str = "llama3"
    flavor: str = "debugmodel"  # torchtitan's flavors of the model: debugmodel, 1B, 8B, 70B, ...
    # 0: the flavor's depth; N: only its first N transformer blocks (quick runs, planning studies)
    n_layers: int = 0
    tokenizer_path: str = "default"  # a tokenizer.json or a folder holding one; default: the shipped one


@dataclass
class Training:
    steps: int = 10
    local_batch_size: int = 8  # per data-parallel rank and micro-batch
    # -1: local_batch_size x dp degree; a multiple of that accumulates gradients
    # over global / (local x dp) micro-batches per optimizer step
    global_batch_size: int = -1
    gc_freq: int = 50  # steps between garbage collections, on every rank at once
    seq_len: int = 256
    seed: int = 0
    # A model of at most this many GiB of parameters is initialised whole on every
    # rank (the 1-rank weights, bit for bit); a larger planned model once on rank 0
    # and scattered (the same weights, train/initial.py), a larger hand-written one
    # by torchtitan's sharded init (other weights)
    full_init_max_gib: float = 2.0
    deterministic: bool = False  # deterministic kernels (torch.use_deterministic_algorithms)
    max_norm: float = 1.0  # gradient clipping by global norm
    mixed_precision_param: str = "float32"
    mixed_precision_reduce: str = "float32"
    # torch.set_float32_matmul_precision: high or medium run fp32 matmuls on GPU TF32
    # tensor cores (about 7x faster on an H100), and the planner prices them so
    float32_matmul_precision: str = "highest"
    # default (the shipped corpus), text, jsonl, or a Hugging Face dataset name (streamed)
    dataset: str = "default"
    dataset_path: str = ""  # the text/jsonl file or folder; a Hugging Face dataset's config name


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    data_parallel_shard_degree: int = -1  # -1: whatever the other degrees leave
    tensor_parallel_degree: int = 1
    context_parallel_degree: int = 1  # 1 only, for now
    pipeline_parallel_degree: int = 1  # 1 only, for now
    enable_sequence_parallel: bool = True
    # hand-written FSDP (torchtitan's): default, always or never free the gathered
    # weights after the forward; a planned model's plan decides that itself
    fsdp_reshard_after_forward: str = "default"


@dataclass
class Optimizer:
    name: str = "AdamW"
    lr: float = 8e-4
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.1


@dataclass
class LRScheduler:
    warmup_steps: int = 2
    decay_ratio: float | None = None  # None: decay over all steps after warm-up
    decay_type: str = "linear"
    min_lr_factor: float = 0.0


@dataclass
class Metrics:
    log_freq: int = 1
    enable_tensorboard: bool = False
    save_tb_folder: str = "tb"
    enable_wandb: bool = False  # rank 0 logs to Weights & Biases ($WANDB_PROJECT, WANDB_MODE=offline)
    peak_tflops: float | None = None  # None: device table on GPU, measured on CPU
    # CPU ranks: measure this step's peak of tensor memory (0: none), written to
    # <dump_folder>/tensor_memory_rank<r>.json; the profiler it uses slows that step
    tensor_memory_step: int = 0


@dataclass
class Checkpoint:
    enable: bool = False
    folder: str = "checkpoint"
    interval: int = 500
    load_step: int = -1  # -1: the latest step found in folder
    keep_latest_k: int = 10  # 0: keep every checkpoint
    # a step folder to start from when folder holds no checkpoint to resume
    initial_load_path: str = ""
    initial_load_model_only: bool = True  # its weights only: step 1, fresh optimizer and data
    initial_load_in_hf: bool = False  # initial_load_path holds Hugging Face safetensors
    # the save at the last step holds the weights only, in export_dtype (torchtitan's
    # default is true; ours keeps the last checkpoint resumable)
    last_save_model_only: bool = False
    last_save_in_hf: bool = False  # that save in Hugging Face's names and safetensors
    export_dtype: str = "float32"
    # what a resume leaves as a fresh run has it: optimizer (AdamW's moments), dataloader
    exclude_from_loading: list[str] = field(default_factory=list)
    enable_first_step_checkpoint: bool = False  # also save after step 1 (see a save work early)
    # a resume follows the learning-rate schedule saved with the checkpoint (its
    # training.steps and [lr_scheduler]) instead of new settings; the pre-launch check warns of a change
    keep_lr_schedule: bool = False
    # async: copy the state and write it in the background while training goes on
    async_mode: str = "disabled"


@dataclass
class Comm:
    # every collective's timeout during start-up; planning adds twice
    # autoparallel.time_limit_s, as the other ranks wait for rank 0's solve
    init_timeout_seconds: int = 300
    train_timeout_seconds: int = 100  # from the end of the first step on


@dataclass
class Profiling:
    enable_profiling: bool = False
    save_traces_folder: str = "profile_traces"
    profile_freq: int = 10  # trace every step that is a multiple of this
    enable_memory_snapshot: bool = False  # CUDA only
    save_memory_snapshot_folder: str = "memory_snapshot"


@dataclass
class Validation:
    enable: bool = False
    dataset: str = "default"  # as training.dataset
    dataset_path: str = ""
    freq: int = 10  # validate after step 1 and every freq-th step, as torchtitan
    # batches per validation; -1: one pass over a local dataset (default, text, jsonl)
    steps: int = 10
    # -1: training's; a planned model validates at the shape it was planned for only
    local_batch_size: int = -1
    seq_len: int = -1


@dataclass
class ActivationCheckpoint:
    mode: str = "none"


@dataclass
class Compile:
    # torch.compile, as torchtitan applies it: off by default, since compiled kernels
    # round differently from eager ones (losses agree to about 1e-6, not bit for bit)
    enable: bool = False
    # model: torchtitan's per-block compile (hand-written plans); loss: the loss function.
    # A planned model is one graph, model and loss together: either name compiles it
    # (with autoparallel.compile = true; the interpreter runs eager)
    components: list[str] = field(default_factory=lambda: ["model", "loss"])
    backend: str = "inductor"  # inductor, aot_eager or eager (the last two: debugging)


@dataclass
class AutoParallel:
    solver: str = "ilp"
    ilp_backend: str = "highs"
    time_limit_s: float = 300.0  # the solver's; reached, it returns its best plan with a certified gap
    memory_budget_gib: float | None = None  # the whole peak per device; None: weights sharded, the device less 10%
    overlap: bool = False  # price compute/communication overlap in the plan
    strided_sharding: bool = False  # let FSDP x TP shard one dimension twice (_StridedShard)
    optimality_check: bool = False  # solve the LP bound too and log the plan's certified gap
    # Stop the exact search once the plan is proven within this relative gap (0.01: 1%)
    # of the optimum; none: the ILP proves the optimum, the overlap MIP stops at 0.001
    mip_gap: float | None = None
    # Run the step as one graph over local tensors, re-traced from the planned
    # interpreter on the first step: no DTensor dispatch per op (execute/compiled.py).
    compile: bool = True
    # Reorder that graph so each collective is issued early and waited for late,
    # overlapping compute (execute/overlap.py). Needs compile; without it, no effect.
    overlap_execution: bool = True
    # Merge that graph's all-gathers and reduce-scatters into buckets of up to 32 MiB,
    # one call each, as FSDP and DDP do (execute/bucketing.py). Needs compile.
    bucket_collectives: bool = True
    plan_cache: bool = True  # reuse a plan (and compiled step) from <dump_folder>/plan_cache
    cost_profile: str = "auto"  # h100, h200, a100, cpu_gloo, or a calibrated .json profile; auto: by device
    export_problem: str = ""  # write the solver's problem (.npz) here for solver experiments
    report_warn_gib: float = 1.0  # plan.html warns of gathers materialising more per device


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    metrics: Metrics = field(default_factory=Metrics)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    profiling: Profiling = field(default_factory=Profiling)
    comm: Comm = field(default_factory=Comm)
    validation: Validation = field(default_factory=Validation)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    autoparallel: AutoParallel = field(default_factory=AutoParallel)

    def to_dict(self) -> dict:
        return {
            f.name: {g.name: getattr(getattr(self, f.name), g.name) for g in fields(getattr(self, f.name))}
            for f in fields(self)
        }


SECTIONS: tuple[str, ...] = tuple(f.name for f in fields(JobConfig))
