"""Starting from another run's checkpoint, and the weights-only last save.

One source run (hand-written FSDP on 1 rank, 4 steps) saves, in the background
(``async_mode = "async"``), a full checkpoint at step 2 and, with
``last_save_model_only``, the bfloat16 weights alone at step 4; it validates on its own first training batch after steps 2 and 4, which
is exactly the loss a run starting from those weights logs at its step 1:

* an automatic plan on 2 ranks starting from the step-2 weights logs that loss
  at step 1, with a fresh optimizer and schedule (the step-1 lr);
* a run starting from the step-4 bfloat16 weights logs it up to bfloat16's
  rounding of the weights;
* ``initial_load_model_only = false`` resumes from another folder's checkpoint
  and continues exactly as the source run did.

Plus in-process checks: resuming skips a weights-only save, and what cannot
be loaded is refused in one line before any rank starts.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from _run import LLAMA3_CONFIG, RUNS, RunCache

from torchtitan_autoparallel.train import checkpoint

LOSS_REL = 1e-4
BF16_LOSS_REL = 2e-3  # weights rounded to 8 bits of mantissa: measured 1.3e-4 here
SOURCE_STEPS = 4
SOURCE = [  # written in the background: the tests below read what async saves wrote
    "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--checkpoint.async_mode", "async",
    "--checkpoint.last_save_model_only", "true", "--checkpoint.export_dtype", "bfloat16",
    "--validation.enable", "true", "--validation.freq", "2", "--validation.steps", "1",
]


class Runs(RunCache):
    source_output = ""

    def source(self) -> tuple[list[dict], dict[int, float]]:
        if "source" not in self.cache:
            self.get("source", *SOURCE, model="llama3", ngpu=1, steps=SOURCE_STEPS, seq_len=64, local_batch_size=4)
            self.source_output = RUNS[-1].stdout + RUNS[-1].stderr
        records = self.cache["source"]
        train = [r for r in records if "loss" in r]
        return train, {r["step"]: r["validation_loss"] for r in records if "validation_loss" in r}

    def saved(self, step: int) -> Path:
        self.source()
        return self.root / "source" / "checkpoint" / f"step-{step}"

    def started(self, name: str, path: Path, *extra: str, ngpu: int = 1, steps: int = 1) -> list[dict]:
        return self.get(
            name, "--checkpoint.initial_load_path", str(path), *extra,
            model="llama3", ngpu=ngpu, steps=steps, seq_len=64, local_batch_size=4 // ngpu,
        )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("initial_load"))


def _read_dcp(path: Path, scratch: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = scratch / f"{path.name}.pt"
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=False)


@pytest.mark.multirank
def test_last_save_holds_the_weights_alone_in_the_export_dtype(runs: Runs, tmp_path: Path) -> None:
    last = runs.saved(SOURCE_STEPS)
    assert f"saved checkpoint {last} (weights only, bfloat16) (written in the background in " in runs.source_output
    assert json.loads((last / "train_state.json").read_text())["model_only"] is True
    state = _read_dcp(last, tmp_path)
    assert sorted(state) == ["model"]
    floats = [v for v in state["model"].values() if v.is_floating_point()]
    assert floats and all(v.dtype == torch.bfloat16 for v in floats)
    full = _read_dcp(runs.saved(2), tmp_path)
    assert sorted(full) == ["model", "optimizer"]
    assert all(v.dtype == torch.float32 for v in full["model"].values() if v.is_floating_point())


@pytest.mark.multirank
def test_planned_run_starts_from_another_runs_weights(runs: Runs) -> None:
    source, validated = runs.source()
    got = runs.started("auto", runs.saved(2), "--model.name", "llama3_auto_parallel", ngpu=2)
    out = RUNS[-1].stdout + RUNS[-1].stderr
    assert "started from the weights of checkpoint" in out, RUNS[-1].tail()
    assert [r["step"] for r in got] == [1]
    # the source run's first batch scored with its step-2 weights
    assert got[0]["loss"] == pytest.approx(validated[2], rel=LOSS_REL)
    assert got[0]["loss"] != pytest.approx(source[0]["loss"], rel=1e-3)  # not the fresh init's loss
    assert got[0]["lr"] == pytest.approx(source[0]["lr"], rel=1e-12)  # a fresh schedule


@pytest.mark.multirank
def test_run_starts_from_bfloat16_weights(runs: Runs) -> None:
    _, validated = runs.source()
    got = runs.started("bf16", runs.saved(SOURCE_STEPS))
    assert got[0]["loss"] == pytest.approx(validated[SOURCE_STEPS], rel=BF16_LOSS_REL)
    assert got[0]["loss"] != pytest.approx(validated[2], rel=BF16_LOSS_REL)


@pytest.mark.multirank
def test_full_initial_load_resumes_from_another_folder(runs: Runs) -> None:
    source, _ = runs.source()
    got = runs.started("full", runs.saved(2), "--checkpoint.initial_load_model_only", "false", steps=SOURCE_STEPS)
    assert [r["step"] for r in got] == [3, 4]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in source[2:]], rel=1e-5)
    assert [r["lr"] for r in got] == pytest.approx([r["lr"] for r in source[2:]], rel=1e-12)


def _fake_checkpoint(folder: Path, step: int, **state) -> Path:
    path = folder / f"step-{step}"
    path.mkdir(parents=True)
    (path / "train_state.json").write_text(json.dumps({"step": step, "model_id": "llama3:debugmodel", **state}))
    return path


def test_resume_skips_a_weights_only_save(tmp_path: Path) -> None:
    _fake_checkpoint(tmp_path, 2)
    _fake_checkpoint(tmp_path, 4, model_only=True)
    (tmp_path / "step-6").mkdir()  # cut short: no train_state.json
    assert checkpoint.latest_step(tmp_path) == 2
    with pytest.raises(checkpoint.CheckpointError, match=r"holds the weights only .* cannot be resumed"):
        checkpoint.read_train_state(tmp_path, 4, "llama3:debugmodel")


@pytest.mark.parametrize(
    "state,model_only,message",
    [
        (None, True, "checkpoint.initial_load_path '{path}': no complete checkpoint there; accepted: a step folder with train_state.json"),
        ({"model_only": True}, False, "checkpoint.initial_load_path '{path}' holds the weights only, but checkpoint.initial_load_model_only is false"),
        ({"model_id": "qwen3:debugmodel"}, True, "checkpoint {path} holds model 'qwen3:debugmodel', this run trains 'llama3:debugmodel'"),
    ],
)
def test_preflight_refuses_an_unusable_initial_checkpoint(tmp_path: Path, capsys, state, model_only, message) -> None:
    from torchtitan_autoparallel.launch import preflight

    path = tmp_path / "step-2"
    if state is not None:
        _fake_checkpoint(tmp_path, 2, **state)
    argv = [
        "--ngpu", "1", "--job.config_file", str(LLAMA3_CONFIG), "--job.dump_folder", str(tmp_path / "out"),
        "--checkpoint.initial_load_path", str(path),
        "--checkpoint.initial_load_model_only", str(model_only).lower(),
    ]
    assert preflight.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: " + message.format(path=path)) and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_a_resumable_checkpoint_wins_over_the_initial_one(tmp_path: Path) -> None:
    from torchtitan_autoparallel.config import load_config

    dump = tmp_path / "out"
    _fake_checkpoint(dump / "checkpoint", 3)
    args = ["--job.dump_folder", str(dump), "--checkpoint.initial_load_path", str(tmp_path / "nowhere")]
    assert checkpoint.initial_load_path(load_config(args + ["--checkpoint.enable", "true"])) is None
    assert checkpoint.initial_load_path(load_config(args)) == tmp_path / "nowhere"  # saving off: nothing to resume


# Hugging Face layout: an automatic TP plan exports (the rotary permutation of the
# query and key weights runs on its tensor-parallel shards), the hand-written
# 1-rank plan starts from the export and logs the loss the source validated.
HF_SOURCE_STEPS = 2


@pytest.mark.multirank
@pytest.mark.parametrize("model", ["llama3", "qwen3"])
def test_hugging_face_export_round_trip(runs: Runs, model: str) -> None:
    from safetensors import safe_open

    source = runs.get(
        f"{model}-hf-source", "--model.name", f"{model}_auto_parallel", "--parallelism.tensor_parallel_degree", "2",
        "--checkpoint.enable", "true", "--checkpoint.interval", "10", "--checkpoint.last_save_model_only", "true",
        "--checkpoint.last_save_in_hf", "true",
        "--validation.enable", "true", "--validation.freq", str(HF_SOURCE_STEPS), "--validation.steps", "1",
        model=model, ngpu=2, steps=HF_SOURCE_STEPS, seq_len=64, local_batch_size=4,
    )
    validated = {r["step"]: r["validation_loss"] for r in source if "validation_loss" in r}
    export = runs.root / f"{model}-hf-source" / "checkpoint" / f"step-{HF_SOURCE_STEPS}"
    assert sorted(p.name for p in export.iterdir()) == [
        "config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json", "train_state.json",
    ]
    config = json.loads((export / "config.json").read_text())  # what from_pretrained reads
    expected = {"llama3": ("llama", "llama3", False), "qwen3": ("qwen3", "default", True)}[model]
    assert (config["model_type"], config["rope_parameters"]["rope_type"], config["tie_word_embeddings"]) == expected
    assert (config["hidden_size"], config["vocab_size"], config["torch_dtype"]) == (256, 2048, "float32")
    with safe_open(str(export / "model-00001-of-00001.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    assert {"model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.mlp.gate_proj.weight"} <= names
    assert not any(n.startswith("layers.") or "qkv_linear" in n for n in names)  # no torchtitan names left

    got = runs.get(
        f"{model}-from-hf", "--checkpoint.initial_load_path", str(export), "--checkpoint.initial_load_in_hf", "true",
        model=model, ngpu=1, steps=1, seq_len=64, local_batch_size=4,
    )
    assert "started from the Hugging Face weights" in RUNS[-1].stdout + RUNS[-1].stderr, RUNS[-1].tail()
    assert got[0]["loss"] == pytest.approx(validated[HF_SOURCE_STEPS], rel=LOSS_REL)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--checkpoint.last_save_in_hf", "true"], "checkpoint.last_save_in_hf = true needs checkpoint.last_save_model_only = true"),
        (["--checkpoint.initial_load_in_hf", "true"], "checkpoint.initial_load_in_hf = true needs checkpoint.initial_load_path set"),
    ],
)
def test_hugging_face_settings_that_cannot_work_are_refused(args: list[str], message: str) -> None:
    from torchtitan_autoparallel.config import load_config
    from torchtitan_autoparallel.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(args)
    assert str(e.value).startswith(message)


def test_preflight_refuses_a_folder_without_safetensors(tmp_path: Path, capsys) -> None:
    from torchtitan_autoparallel.launch import preflight

    hf_export = _fake_checkpoint(tmp_path, 2, model_only=True, format="hf")
    base = ["--ngpu", "1", "--job.config_file", str(LLAMA3_CONFIG), "--job.dump_folder", str(tmp_path / "out"),
            "--checkpoint.initial_load_path", str(hf_export)]
    assert preflight.main(base + ["--checkpoint.initial_load_in_hf", "true"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: checkpoint.initial_load_path {str(hf_export)!r} holds no .safetensors file"), err
    # an HF export read as a DCP checkpoint
    assert preflight.main(base) == 2
    err = capsys.readouterr().err
    assert "holds Hugging Face safetensors; accepted: checkpoint.initial_load_in_hf = true" in err, err


def test_a_step_saved_again_leaves_no_files_of_the_old_save(tmp_path: Path) -> None:
    """A run resumed from before its weights-only last save saves that step in full
    later: the old save's files (say, an HF export) must not linger in the folder."""
    import torch.distributed as dist
    from torch import nn

    if dist.is_initialized():
        pytest.fail("a process group is already open in this process (a test leaked it)")
    folder = tmp_path / "ckpt"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = nn.Linear(4, 4)
        optimizer = torch.optim.AdamW(model.parameters())
        checkpoint.save(folder, 3, model, optimizer, {"model_id": "m"}, model_only_dtype=torch.bfloat16)
        stale = folder / "step-3" / "model-00001-of-00001.safetensors"
        stale.write_bytes(b"from an older export")
        assert checkpoint.latest_step(folder) is None  # weights only: nothing to resume
        checkpoint.save(folder, 3, model, optimizer, {"model_id": "m"})
    finally:
        dist.destroy_process_group()
    assert not stale.exists()
    assert checkpoint.latest_step(folder) == 3
    assert "model_only" not in json.loads((folder / "step-3" / "train_state.json").read_text())


