"""``./run_train.sh`` on bad input: one ``error:`` line, non-zero exit, no traceback.

These runs stop in the preflight check, before torchrun starts any rank, so
each costs only the interpreter's start-up and imports.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _run import LLAMA3_CONFIG, QWEN3_CONFIG, run_launcher

BAD_INPUTS = {
    # id: (ngpu, config, args, text the error line must contain)
    "unknown_model": (1, None, ["--model.name", "gpt5"], ["model.name", "'gpt5'", "llama3", "qwen3"]),
    "unknown_flavor": (1, None, ["--model.flavor", "tiny"], ["model.flavor", "'tiny'", "debugmodel"]),
    "unknown_flavor_qwen3": (1, QWEN3_CONFIG, ["--model.flavor", "tiny"], ["model.flavor", "'tiny'", "qwen3", "debugmodel"]),
    "n_layers_too_deep": (1, None, ["--model.n_layers", "7"], ["model.n_layers 7", "llama3 debugmodel", "1..6"]),
    "unknown_toml_key_cli": (1, None, ["--training.stepz", "3"], ["training.stepz", "known keys", "steps"]),
    "degrees_not_matching_ngpu": (
        2, None, ["--parallelism.data_parallel_shard_degree", "4"], ["shard 4", "NGPU=2"]
    ),
    "tp_not_dividing_ngpu": (4, None, ["--parallelism.tensor_parallel_degree", "3"], ["tensor_parallel_degree (3)", "NGPU=4"]),
    "tp_not_dividing_heads": (3, None, ["--parallelism.tensor_parallel_degree", "3"], ["tensor_parallel_degree 3", "heads"]),
    "context_parallel": (2, None, ["--parallelism.context_parallel_degree", "2"], ["context_parallel_degree = 2", "not supported"]),
    "missing_dataset_path": (
        1, None, ["--training.dataset", "text", "--training.dataset_path", "/nonexistent"], ["dataset_path", "'/nonexistent'"]
    ),
    "wrong_type": (1, None, ["--training.steps", "many"], ["training.steps", "'many'", "int"]),
    "bad_enum": (1, None, ["--optimizer.name", "SGD"], ["optimizer.name", "'SGD'", "AdamW"]),
    "missing_config_file": (1, "/nonexistent/job.toml", [], ["/nonexistent/job.toml", "not found"]),
    "ngpu_not_a_number": ("two", None, [], ["NGPU='two'"]),
    "missing_tokenizer": (
        1, None, ["--model.tokenizer_path", "/nonexistent/tok.json"], ["model.tokenizer_path", "'/nonexistent/tok.json'"]
    ),
    "export_problem_unwritable": (
        1, None, ["--model.name", "llama3_auto_parallel", "--autoparallel.export_problem", "/proc/x/p.npz"],
        ["autoparallel.export_problem '/proc/x/p.npz'", "cannot be written"],
    ),
    "global_batch_not_a_multiple": (
        2, None, ["--training.local_batch_size", "2", "--training.global_batch_size", "6"],
        ["training.global_batch_size = 6", "local_batch_size (2) x data-parallel degree (2) = 4", "a multiple of 4"],
    ),
    "seq_len_above_model_max": (
        1, None, ["--training.seq_len", "140000"], ["training.seq_len 140000", "llama3 debugmodel, 131072", "2..131072"]
    ),
    "validation_seq_len_above_model_max": (
        1, QWEN3_CONFIG, ["--validation.enable", "true", "--validation.seq_len", "4097"],
        ["validation.seq_len 4097", "qwen3 debugmodel, 4096", "2..4096"],
    ),
    "tensorboard_folder_unwritable": (
        1, None, ["--metrics.enable_tensorboard", "true", "--metrics.save_tb_folder", "/proc/tb"],
        ["metrics.save_tb_folder '/proc/tb'", "cannot be written"],
    ),
    "dump_folder_unwritable": (
        1, None, ["--job.dump_folder", "/proc/no-such-run"], ["job.dump_folder '/proc/no-such-run'", "cannot be written"]
    ),
}


def assert_one_error_line(run, must_contain: list[str]) -> None:
    assert run.returncode != 0, f"bad input was accepted\n{run.tail()}"
    assert "Traceback" not in run.stdout + run.stderr, f"traceback on bad input\n{run.tail()}"
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected exactly one stderr line, got {len(lines)}\n{run.tail()}"
    assert lines[0].startswith("error: "), run.tail()
    for text in must_contain:
        assert text in lines[0], f"{text!r} not named in: {lines[0]}"


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_gives_one_error_line(case: str, tmp_path: Path) -> None:
    ngpu, config, args, must_contain = BAD_INPUTS[case]
    run = run_launcher(
        ["--job.dump_folder", str(tmp_path / "out"), *args], ngpu=ngpu, config=config, timeout=180
    )
    assert_one_error_line(run, must_contain)
    # Stopped before torchrun: no rank started, nothing written.
    assert "[rank0]" not in run.stdout + run.stderr
    assert not (tmp_path / "out").exists()


def test_dump_folder_inside_a_file_is_refused(tmp_path: Path) -> None:
    afile = tmp_path / "notes.txt"
    afile.write_text("a file, not a folder\n")
    run = run_launcher(["--job.dump_folder", str(afile / "run")], timeout=180)
    assert_one_error_line(run, ["job.dump_folder", f"{str(afile)!r} is not a folder"])
    assert afile.read_text() == "a file, not a folder\n" and sorted(tmp_path.iterdir()) == [afile]


@pytest.mark.parametrize(
    "text,must_contain",
    [
        ("[training]\nsteps = = 3\n", ["TOML syntax error", "bad.toml"]),
        # appended to the shipped file, whose last table is [activation_checkpoint]
        ("bogus_key = 3\n", ["activation_checkpoint.bogus_key", "bad.toml", "known keys of [activation_checkpoint]"]),
        ("[trainer]\nsteps = 3\n", ["[trainer]", "known sections"]),
    ],
    ids=["toml_syntax_error", "unknown_toml_key", "unknown_toml_section"],
)
def test_bad_config_file(tmp_path: Path, text: str, must_contain: list[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(LLAMA3_CONFIG.read_text() + "\n" + text if "bogus" in text else text)
    run = run_launcher(["--job.dump_folder", str(tmp_path / "out")], config=bad, timeout=180)
    assert_one_error_line(run, must_contain)


def test_config_file_that_is_not_utf8(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"\xff\xfe[job]\n")  # UTF-16's byte-order mark: a file saved as UTF-16
    run = run_launcher(["--job.dump_folder", str(tmp_path / "out")], config=bad, timeout=180)
    assert_one_error_line(run, [f"config file {str(bad)!r} is not UTF-8", "byte 0xff at offset 0", "a UTF-8 TOML file"])


@pytest.mark.parametrize(
    "log_rank,must_contain",
    [("9", ["LOG_RANK='9'", "no rank 9 among the 2 launched", "0..1, comma-separated"]),
     ("0,2,-1", ["LOG_RANK='0,2,-1'", "no rank -1, 2 among"]),
     ("first", ["LOG_RANK='first' is not a list of ranks", "0..1"])],
    ids=["past_ngpu", "two_outside", "not_a_number"],
)
def test_log_rank_of_no_launched_rank_is_refused(tmp_path: Path, log_rank: str, must_contain: list[str]) -> None:
    """torchrun shows nothing for a rank it does not start: the job would run in silence."""
    run = run_launcher(["--job.dump_folder", str(tmp_path / "out")], ngpu=2, log_rank=log_rank, timeout=180)
    assert_one_error_line(run, must_contain)
    assert not (tmp_path / "out").exists()


def test_launched_ranks_and_known_comm_modes_are_accepted() -> None:
    from torchtitan_autoparallel.launch.preflight import parse_comm_mode, parse_log_ranks

    assert parse_log_ranks("0", 1) == {0} and parse_log_ranks("0,3", 4) == {0, 3}
    assert parse_comm_mode("") is False and parse_comm_mode("fake_backend") is True


def test_unknown_comm_mode_is_refused(tmp_path: Path) -> None:
    run = run_launcher(["--job.dump_folder", str(tmp_path / "out")], comm_mode="foo", timeout=180)
    assert_one_error_line(run, ["COMM_MODE='foo' is not accepted", "unset (real ranks) or fake_backend"])
    assert not (tmp_path / "out").exists()


def test_a_traceback_is_shown_only_when_asked_for(tmp_path: Path) -> None:
    quiet = run_launcher(["--job.dump_folder", str(tmp_path)], comm_mode="foo", timeout=180)
    asked = run_launcher(["--job.dump_folder", str(tmp_path)], comm_mode="foo", timeout=180,
                         env={"AUTOPARALLEL_TRACEBACK": "1"})
    assert "Traceback" not in quiet.stderr and "Traceback" in asked.stderr, asked.stderr
    assert quiet.stderr.strip().splitlines()[-1] == asked.stderr.strip().splitlines()[-1]
    assert asked.returncode == quiet.returncode == 2


def test_fake_backend_64_ranks_tensor_parallel(tmp_path: Path) -> None:
    run = run_launcher(
        ["--job.dump_folder", str(tmp_path / "out"), "--model.name", "llama3", "--parallelism.tensor_parallel_degree", "8",
         "--job.print_args", "true"],
        ngpu=64,
        comm_mode="fake_backend",
        timeout=300,
    )
    assert run.returncode == 0, run.tail()
    out = run.stdout + run.stderr
    assert "Traceback" not in out and "error:" not in out, run.tail()
    assert "on 64 cpu rank(s) (fake); replicate 1 x shard 8 x tensor 8" in out, run.tail()
    assert "configuration checked" in out, run.tail()
    # job.print_args: the resolved configuration, as the TOML written beside the run
    assert "configuration:\n# the resolved configuration" in out and "tensor_parallel_degree = 8" in out, run.tail()
    # The summary lists parameters sharded on both mesh axes (FSDP + TP).
    assert "parameters; placements of the first tensors" in out, run.tail()
    assert "Shard(dim=0)" in out, run.tail()
    # No training happened: no metrics written.
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "model,args,warning",
    [
        ("llama3", ["--autoparallel.memory_budget_gib", "0.5"],
         "warning: autoparallel.memory_budget_gib = 0.5 has no effect: model.name = 'llama3'"),
        ("qwen3", ["--autoparallel.solver", "approx", "--autoparallel.overlap", "true"],
         "warning: autoparallel.solver = 'approx', autoparallel.overlap = True have no effect"),
        ("llama3_auto_parallel", ["--autoparallel.memory_budget_gib", "0.5"], None),
        ("llama3", [], None),
    ],
)
def test_planner_settings_of_a_hand_written_plan_are_flagged(model, args, warning, capsys) -> None:
    """In the check, in this process: the planner's settings with a model it does not
    plan warn (one line, the job still runs); with a planned model, or unset, nothing."""
    from torchtitan_autoparallel.launch import preflight

    config = QWEN3_CONFIG if model.startswith("qwen3") else LLAMA3_CONFIG
    argv = ["--ngpu", "4", "--job.config_file", str(config), "--model.name", model, *args]
    assert preflight.main(argv) == 0
    err = capsys.readouterr().err
    if warning is None:
        assert err == ""
    else:
        assert err.startswith(warning) and err.count("\n") == 1, err
        assert "torchtitan's hand-written plan;" in err
        assert "llama3_auto_parallel, qwen3_auto_parallel" in err


def test_fsdp_reshard_setting_of_a_planned_model_is_flagged(capsys) -> None:
    from torchtitan_autoparallel.launch import preflight

    argv = ["--ngpu", "2", "--job.config_file", str(LLAMA3_CONFIG), "--model.name", "llama3_auto_parallel",
            "--parallelism.fsdp_reshard_after_forward", "never"]
    assert preflight.main(argv) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: parallelism.fsdp_reshard_after_forward = 'never' has no effect") and err.count("\n") == 1, err
    assert preflight.main([*argv[:-4], "--model.name", "llama3", "--parallelism.fsdp_reshard_after_forward", "never"]) == 0
    assert capsys.readouterr().err == ""  # torchtitan's FSDP reads it


def test_unknown_gloo_collectives_mode_is_refused(tmp_path: Path) -> None:
    run = run_launcher(
        ["--model.name", "llama3_auto_parallel", "--job.dump_folder", str(tmp_path / "out")],
        env={"AUTOPARALLEL_GLOO_COLLECTIVES": "overlapped"}, timeout=180,
    )
    assert_one_error_line(run, ["AUTOPARALLEL_GLOO_COLLECTIVES='overlapped'", "chained, queued, blocking, async"])
    assert not (tmp_path / "out").exists()


def test_cpu_ranks_share_the_cores_unless_the_user_chose(monkeypatch) -> None:
    from torchtitan_autoparallel.launch.launch import share_cpu_cores

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    env: dict[str, str] = {}
    share_cpu_cores(4, env)
    assert env == {"OMP_NUM_THREADS": "2", "TORCHINDUCTOR_COMPILE_THREADS": "2"}
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "6"}
    share_cpu_cores(16, env)  # more ranks than cores: one thread each, never zero
    assert env == {"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "6"}
