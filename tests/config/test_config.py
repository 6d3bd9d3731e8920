"""Config parsing, CLI overrides, and every error path of load_config / resolve_degrees."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from torchtitan_autoparallel.config import JobConfig, accumulation_steps, load_config, parser, resolve_degrees
from torchtitan_autoparallel.config.job_config import SECTIONS
from torchtitan_autoparallel.errors import ConfigError, UserError

REPO = Path(__file__).resolve().parents[2]
LLAMA3 = REPO / "train_configs" / "llama3_debugmodel.toml"
QWEN3 = REPO / "train_configs" / "qwen3_debugmodel.toml"


def raises_config(match: str):
    return pytest.raises(ConfigError, match=match)


# --- the shipped configs -----------------------------------------------------


# the default job (run_train.sh's CONFIG_FILE) trains the planner's plan
@pytest.mark.parametrize("path,name,model", [(LLAMA3, "llama3", "llama3_auto_parallel"), (QWEN3, "qwen3", "qwen3")])
def test_shipped_configs_parse(path: Path, name: str, model: str) -> None:
    job = load_config([], config_file=str(path))
    assert job.job.config_file == str(path)
    assert job.job.dump_folder == f"./outputs/{name}_debugmodel"
    assert (job.model.name, job.model.flavor, job.model.tokenizer_path) == (model, "debugmodel", "default")
    t = job.training
    assert (t.steps, t.local_batch_size, t.seq_len, t.seed) == (30, 4, 256, 0)
    assert t.max_norm == 1.0 and isinstance(t.max_norm, float)
    assert (t.mixed_precision_param, t.mixed_precision_reduce, t.dataset) == ("float32", "float32", "default")
    p = job.parallelism
    assert (p.data_parallel_replicate_degree, p.data_parallel_shard_degree, p.tensor_parallel_degree) == (1, -1, 1)
    assert (job.optimizer.name, job.optimizer.lr) == ("AdamW", 8e-4)
    s = job.lr_scheduler
    assert (s.warmup_steps, s.decay_type, s.min_lr_factor) == (3, "linear", 0.1)
    assert (job.metrics.log_freq, job.metrics.enable_tensorboard, job.metrics.save_tb_folder) == (1, True, "tb")
    c = job.checkpoint
    assert (c.enable, c.folder, c.interval) == (False, "checkpoint", 10)
    assert job.activation_checkpoint.mode == "none"


def test_config_file_from_cli_override() -> None:
    job = load_config(["--job.config_file", str(QWEN3)])
    assert job.model.name == "qwen3" and job.job.config_file == str(QWEN3)


def test_defaults_without_a_file() -> None:
    job = load_config([])
    assert job == JobConfig()
    assert set(job.to_dict()) == set(SECTIONS)


def test_toml_int_is_accepted_for_a_float_key(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("[optimizer]\nlr = 1\n[metrics]\npeak_tflops = 2\n")
    job = load_config([], config_file=str(f))
    assert job.optimizer.lr == 1.0 and isinstance(job.optimizer.lr, float)
    assert job.metrics.peak_tflops == 2.0 and isinstance(job.metrics.peak_tflops, float)


# --- CLI overrides -----------------------------------------------------------


def test_cli_overrides_are_typed_like_toml_values() -> None:
    job = load_config(
        [
            "--training.steps", "5",
            "--training.deterministic", "true",
            "--optimizer.lr", "3e-4",
            "--metrics.enable_tensorboard", "false",
            "--parallelism.data_parallel_shard_degree", "-1",
            "--model.flavor", "debugmodel",
        ],
        config_file=str(LLAMA3),
    )
    assert job.training.steps == 5 and type(job.training.steps) is int
    assert job.training.deterministic is True
    assert job.optimizer.lr == 3e-4 and type(job.optimizer.lr) is float
    assert job.metrics.enable_tensorboard is False
    assert job.parallelism.data_parallel_shard_degree == -1
    # keys not overridden keep the TOML value
    assert job.training.seq_len == 256 and job.lr_scheduler.warmup_steps == 3


def test_cli_overrides_win_over_toml() -> None:
    job = load_config(["--training.seq_len", "64", "--model.name", "qwen3"], config_file=str(LLAMA3))
    assert job.training.seq_len == 64 and job.model.name == "qwen3"


def test_equals_form() -> None:
    job = load_config(["--training.steps=7", "--job.dump_folder=/tmp/a=b", "--optimizer.lr=1e-3"])
    assert job.training.steps == 7
    assert job.job.dump_folder == "/tmp/a=b"  # only the first '=' splits
    assert job.optimizer.lr == 1e-3


@pytest.mark.parametrize("text,value", [("true", True), ("False", False), ("1", True), ("0", False), ("yes", True), ("off", False)])
def test_bool_spellings(text: str, value: bool) -> None:
    assert load_config(["--training.deterministic", text]).training.deterministic is value


@pytest.mark.parametrize("text", ["none", "None", "null"])
def test_optional_float_accepts_none(text: str) -> None:
    job = load_config(["--metrics.peak_tflops", "5", "--metrics.peak_tflops", text])
    assert job.metrics.peak_tflops is None
    assert load_config(["--lr_scheduler.decay_ratio", "0.5"]).lr_scheduler.decay_ratio == 0.5


def test_torchtitan_flag_spellings() -> None:
    """tyro's forms, which torchtitan users type: a bool key alone, no- before it, hyphens."""
    job = load_config(
        ["--training.deterministic", "--training.steps", "4", "--compile.no-enable",
         "--parallelism.tensor-parallel-degree", "2", "--activation-checkpoint.mode", "full"]
    )
    assert job.training.deterministic is True and job.training.steps == 4
    assert job.compile.enable is False and job.parallelism.tensor_parallel_degree == 2
    assert job.activation_checkpoint.mode == "full"
    assert load_config(["--compile.enable", "--compile.no_enable"]).compile.enable is False
    assert load_config(["--training.steps", "2", "--autoparallel.overlap"]).autoparallel.overlap is True
    assert load_config(["--autoparallel.overlap", "false"]).autoparallel.overlap is False
    assert load_config(["--checkpoint.enable_checkpoint"]).checkpoint.enable is True  # renamed key


