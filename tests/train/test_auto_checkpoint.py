"""Checkpoints of automatic plans: exact resume, resharding across plans and meshes, bad input.

Per model (the debug model cut to two blocks), one uninterrupted run (automatic plan, 2 ranks FSDP, 4 steps)
checkpoints at steps 2 and 4. Each resumed run starts from a copy of its step-2
checkpoint under another plan or mesh, trains steps 3-4, and must log the
uninterrupted run's losses and save a step-4 checkpoint holding the same
weights and AdamW moments. Step 4 depends on the restored moments (step 3
only on the weights), so a lost or misplaced optimizer state shows in the
losses too.

Each launch costs ~40-70 s here: 7 launches in all, plus one refusal by the
launcher's preflight check (no rank starts) and a few in-process checks.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch
from _run import CONFIGS, FEW_LAYERS, RUNS, run_launcher, train

SEQ_LEN = 64
GLOBAL_BATCH = 4
STEPS = 4
SAVED_STEP = 2
TP2 = ("--parallelism.tensor_parallel_degree", "2")
CKPT = ("--checkpoint.enable", "true", "--checkpoint.interval", str(SAVED_STEP))

# plan id -> (ranks, data-parallel degree, automatic?, overrides); the global
# batch stays GLOBAL_BATCH.
PLANS = {
    "auto_fsdp": (2, 2, True, ()),
    "auto_tp": (2, 1, True, TP2),
    "auto_fsdp_tp": (4, 2, True, TP2),
    "manual_fsdp": (2, 2, False, ()),
}
SAVED_UNDER = "auto_fsdp"

# The same plan on the same mesh repeats every reduction in the same order.
SAME_PLAN_REL = 1e-5
# Another plan sums partial products in another order: the parity tests'
# bounds for a sharded plan against one rank (tests/train/test_train.py) apply.
OTHER_PLAN_LOSS_REL = 1e-4
OTHER_PLAN_GRAD_NORM_REL = 1e-3
# Per tensor, |a - b| / |a| over the whole tensor: robust to the odd element
# where Adam divides by a near-zero second moment, yet a lost, zeroed or
# misplaced shard moves it by ~1.
OTHER_PLAN_STATE_REL = 1e-3


def auto(model: str) -> tuple[str, ...]:
    return ("--model.name", f"{model}_auto_parallel")


class Runs:
    """The uninterrupted runs and the resumed ones, made once per module."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cache: dict[str, list[dict]] = {}

    def ref_dump(self, model: str) -> Path:
        return self.root / f"{model}-ref"

    def dump(self, model: str, plan: str) -> Path:
        return self.root / f"{model}-resumed-{plan}"

    def uninterrupted(self, model: str) -> list[dict]:
        if model not in self.cache:
            self.cache[model] = self._train(self.ref_dump(model), model, SAVED_UNDER)
        return self.cache[model]

    def resumed(self, model: str, plan: str) -> list[dict]:
        key = f"{model}/{plan}"
        if key not in self.cache:
            self.uninterrupted(model)
            dump = self.dump(model, plan)
            copy_checkpoint(self.ref_dump(model), dump, SAVED_STEP)
            self.cache[key] = self._train(dump, model, plan)
            out = RUNS[-1].stdout + RUNS[-1].stderr
            assert f"resumed from checkpoint {step_dir(dump, SAVED_STEP)}" in out, RUNS[-1].tail()
        return self.cache[key]

    @staticmethod
    def _train(dump: Path, model: str, plan: str) -> list[dict]:
        ngpu, dp, automatic, overrides = PLANS[plan]
        name = auto(model) if automatic else ()
        return train(
            dump, *name, *overrides, *CKPT, model=model, ngpu=ngpu, steps=STEPS, seq_len=SEQ_LEN,
            local_batch_size=GLOBAL_BATCH // dp, n_layers=FEW_LAYERS,
        )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("auto_ckpt"))


def step_dir(dump: Path, step: int) -> Path:
    return dump / "checkpoint" / f"step-{step}"


def copy_checkpoint(src_dump: Path, dst_dump: Path, step: int) -> None:
    shutil.copytree(step_dir(src_dump, step), step_dir(dst_dump, step))