def test_a_hub_style_folder_loads(tmp_path: Path) -> None:
    """What the Hub serves: bfloat16 weights split over two files with an index, no
    train_state.json. They load into an fp32 model as the bfloat16 values, exactly."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from torchtitan_autoparallel.models.registry import build_model_config
    from torchtitan_autoparallel.train import hf_checkpoint

    if dist.is_initialized():
        pytest.fail("a process group is already open in this process (a test leaked it)")
    config = build_model_config("llama3", "debugmodel")
    torch.manual_seed(0)
    source = config.build()
    source.init_weights(buffer_device=None)
    adapter = hf_checkpoint.adapter("llama3", config)
    hf = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in adapter.to_hf(source.state_dict()).items()}
    keys = sorted(hf)
    files = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
             "model-00002-of-00002.safetensors": keys[len(keys) // 2 :]}
    hub = tmp_path / "hub"
    hub.mkdir()
    for name, names in files.items():
        save_file({k: hf[k] for k in names}, str(hub / name), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: name for name, names in files.items() for k in names}}
    (hub / "model.safetensors.index.json").write_text(json.dumps(index))
    assert checkpoint.check_initial(hub, "llama3:debugmodel", True, in_hf=True) is None

    torch.manual_seed(1)
    target = config.build()
    target.init_weights(buffer_device=None)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        hf_checkpoint.load(hub, target, adapter)
    finally:
        dist.destroy_process_group()
    loaded = target.state_dict()
    for name, value in source.state_dict().items():
        assert loaded[name].dtype == torch.float32
        assert torch.equal(loaded[name], value.to(torch.bfloat16).float()), name


def test_a_background_save_writes_what_a_save_at_once_writes(tmp_path: Path) -> None:
    """The state is copied when the save starts: changing the weights after it does not
    reach the checkpoint, which is marked complete only by ``wait``."""
    import torch.distributed as dist
    from torch import nn

    if dist.is_initialized():
        pytest.fail("a process group is already open in this process (a test leaked it)")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = nn.Linear(64, 64)
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 64)).sum().backward()
        optimizer.step()
        checkpoint.save(tmp_path / "now", 1, model, optimizer, {"model_id": "m"})
        saver = checkpoint.Saver(tmp_path / "later", 0, "async")
        saver.save(1, model, optimizer, {"model_id": "m"})
        with torch.no_grad():
            model.weight.add_(1.0)  # training goes on while the save is written
        saver.wait()
        assert saver.pending is None
    finally:
        dist.destroy_process_group()
    now, later = (_read_dcp(tmp_path / kind / "step-1", tmp_path) for kind in ("now", "later"))
    for section in ("model", "optimizer"):
        assert sorted(now[section]) == sorted(later[section])
        for key, value in now[section].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, later[section][key]), (section, key)
    assert (tmp_path / "later" / "step-1" / "train_state.json").is_file()


@pytest.mark.parametrize(
    "args,steps",
    [
        ([], [3, 6, 7]),  # every interval, and the last step
        (["--checkpoint.enable_first_step_checkpoint", "true"], [1, 3, 6, 7]),
    ],
)
def test_which_steps_save(args: list[str], steps: list[int]) -> None:
    from torchtitan_autoparallel.config import load_config
    from torchtitan_autoparallel.launch.main import _saves

    job = load_config(["--checkpoint.enable", "true", "--checkpoint.interval", "3", "--training.steps", "7", *args])
    assert [s for s in range(1, 8) if _saves(job, s)] == steps


def test_a_saved_checkpoint_converts_to_hugging_face_safetensors(tmp_path: Path, capsys) -> None:
    """``python -m torchtitan_autoparallel.train.to_hf``: a DCP checkpoint's weights under
    HF names, in the asked dtype; bad input is one line."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from torchtitan_autoparallel.models.registry import build_model_config
    from torchtitan_autoparallel.train import hf_checkpoint, to_hf

    if dist.is_initialized():
        pytest.fail("a process group is already open in this process (a test leaked it)")
    config = build_model_config("qwen3", "debugmodel")  # tied embeddings: lm_head is not written
    torch.manual_seed(0)
    model = config.build()
    model.init_weights(buffer_device=None)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        optimizer = torch.optim.AdamW(model.parameters())
        checkpoint.save(tmp_path / "ckpt", 5, model, optimizer, {"model_id": "qwen3:debugmodel"})
    finally:
        dist.destroy_process_group()
    expected = hf_checkpoint.adapter("qwen3", config).to_hf(model.state_dict())

    assert to_hf.main([str(tmp_path / "ckpt" / "step-5"), str(tmp_path / "hf"), "--dtype", "bfloat16"]) == 0
    written = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(written) == sorted(expected) and "lm_head.weight" not in written
    for name, value in expected.items():
        assert written[name].dtype == torch.bfloat16
        assert torch.equal(written[name], value.to(torch.bfloat16)), name

    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["torch_dtype"] == "bfloat16"
    assert config["num_hidden_layers"] == len(model.layers) and config["tie_word_embeddings"] is True

    # a planted .metadata runs no code here either (DCP's own reader would unpickle it)
    class Planted:
        def __reduce__(self):
            return (open, (str(tmp_path / "planted-code-ran"), "w"))

    step = tmp_path / "ckpt" / "step-5"
    (step / "checksums.json").unlink()  # no manifest to catch it first: the unpickler must
    (step / ".metadata").write_bytes(pickle.dumps(Planted()))
    capsys.readouterr()
    assert to_hf.main([str(step), str(tmp_path / "hf3")]) == 2
    assert "is not DCP metadata (io.open is not part of DCP's metadata)" in capsys.readouterr().err
    assert not (tmp_path / "planted-code-ran").exists()

    capsys.readouterr()
    assert to_hf.main([str(tmp_path / "nowhere"), str(tmp_path / "hf2")]) == 2
    assert capsys.readouterr().err == (
        f"error: {str(tmp_path / 'nowhere')!r} is not a complete checkpoint (no train_state.json); "
        f"accepted: a <dump_folder>/checkpoint/step-N folder\n"
    )


@pytest.mark.multirank
def test_a_resume_can_leave_the_optimizer_or_the_data_fresh(runs: Runs) -> None:
    """``exclude_from_loading``: step 3 reads only the step-2 weights and its batch, step 4
    AdamW's moments too. Without the optimizer state step 3 is the source's and step 4 is
    not; without the data position step 3 scores the first batch, as the source's
    validation after step 2 did."""
    source, validated = runs.source()
    full = ("--checkpoint.initial_load_model_only", "false")
    fresh_adam = runs.started("no-optimizer", runs.saved(2), *full, "--checkpoint.exclude_from_loading", "optimizer",
                              steps=SOURCE_STEPS)
    assert [r["step"] for r in fresh_adam] == [3, 4]
    assert fresh_adam[0]["loss"] == pytest.approx(source[2]["loss"], rel=1e-5)
    assert fresh_adam[1]["loss"] != pytest.approx(source[3]["loss"], rel=1e-5)
    fresh_data = runs.started("no-data", runs.saved(2), *full, "--checkpoint.exclude_from_loading", "dataloader",
                              steps=3)
    assert fresh_data[0]["step"] == 3
    assert fresh_data[0]["loss"] == pytest.approx(validated[2], rel=1e-5)