def test_flag_spellings_keep_their_errors() -> None:
    with raises_config(r"compile\.enable = 'maybe' in command line is not a valid bool"):
        load_config(["--compile.enable", "maybe"])
    with raises_config(r"override '--autoparallel\.mip_gap' has no value"):
        load_config(["--autoparallel.mip_gap", "--training.steps", "3"])
    with raises_config(r"parallelism\.enable_async_tensor_parallel = 'maybe' in command line is not a valid bool"):
        load_config(["--parallelism.enable_async_tensor_parallel", "maybe"])


def test_last_override_wins() -> None:
    assert load_config(["--training.steps", "3", "--training.steps", "4"]).training.steps == 4


# --- error paths -------------------------------------------------------------


def test_config_error_is_a_user_error() -> None:
    assert issubclass(ConfigError, UserError) and issubclass(ConfigError, ValueError)


def test_unknown_section_cli() -> None:
    with raises_config(r"unknown section \[trainer\] in command line") as e:
        load_config(["--trainer.steps", "3"])
    for section in SECTIONS:
        assert section in str(e.value)


def test_unknown_section_toml(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("[bogus]\nx = 1\n")
    with raises_config(r"unknown section \[bogus\] in .*bad\.toml.*known sections: job, model, training"):
        load_config([], config_file=str(f))


def test_unknown_key_lists_known_keys() -> None:
    with raises_config(r"unknown key training\.stepz in command line") as e:
        load_config(["--training.stepz", "3"])
    msg = str(e.value)
    assert "known keys of [training]" in msg
    for key in ("steps", "local_batch_size", "seq_len", "seed", "deterministic", "max_norm", "dataset_path"):
        assert re.search(rf"\b{key}\b", msg), key


def test_unknown_key_in_toml_names_the_file(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("[optimizer]\nlearning_rate = 1e-3\n")
    with raises_config(r"unknown key optimizer\.learning_rate in .*bad\.toml.*known keys of \[optimizer\]: name, lr, eps"):
        load_config([], config_file=str(f))


def test_section_that_is_not_a_table(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("training = 3\n")
    with raises_config(r"\[training\] .* must be a table"):
        load_config([], config_file=str(f))


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--training.steps", "five"], r"training\.steps = 'five' in command line is not a valid int"),
        (["--training.steps", "2.5"], r"training\.steps = '2\.5' .* not a valid int"),
        (["--optimizer.lr", "fast"], r"optimizer\.lr = 'fast' .* not a valid float"),
        (["--training.deterministic", "maybe"], r"training\.deterministic = 'maybe' .* not a valid bool"),
        (["--metrics.peak_tflops", "lots"], r"metrics\.peak_tflops = 'lots' .* not a valid float or none"),
    ],
)
def test_wrong_type_cli(argv: list[str], match: str) -> None:
    with raises_config(match):
        load_config(argv)


@pytest.mark.parametrize(
    "toml,match",
    [
        ('[training]\nsteps = "ten"\n', r"training\.steps = 'ten' in .* is not a valid int"),
        ("[training]\nsteps = 2.5\n", r"training\.steps = 2\.5 .* not a valid int"),
        ("[training]\nsteps = true\n", r"training\.steps = True .* not a valid int"),
        ("[optimizer]\nlr = \"1e-3\"\n", r"optimizer\.lr = '1e-3' .* not a valid float"),
        ("[metrics]\nenable_tensorboard = 1\n", r"metrics\.enable_tensorboard = 1 .* not a valid bool"),
        ("[model]\nname = 3\n", r"model\.name = 3 .* not a valid str"),
        # keys of neither schema, beside torchtitan's (compat.py)
        ("[float8]\nrecipe = 'rowwise'\n", r"unknown key float8\.recipe .* known keys of \[float8\]: enable_fsdp_float8_all_gather"),
        ("[training.dataloader]\nworkers = 2\n", r"unknown key training\.dataloader\.workers .* known keys of \[training\]: .*dataloader\.num_workers"),
    ],
)
def test_bad_toml_value(tmp_path: Path, toml: str, match: str) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(toml)
    with raises_config(match):
        load_config([], config_file=str(f))


def test_toml_syntax_error(tmp_path: Path) -> None:
    f = tmp_path / "broken.toml"
    f.write_text("[training]\nsteps = = 3\n")
    with raises_config(r"TOML syntax error in '.*broken\.toml'.*line 2"):
        load_config([], config_file=str(f))


def test_missing_config_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with raises_config(r"config file '.*nope\.toml' not found"):
        load_config([], config_file=str(missing))
    with raises_config(r"config file '.*nope\.toml' not found"):
        load_config(["--job.config_file", str(missing)])


@pytest.mark.parametrize(
    "argv,match",
    [
        (["steps", "3"], r"unexpected argument 'steps'; overrides look like --section\.key value"),
        (["--steps", "3"], r"unexpected argument '--steps'"),
        (["--training.steps"], r"override '--training\.steps' has no value"),
    ],
)
def test_malformed_arguments(argv: list[str], match: str) -> None:
    with raises_config(match):
        load_config(argv)


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--training.mixed_precision_param", "float16"], r"training\.mixed_precision_param = 'float16' is not accepted; accepted: float32, bfloat16"),
        (["--training.mixed_precision_reduce", "bfloat16"], r"training\.mixed_precision_reduce = 'bfloat16' .* accepted: float32"),
        (["--optimizer.name", "SGD"], r"optimizer\.name = 'SGD' .* accepted: AdamW, Adam"),
        (["--lr_scheduler.decay_type", "step"], r"lr_scheduler\.decay_type = 'step' .* accepted: linear, cosine, sqrt"),
        (["--activation_checkpoint.mode", "some"], r"activation_checkpoint\.mode = 'some' .* accepted: none, full, selective"),
        (["--autoparallel.solver", "greedy"], r"autoparallel\.solver = 'greedy' .* accepted: ilp"),
        (["--autoparallel.ilp_backend", "gurobi"], r"autoparallel\.ilp_backend = 'gurobi' .* accepted: highs, cbc"),
    ],
)
def test_bad_enum_values(argv: list[str], match: str) -> None:
    with raises_config(match):
        load_config(argv)


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--training.steps", "0"], r"training\.steps = 0 is too small; accepted: >= 1"),
        (["--training.local_batch_size", "0"], r"training\.local_batch_size = 0 is too small"),
        (["--training.seq_len", "1"], r"training\.seq_len = 1 is too small; accepted: >= 2"),
        (["--training.gc_freq", "0"], r"training\.gc_freq = 0 is too small; accepted: >= 1"),
        (["--training.full_init_max_gib", "-1"], r"training\.full_init_max_gib = -1\.0 is too small; accepted: >= 0"),
        (["--training.global_batch_size", "0"], r"training\.global_batch_size = 0 is too small; accepted: >= 1"),
        (["--optimizer.lr", "-1"], r"optimizer\.lr = -1\.0 is too small"),
        (["--lr_scheduler.decay_ratio", "1.5"], r"lr_scheduler\.decay_ratio = 1\.5; accepted: 0\.\.1 or none"),
        (["--lr_scheduler.min_lr_factor", "2"], r"lr_scheduler\.min_lr_factor = 2\.0; accepted: 0\.\.1"),
        (["--metrics.log_freq", "0"], r"metrics\.log_freq = 0 is too small"),
        (["--checkpoint.interval", "0"], r"checkpoint\.interval = 0 is too small"),
        (["--checkpoint.keep_latest_k", "-1"], r"checkpoint\.keep_latest_k = -1 is too small; accepted: >= 0"),
        (["--checkpoint.exclude_from_loading", "optimizer,model"], r"checkpoint\.exclude_from_loading item = 'model' is not accepted; accepted: optimizer, dataloader"),
        (["--compile.components", "model,optimizer"], r"compile\.components item = 'optimizer' is not accepted; accepted: model, loss"),
        (["--compile.backend", "tvm"], r"compile\.backend = 'tvm' is not accepted; accepted: inductor, aot_eager, eager"),
        (["--checkpoint.async_mode", "async_with_pinned_mem"], r"checkpoint\.async_mode = 'async_with_pinned_mem' is not accepted; accepted: disabled, async"),
        (["--checkpoint.export_dtype", "int8"], r"checkpoint\.export_dtype = 'int8' is not accepted; accepted: float32, bfloat16, float16"),
        (["--parallelism.tensor_parallel_degree", "0"], r"parallelism\.tensor_parallel_degree = 0 is too small"),
        (["--parallelism.data_parallel_replicate_degree", "0"], r"parallelism\.data_parallel_replicate_degree = 0"),
        (["--parallelism.data_parallel_shard_degree", "0"], r"parallelism\.data_parallel_shard_degree = 0 is too small"),
        (["--parallelism.data_parallel_shard_degree", "-2"], r"parallelism\.data_parallel_shard_degree = -2 is too small"),
    ],
)
def test_out_of_range_values(argv: list[str], match: str) -> None:
    with raises_config(match):
        load_config(argv)