def read_checkpoint(path: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """A DCP checkpoint as full tensors in one process, keys ``model/...`` and ``optimizer/...``."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = scratch / f"{path.parent.parent.name}-{path.name}.pt"
    dcp_to_torch_save(path, out)
    state = torch.load(out, weights_only=False)
    return {
        f"{section}/{key}": value
        for section, values in state.items()
        for key, value in values.items()
        if isinstance(value, torch.Tensor) and value.is_floating_point()
    }


def state_differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per tensor, the norm of the difference relative to the norm of ``a``."""
    assert sorted(a) == sorted(b)
    return {k: float((a[k] - b[k]).norm() / a[k].norm().clamp_min(1e-30)) for k in a}


def step4_differences(runs: Runs, model: str, plan: str, scratch: Path) -> dict[str, float]:
    return state_differences(
        read_checkpoint(step_dir(runs.ref_dump(model), STEPS), scratch),
        read_checkpoint(step_dir(runs.dump(model, plan), STEPS), scratch),
    )


def worst(diffs: dict[str, float]) -> tuple[str, float]:
    return max(diffs.items(), key=lambda kv: kv[1])


@pytest.mark.multirank
def test_resume_under_the_same_plan_is_exact(runs: Runs, tmp_path: Path) -> None:
    ref = runs.uninterrupted("llama3")
    assert [r["step"] for r in ref] == list(range(1, STEPS + 1))
    got = runs.resumed("llama3", SAVED_UNDER)
    assert [r["step"] for r in got] == list(range(SAVED_STEP + 1, STEPS + 1))
    tail = ref[SAVED_STEP:]
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in tail], rel=SAME_PLAN_REL), key
    assert [r["lr"] for r in got] == pytest.approx([r["lr"] for r in tail], rel=1e-12)
    diffs = step4_differences(runs, "llama3", SAVED_UNDER, tmp_path)
    assert any(k.endswith(".exp_avg_sq") for k in diffs), sorted(diffs)[:5]
    assert worst(diffs)[1] <= SAME_PLAN_REL, worst(diffs)


@pytest.mark.multirank
@pytest.mark.parametrize(
    "model,plan",
    [("llama3", "auto_tp"), ("llama3", "auto_fsdp_tp"), ("llama3", "manual_fsdp"), ("qwen3", "auto_tp")],
)
def test_resume_under_another_plan_or_mesh(runs: Runs, model: str, plan: str, tmp_path: Path) -> None:
    """Saved on 2 ranks FSDP; resumed on 2 ranks TP, on 4 ranks FSDP x TP, and by
    the hand-written FSDP plan: DCP reshards weights and moments into the new placements."""
    tail = runs.uninterrupted(model)[SAVED_STEP:]
    got = runs.resumed(model, plan)
    assert [r["step"] for r in got] == list(range(SAVED_STEP + 1, STEPS + 1))
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in tail], rel=OTHER_PLAN_LOSS_REL)
    assert [r["grad_norm"] for r in got] == pytest.approx(
        [r["grad_norm"] for r in tail], rel=OTHER_PLAN_GRAD_NORM_REL
    )
    diffs = step4_differences(runs, model, plan, tmp_path)
    assert worst(diffs)[1] <= OTHER_PLAN_STATE_REL, worst(diffs)


def _tree_digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _refusal_args(dump: Path, *overrides: str) -> list[str]:
    return ["--job.dump_folder", str(dump), *CKPT, *overrides, "--training.steps", str(STEPS),
            "--training.seq_len", str(SEQ_LEN), "--metrics.enable_tensorboard", "false",
            "--model.n_layers", str(FEW_LAYERS)]


@pytest.mark.multirank
def test_checkpoint_of_another_model_is_refused_before_launch(runs: Runs, tmp_path: Path) -> None:
    runs.uninterrupted("llama3")
    dump = tmp_path / "qwen3-run"
    copy_checkpoint(runs.ref_dump("llama3"), dump, SAVED_STEP)
    before = _tree_digest(dump)
    rc, out, err = run_launcher(_refusal_args(dump, *auto("qwen3")), ngpu=2, config=CONFIGS["qwen3"], timeout=300)
    assert rc != 0
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"holds model 'llama3:debugmodel:{FEW_LAYERS}layers'" in errors[0], err
    assert f"this run trains 'qwen3:debugmodel:{FEW_LAYERS}layers'" in errors[0]
    assert "Traceback" not in out + err
    assert _tree_digest(dump) == before  # nothing written: no metrics, plan or checkpoint


