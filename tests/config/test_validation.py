"""``[validation]``: the held-out loss after step 1 and every ``freq`` steps.

* end to end: the validation losses of a 1-rank run are those of torchtitan's FSDP
  on 2 ranks and of the automatic plan on 2 ranks (so each path averages over
  data-parallel ranks correctly; the automatic one runs its compiled step less
  the backward), and validating changes no training loss;
* the loader rewinds: every validation reads the same batches;
* bad settings are refused in one line, before any rank starts.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from _run import LLAMA3_CONFIG, RUNS, RunCache, check_records
from torch import nn

from torchtitan_autoparallel.config import load_config
from torchtitan_autoparallel.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
HELD_OUT = REPO / "README.md"  # prose the default corpus does not hold
LOSS_REL = 1e-4
STEPS = 4
VALIDATE = [
    "--validation.enable", "true", "--validation.freq", "2", "--validation.steps", "3",
    "--validation.dataset", "text", "--validation.dataset_path", str(HELD_OUT),
]


def _split(records: list[dict]) -> tuple[list[dict], list[dict]]:
    train = [r for r in records if "loss" in r]
    return train, [r for r in records if "validation_loss" in r]


class Runs(RunCache):
    def run(self, name: str, *extra: str, ngpu: int = 1) -> list[dict]:
        return self.get(
            name, *extra, model="llama3", ngpu=ngpu, steps=STEPS, seq_len=64,
            local_batch_size=4 // ngpu,
        )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("validation"))


@pytest.mark.multirank
def test_validation_changes_no_training_loss(runs: Runs) -> None:
    plain_train, plain_val = _split(runs.run("plain"))
    train, val = _split(runs.run("validated", *VALIDATE))
    assert plain_val == []
    check_records(train, STEPS)
    assert [r["loss"] for r in train] == [r["loss"] for r in plain_train]  # bit for bit
    assert [r["grad_norm"] for r in train] == [r["grad_norm"] for r in plain_train]
    # after step 1 and every 2nd step, each over the 3 batches asked for
    assert [r["step"] for r in val] == [1, 2, 4]
    assert all(r["validation_batches"] == 3 and math.isfinite(r["validation_loss"]) for r in val)
    # training moved the weights between validations: the same batches score differently
    assert len({r["validation_loss"] for r in val}) == 3


@pytest.mark.multirank
@pytest.mark.parametrize(
    "name,extra",
    [("fsdp", ["--model.name", "llama3"]), ("auto", ["--model.name", "llama3_auto_parallel"])],
)
def test_validation_loss_matches_one_rank(runs: Runs, name: str, extra: list[str]) -> None:
    ref_train, ref_val = _split(runs.run("validated", *VALIDATE))
    train, val = _split(runs.run(f"validated-{name}", *VALIDATE, *extra, ngpu=2))
    if name == "auto":  # the compiled step less its backward scored the batches
        run = next(r for r in RUNS if f"validated-{name} " in r.cmd)
        assert "validation runs the compiled step without its backward" in run.stdout + run.stderr, run.tail()
    assert [r["step"] for r in val] == [r["step"] for r in ref_val]
    got = [r["validation_loss"] for r in val]
    assert got == pytest.approx([r["validation_loss"] for r in ref_val], rel=LOSS_REL)
    assert [r["loss"] for r in train] == pytest.approx([r["loss"] for r in ref_train], rel=LOSS_REL)


class _Recorder:
    """A stand-in for ``setup.Training``: remembers the batches it was asked to score."""

    def __init__(self) -> None:
        self.model = nn.Linear(1, 1)
        self.seen: list[torch.Tensor] = []
        self.mode_during: list[bool] = []

    def validation_loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        self.seen.append(batch[0])
        self.mode_during.append(self.model.training)
        return batch[0].float().mean()


def _validator(tmp_path: Path, *overrides: str, text: str | None = None):
    from torchtitan_autoparallel.models.registry import build_model_config
    from torchtitan_autoparallel.train.validate import build_validator

    path = tmp_path / "held_out.txt"
    path.write_text(text if text is not None else (REPO / "README.md").read_text())
    job = load_config([
        "--validation.enable", "true", "--validation.dataset", "text",
        "--validation.dataset_path", str(path), "--training.seq_len", "16",
        "--training.local_batch_size", "2", *overrides,
    ])
    return build_validator(job, build_model_config("llama3", "debugmodel"), 0, 1)


def test_every_validation_reads_the_same_batches(tmp_path: Path) -> None:
    validator = _validator(tmp_path, "--validation.steps", "3")
    fake = _Recorder()
    first = validator.run(fake, 1)
    second = validator.run(fake, 10)
    assert len(fake.seen) == 6
    for a, b in zip(fake.seen[:3], fake.seen[3:]):
        assert torch.equal(a, b)
    assert not torch.equal(fake.seen[0], fake.seen[1])  # three different batches
    assert first.loss == second.loss and (first.step, second.step) == (1, 10)
    assert first.loss == pytest.approx(float(torch.stack([x.float().mean() for x in fake.seen[:3]]).mean()))
    assert fake.mode_during == [False] * 6 and fake.model.training  # eval while scoring, train after


def test_one_pass_takes_every_whole_batch_of_the_file(tmp_path: Path) -> None:
    from torchtitan_autoparallel.data.dataset import split_text_documents
    from torchtitan_autoparallel.data.tokenizer import load_tokenizer

    validator = _validator(tmp_path, "--validation.steps", "-1")
    tokenizer = load_tokenizer("default")
    docs = split_text_documents((REPO / "README.md").read_text())
    tokens = sum(len(tokenizer.encode(d)) + 2 for d in docs)  # each document gets bos and eos
    assert validator.batches == tokens // 17 // 2  # samples of seq_len + 1, global batch 2


def test_one_pass_over_too_little_data_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"validation.steps = -1: .* less than one global batch"):
        _validator(tmp_path, "--validation.steps", "-1", text="a few words only")


def test_validation_off_builds_nothing(tmp_path: Path) -> None:
    assert _validator(tmp_path, "--validation.enable", "false") is None


@pytest.mark.parametrize(
    "args,message",
    [
        (["--validation.freq", "0"], "validation.freq = 0 is too small; accepted: >= 1"),
        (["--validation.steps", "0"], "validation.steps = 0 is too small; accepted: >= 1"),
        (
            ["--validation.enable", "true", "--validation.steps", "-1", "--validation.dataset", "allenai/c4"],
            "validation.steps = -1 (one pass) needs a local dataset, not 'allenai/c4'",
        ),
    ],
)
def test_bad_settings_are_refused(args: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(args)
    assert str(e.value).startswith(message)


def test_preflight_refuses_a_missing_validation_file(tmp_path: Path, capsys) -> None:
    from torchtitan_autoparallel.launch import preflight

    missing = tmp_path / "nowhere.txt"
    argv = [
        "--ngpu", "1", "--job.config_file", str(LLAMA3_CONFIG), "--job.dump_folder", str(tmp_path / "out"),
        "--validation.enable", "true", "--validation.dataset", "text", "--validation.dataset_path", str(missing),
    ]
    assert preflight.main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"error: validation.dataset_path {str(missing)!r} does not exist; accepted: a text file or a folder of them\n"
    assert not (tmp_path / "out").exists()


def test_a_hand_written_plan_validates_at_its_own_shape(tmp_path: Path) -> None:
    validator = _validator(tmp_path, "--validation.steps", "2", "--validation.seq_len", "8",
                           "--validation.local_batch_size", "3")
    fake = _Recorder()
    validator.run(fake, 1)
    assert [tuple(x.shape) for x in fake.seen] == [(3, 8), (3, 8)]


@pytest.mark.parametrize("key,value", [("seq_len", "128"), ("local_batch_size", "2")])
def test_a_planned_model_refuses_another_validation_shape(tmp_path: Path, capsys, key: str, value: str) -> None:
    from torchtitan_autoparallel.launch import preflight

    argv = ["--ngpu", "2", "--job.config_file", str(LLAMA3_CONFIG), "--job.dump_folder", str(tmp_path / "out"),
            "--model.name", "llama3_auto_parallel", "--validation.enable", "true", f"--validation.{key}", value]
    assert preflight.main(argv) == 2
    trained = {"seq_len": 256, "local_batch_size": 4}[key]
    assert capsys.readouterr().err == (
        f"error: validation.{key} = {value} differs from training.{key} = {trained}, and model.name = "
        f"'llama3_auto_parallel' validates with the step planned for the training shape; accepted: -1 or {trained}\n"
    )
    same = argv[:-1] + [str(trained)]  # the training value itself is fine, and so is a hand-written plan
    assert preflight.main(same) == 0
    assert preflight.main(argv[:6] + ["--model.name", "llama3"] + argv[8:]) == 0


def test_a_long_validation_logs_its_progress(tmp_path: Path, caplog) -> None:
    validator = _validator(tmp_path, "--validation.steps", "20")
    with caplog.at_level("INFO", logger="torchtitan_autoparallel"):
        validator.run(_Recorder(), 3)
    progress = [r.getMessage() for r in caplog.records if "batches (" in r.getMessage()]
    assert [m.split(" batches (")[0].split()[-1] for m in progress] == ["4/20", "8/20", "12/20", "16/20"]
    assert all(m.startswith("validate step:  3  ") for m in progress)
    caplog.clear()
    with caplog.at_level("INFO", logger="torchtitan_autoparallel"):
        _validator(tmp_path, "--validation.steps", "19").run(_Recorder(), 3)
    assert not [r for r in caplog.records if "batches (" in r.getMessage()]