@pytest.mark.parametrize("name", ["context_parallel_degree", "pipeline_parallel_degree"])
def test_context_and_pipeline_parallel_are_refused(name: str) -> None:
    with raises_config(rf"parallelism\.{name} = 2 is not supported yet; accepted: 1"):
        load_config([f"--parallelism.{name}", "2"])
    assert getattr(load_config([f"--parallelism.{name}", "1"]).parallelism, name) == 1


# --- degrees against the world size --------------------------------------------


def degrees(argv: list[str], world: int) -> tuple[int, int, int]:
    return resolve_degrees(load_config(argv), world)


def test_resolve_degrees_fills_in_shard() -> None:
    assert degrees([], 1) == (1, 1, 1)
    assert degrees([], 4) == (1, 4, 1)
    assert degrees(["--parallelism.tensor_parallel_degree", "2"], 4) == (1, 2, 2)
    assert degrees(["--parallelism.data_parallel_replicate_degree", "2"], 8) == (2, 4, 1)
    assert degrees(["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.tensor_parallel_degree", "2"], 8) == (2, 2, 2)
    assert degrees(["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"], 2) == (2, 1, 1)
    assert degrees(["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"], 4) == (1, 2, 2)


def test_degrees_not_dividing_ngpu() -> None:
    with raises_config(
        r"data_parallel_replicate_degree \(1\) x tensor_parallel_degree \(3\) = 3 does not divide NGPU=4"
    ):
        degrees(["--parallelism.tensor_parallel_degree", "3"], 4)
    with raises_config(r"\(2\) x tensor_parallel_degree \(2\) = 4 does not divide NGPU=2"):
        degrees(["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.tensor_parallel_degree", "2"], 2)