@pytest.mark.multirank
@pytest.mark.parametrize(
    "overrides,message",
    [
        (("--model.flavor", "1B"), f"this run trains 'llama3:1B:{FEW_LAYERS}layers'"),
        (("--checkpoint.load_step", "3"), "no complete checkpoint"),
    ],
    ids=["other_flavor", "missing_step"],
)
def test_preflight_refuses_unusable_checkpoints(
    runs: Runs, tmp_path: Path, capsys: pytest.CaptureFixture, overrides: tuple[str, ...], message: str
) -> None:
    """The launcher's check, called in this process (the test above covers the launch)."""
    from torchtitan_autoparallel.launch import preflight

    runs.uninterrupted("llama3")
    copy_checkpoint(runs.ref_dump("llama3"), tmp_path, SAVED_STEP)
    args = _refusal_args(tmp_path, "--job.config_file", str(CONFIGS["llama3"]), *auto("llama3"), *overrides)
    assert preflight.main(["--ngpu", "2", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and message in err, err


def test_tensors_that_do_not_fit_are_one_line_errors(tmp_path: Path) -> None:
    """Same model id, other shapes (a hand-edited or foreign checkpoint): DCP's
    multi-line CheckpointException becomes one CheckpointError line."""
    import torch.distributed as dist
    from torch import nn

    from torchtitan_autoparallel.train import checkpoint

    if dist.is_initialized():
        pytest.fail("a process group is already open in this process (a test leaked it)")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        saved = nn.Linear(4, 4)
        checkpoint.save(tmp_path, 1, saved, torch.optim.AdamW(saved.parameters()), {"model_id": "m"})
        other = nn.Linear(8, 4)
        with pytest.raises(checkpoint.CheckpointError) as info:
            checkpoint.load(tmp_path, 1, other, torch.optim.AdamW(other.parameters()), "m")
    finally:
        dist.destroy_process_group()
    message = str(info.value)
    assert "does not fit this model: Size mismatch" in message and "\n" not in message, message


def test_keep_latest_k_removes_older_checkpoints(tmp_path: Path, caplog) -> None:
    """Saving step N with keep_latest_k = 2 leaves the two latest complete checkpoints;
    older incomplete ones go too, newer ones and other folders stay."""
    import torch.distributed as dist
    from torch import nn

    from torchtitan_autoparallel.train import checkpoint

    if dist.is_initialized():
        pytest.fail("a process group is already open in this process (a test leaked it)")
    folder = tmp_path / "ckpt"
    (folder / "step-0").mkdir(parents=True)  # a save cut short by a crash: no train_state.json
    (folder / "notes").mkdir()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = nn.Linear(4, 4)
        optimizer = torch.optim.AdamW(model.parameters())
        with caplog.at_level("INFO", logger="torchtitan_autoparallel"):
            for step in (2, 4, 6):
                checkpoint.save(folder, step, model, optimizer, {"model_id": "m"}, keep_latest_k=2)
    finally:
        dist.destroy_process_group()
    assert sorted(p.name for p in folder.iterdir()) == ["notes", "step-4", "step-6"]
    assert "removed checkpoint(s) step-0, step-2 (checkpoint.keep_latest_k = 2)" in caplog.text
    assert checkpoint.latest_step(folder) == 6
    (folder / "step-8").mkdir()  # newer but incomplete: kept, and not counted
    assert checkpoint.purge_old(folder, 1) == [folder / "step-4"]
    assert sorted(p.name for p in folder.iterdir()) == ["notes", "step-6", "step-8"]
    assert checkpoint.purge_old(folder, 5) == []


def test_binding_a_plan_keeps_tied_weights_tied() -> None:
    """Qwen3 ties its embedding and lm_head; the trace names the tensor once.
    A stale meta alias would reach the state dict (DCP cannot save it) and the optimizer."""
    from types import SimpleNamespace

    from torch import nn

    from torchtitan_autoparallel.execute.step import PlannedStep
    from torchtitan_autoparallel.models.registry import build_model_config

    with torch.device("meta"):
        model = build_model_config("qwen3", "debugmodel", n_layers=1).build()
    planned = {fqn: nn.Parameter(torch.zeros(p.shape)) for fqn, p in model.named_parameters()}
    assert "lm_head.weight" not in planned  # the alias the trace does not see
    PlannedStep.bind_to(SimpleNamespace(params=planned, buffers={}), model)
    assert model.lm_head.weight is planned["tok_embeddings.weight"]
    assert all(not t.is_meta for t in model.state_dict().values())
    assert len(list(model.parameters())) == len(planned)


def test_a_cut_model_has_its_own_model_id() -> None:
    """``model.n_layers`` changes the tensors a checkpoint holds, so it is part of the id;
    the full depth keeps the id checkpoints have always had."""
    from torchtitan_autoparallel.train import checkpoint

    assert checkpoint.model_id("llama3", "debugmodel") == "llama3:debugmodel"
    assert checkpoint.model_id("qwen3", "8B", 2) == "qwen3:8B:2layers"
    for family, flavor, n_layers in (("llama3", "debugmodel", 0), ("qwen3", "8B", 2)):
        assert checkpoint.parse_model_id(checkpoint.model_id(family, flavor, n_layers)) == (family, flavor, n_layers)
