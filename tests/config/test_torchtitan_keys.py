"""torchtitan's job files load unchanged (config/compat.py): every key of 0.2.2's
JobConfig and the mid-2025 names is honoured, mapped or accepted with a warning."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from torchtitan_autoparallel.config import load_config, parser
from torchtitan_autoparallel.config.compat import ACCEPTED, MAPPED
from torchtitan_autoparallel.config.torchtitan_keys import TORCHTITAN_0_2_2
from torchtitan_autoparallel.config.tt_keys_doc import classify, render
from torchtitan_autoparallel.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
THEIR_FILES = REPO / "experiments" / "tt_configs" / "torchtitan"
SMOKE_SOURCE = REPO / ".venv-smoke" / "lib" / "python3.11" / "site-packages" / "torchtitan" / "config" / "job_config.py"


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(parser, "_SHOWN", set())  # each warning prints once per process
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv(parser._LAUNCHER_ENV, raising=False)


def toml_of(flat: dict[str, object]) -> str:
    """A TOML file of dotted keys, nested tables as torchtitan writes them."""
    tables: dict[str, list[str]] = {}
    for key, value in flat.items():
        if value is not None:  # TOML has no null: torchtitan's None defaults are left out
            table, _, name = key.rpartition(".")
            tables.setdefault(table, []).append(f"{name} = {json.dumps(value)}")
    return "\n".join(f"[{t}]\n" + "\n".join(lines) + "\n" for t, lines in tables.items())


def warnings_of(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warning: ")]


def test_every_key_of_0_2_2_is_honoured_mapped_or_accepted() -> None:
    assert len(TORCHTITAN_0_2_2) == 149
    assert {k: classify(k) for k in TORCHTITAN_0_2_2 if classify(k) == "unknown"} == {}


def test_a_file_of_every_0_2_2_key_at_its_default_loads(tmp_path: Path, capsys) -> None:
    f = tmp_path / "all_keys.toml"
    f.write_text(toml_of(TORCHTITAN_0_2_2))
    job = load_config(config_file=str(f))
    assert job.model.tokenizer_path == "./tests/assets/tokenizer"  # hf_assets_path
    assert job.training.mixed_precision_param == "bfloat16" and job.training.steps == 10000
    assert job.activation_checkpoint.mode == "selective" and job.validation.dataset == "c4_validation"
    # torchtitan's defaults switch its features off, but for selective AC every 2nd block
    assert warnings_of(capsys.readouterr().err) == [
        f"warning: activation_checkpoint.selective_ac_option = '2' in {f} has no effect here; in torchtitan it "
        + ACCEPTED["activation_checkpoint.selective_ac_option"].does
    ]


def test_mapped_keys_set_ours(tmp_path: Path) -> None:
    f = tmp_path / "mapped.toml"
    f.write_text(
        '[job]\nprint_config = true\n[model]\nhf_assets_path = "hf/Llama"\n[debug]\nseed = 7\ndeterministic = true\n'
        "[checkpoint]\nenable_checkpoint = true\nmodel_weights_only = true\n[training]\nbatch_size = 3\ncompile = true\n"
        "[lr_scheduler]\nlr_min = 0.1\n"
    )
    job = load_config(config_file=str(f))
    assert job.job.print_args and job.model.tokenizer_path == "hf/Llama" and job.training.seed == 7
    assert job.training.deterministic and job.checkpoint.enable and job.checkpoint.last_save_model_only
    assert job.training.local_batch_size == 3 and job.compile.enable and job.lr_scheduler.min_lr_factor == 0.1
    assert len(MAPPED) == 12


def test_mapped_and_accepted_keys_on_the_command_line(capsys) -> None:
    job = load_config(["--debug.seed", "5", "--job.print_config", "--quantize.linear.float8.emulate"])
    assert job.training.seed == 5 and job.job.print_args is True
    assert warnings_of(capsys.readouterr().err) == []  # float8 details without a float8 converter: torchtitan ignores them too
    load_config(["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.recipe_name", "rowwise"])
    lines = warnings_of(capsys.readouterr().err)
    assert [line.split(" = ")[0] for line in lines] == ["warning: model.converters", "warning: quantize.linear.float8.recipe_name"]
    assert "model.converters = ['quantize.linear.float8'] in command line has no effect here; in torchtitan it swaps" in lines[0]


def test_a_value_of_the_wrong_type_is_still_refused() -> None:
    with pytest.raises(ConfigError, match=r"debug\.seed = 'x' in command line is not a valid int"):
        load_config(["--debug.seed", "x"])
    with pytest.raises(ConfigError, match=r"comm\.trace_buf_size = 'big' in command line is not a valid int"):
        load_config(["--comm.trace_buf_size", "big"])


def test_a_key_of_neither_schema_lists_the_known_keys() -> None:
    with pytest.raises(ConfigError, match=r"unknown key quantize\.linear\.float9\.emulate in command line; known keys of \[quantize\]: linear\.float8\.enable_fsdp"):
        load_config(["--quantize.linear.float9.emulate", "true"])
    with pytest.raises(ConfigError, match=r"unknown section \[debugging\] .* known sections: .*autoparallel, quantize, .*debug"):
        load_config(["--debugging.seed", "1"])


@pytest.mark.parametrize("rank,launched,shown", [("0", False, True), ("1", False, False), ("0", True, False)])
def test_each_warning_is_printed_once_per_job(monkeypatch, capsys, rank: str, launched: bool, shown: bool) -> None:
    """The launcher prints them; its ranks, which load the same file, do not (nor ranks but 0 elsewhere)."""
    monkeypatch.setenv("RANK", rank)
    if launched:
        monkeypatch.setenv(parser._LAUNCHER_ENV, "1")
    argv = ["--parallelism.enable_async_tensor_parallel", "true"]
    load_config(argv)
    load_config(argv)  # a fake-backend run loads again in the launcher's process
    assert len(warnings_of(capsys.readouterr().err)) == (1 if shown else 0)


EXPECTED_WARNINGS = {
    "llama3_debug_model_mid2025.toml": ["activation_checkpoint.selective_ac_option"],
    "llama3_debug_model_0.2.toml": ["activation_checkpoint.selective_ac_option"],
    "llama3_70b_mid2025.toml": [],
    "qwen3_0.6b.toml": [],
    "qwen3_1.7b.toml": [],
}


@pytest.mark.parametrize("name", sorted(EXPECTED_WARNINGS))
def test_torchtitans_own_train_configs_load_as_written(name: str, capsys) -> None:
    job = load_config(config_file=str(THEIR_FILES / name))
    assert job.model.name in ("llama3", "qwen3")
    warned = [line.split(" = ")[0].removeprefix("warning: ") for line in warnings_of(capsys.readouterr().err)]
    assert warned == EXPECTED_WARNINGS[name]


def test_the_key_page_is_current() -> None:
    page = REPO / "docs" / "torchtitan_keys.md"
    assert page.read_text() == render(), "run: python -m torchtitan_autoparallel.config.tt_keys_doc > docs/torchtitan_keys.md"
    for key in (*MAPPED, *ACCEPTED, *TORCHTITAN_0_2_2):
        assert f"`{key}`" in page.read_text(), key
    assert "docs/torchtitan_keys.md" in (REPO / "README.md").read_text()


def _dataclass_keys(source: str) -> list[str]:
    """Dotted field names of torchtitan's JobConfig, read from its source without importing it."""
    classes = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)}

    def walk(cls: str, prefix: str) -> list[str]:
        keys = []
        for node in classes[cls].body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                factory = next((kw.value for kw in getattr(node.value, "keywords", []) if kw.arg == "default_factory"), None)
                if isinstance(factory, ast.Name) and factory.id in classes:
                    keys += walk(factory.id, f"{prefix}{node.target.id}.")
                else:
                    keys.append(prefix + node.target.id)
        return keys

    return walk("JobConfig", "")


@pytest.mark.skipif(not SMOKE_SOURCE.is_file(), reason="torchtitan 0.2.2 (.venv-smoke) is not installed")
def test_the_key_list_is_torchtitan_0_2_2s() -> None:
    assert _dataclass_keys(SMOKE_SOURCE.read_text()) == list(TORCHTITAN_0_2_2)


def test_validation_reads_c4_test_whole_as_a_local_set() -> None:
    """torchtitan's 0.2.2 default validation.steps = -1 (one pass) works on its local test set."""
    job = load_config(["--validation.enable", "--validation.dataset", "c4_test", "--validation.steps", "-1"])
    assert job.validation.steps == -1
    with pytest.raises(ConfigError, match=r"validation\.steps = -1 \(one pass\) needs a local dataset, not 'c4'"):
        load_config(["--validation.enable", "--validation.dataset", "c4", "--validation.steps", "-1"])