@pytest.mark.parametrize(
    "argv,world,product",
    [
        (["--parallelism.data_parallel_shard_degree", "2"], 4, 2),
        (["--parallelism.data_parallel_shard_degree", "4", "--parallelism.tensor_parallel_degree", "2"], 4, 8),
        (["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"], 1, 2),
    ],
)
def test_degrees_product_not_ngpu(argv: list[str], world: int, product: int) -> None:
    with raises_config(rf"= {product} do not match NGPU={world}; accepted: a product equal to {world}"):
        degrees(argv, world)


def test_accumulation_steps_from_the_global_batch() -> None:
    def steps(argv: list[str], world: int) -> int:
        job = load_config(argv)
        return accumulation_steps(job, resolve_degrees(job, world))

    assert steps(["--training.local_batch_size", "2"], 4) == 1  # -1: no accumulation
    assert steps(["--training.local_batch_size", "2", "--training.global_batch_size", "8"], 4) == 1
    assert steps(["--training.local_batch_size", "2", "--training.global_batch_size", "24"], 4) == 3
    # tensor-parallel ranks share a batch: only the data-parallel degree divides it
    tp = ["--parallelism.tensor_parallel_degree", "2"]
    assert steps(["--training.local_batch_size", "1", "--training.global_batch_size", "4", *tp], 4) == 2
    with raises_config(
        r"training\.global_batch_size = 6 is not a multiple of local_batch_size \(1\) x data-parallel "
        r"degree \(4\) = 4; accepted: -1 or a multiple of 4"
    ):
        steps(["--training.local_batch_size", "1", "--training.global_batch_size", "6"], 4)


def test_the_resolved_config_reloads_as_the_same_job(tmp_path: Path) -> None:
    from torchtitan_autoparallel.config.dump import write_resolved

    argv = [
        "--job.dump_folder", str(tmp_path / "run"), "--job.description", 'a "quoted" d\u00e9j\u00e0-vu\\path',
        "--model.name", "qwen3_auto_parallel", "--training.steps", "7", "--optimizer.lr", "3e-05",
        "--lr_scheduler.decay_ratio", "none", "--metrics.peak_tflops", "12.5", "--training.deterministic", "true",
        "--autoparallel.memory_budget_gib", "0.75", "--autoparallel.time_limit_s", "inf",
    ]
    job = load_config(argv, config_file=str(LLAMA3))
    path = write_resolved(job)
    assert path == tmp_path / "run" / "job_config.toml"
    again = load_config([], config_file=str(path))
    expected, got = job.to_dict(), again.to_dict()
    assert got["job"].pop("config_file") == str(path)
    expected["job"].pop("config_file")
    assert got == expected
    assert again.lr_scheduler.decay_ratio is None and again.autoparallel.time_limit_s == float("inf")


def test_a_list_key_reads_from_toml_and_the_command_line(tmp_path) -> None:
    from torchtitan_autoparallel.config.dump import to_toml

    toml = tmp_path / "job.toml"
    toml.write_text('[checkpoint]\nexclude_from_loading = ["optimizer"]\n')
    assert load_config(config_file=str(toml)).checkpoint.exclude_from_loading == ["optimizer"]
    cli = load_config(["--checkpoint.exclude_from_loading", "optimizer, dataloader"])
    assert cli.checkpoint.exclude_from_loading == ["optimizer", "dataloader"]
    assert 'exclude_from_loading = ["optimizer", "dataloader"]' in to_toml(cli)
    toml.write_text('[checkpoint]\nexclude_from_loading = "optimizer"\n')
    with raises_config(r"checkpoint\.exclude_from_loading = 'optimizer' in .* is not a valid list of str"):
        load_config(config_file=str(toml))


# --- torchtitan's own 2025 job files (compat.py) ---------------------------------

TORCHTITAN_STYLE = """
[job]
description = "a job file written for torchtitan"
print_args = false
use_for_integration_test = true

[metrics]
disable_color_printing = true

[model]
name = "llama3"
hf_assets_path = "./assets/hf/Llama-3.1-8B"
converters = []

[parallelism]
fsdp_reshard_after_forward = "always"
enable_async_tensor_parallel = false

[checkpoint]
enable_checkpoint = true

[activation_checkpoint]
mode = "selective"
selective_ac_option = "op"

[compile]
enable = false
components = ["model", "loss"]

[validation]
enabled = true

[float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = ["output"]
"""


def test_a_torchtitan_job_file_loads(tmp_path: Path) -> None:
    toml = tmp_path / "torchtitan.toml"
    toml.write_text(TORCHTITAN_STYLE)
    c = load_config(config_file=str(toml))
    assert c.checkpoint.enable is True  # enable_checkpoint, renamed since
    assert c.validation.enable is True  # validation.enabled, renamed since
    assert c.model.tokenizer_path == "./assets/hf/Llama-3.1-8B"  # the folder holding tokenizer.json
    assert c.parallelism.fsdp_reshard_after_forward == "always"
    assert c.activation_checkpoint.mode == "selective" and c.job.print_args is False


def test_torchtitan_keys_on_the_command_line(capsys, monkeypatch) -> None:
    monkeypatch.setattr(parser, "_SHOWN", set())  # each warning prints once per process
    assert load_config(["--parallelism.enable_async_tensor_parallel", "false"]).parallelism.tensor_parallel_degree == 1
    assert capsys.readouterr().err == ""
    load_config(["--parallelism.enable_async_tensor_parallel", "true"])  # accepted, with a warning
    assert "parallelism.enable_async_tensor_parallel = True in command line has no effect here" in capsys.readouterr().err
    assert load_config(["--checkpoint.enable_checkpoint", "true"]).checkpoint.enable is True
    with raises_config(r"parallelism\.fsdp_reshard_after_forward = 'sometimes' is not accepted; accepted: default, always, never"):
        load_config(["--parallelism.fsdp_reshard_after_forward", "sometimes"])
