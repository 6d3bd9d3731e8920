"""The compatibility module's choices on the installed torch and torchtitan, and the
one-line refusal of an unsupported pair (simulated: no such release is installed)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _run import REPO
from torch.distributed.tensor._dtensor_spec import TensorMeta
from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from torchtitan_autoparallel import compat
from torchtitan_autoparallel.compat import VersionError
from torchtitan_autoparallel.models.registry import build_meta_model, build_model_config
from torchtitan_autoparallel.planner.strategies.rules import nll_loss_backward_rule, nll_loss_forward_rule
from torchtitan_autoparallel.planner.trace.trace import trace_training_step

aten = torch.ops.aten


def test_installed_pair_is_supported() -> None:
    compat.check_versions()
    low, high = compat.TORCH_SUPPORTED
    assert low <= compat._release(torch.__version__)[:2] <= high


def test_model_api_follows_the_installed_torchtitan() -> None:
    titan = compat._release(compat.installed("torchtitan"))
    assert compat.model_api() == ("config" if titan >= (0, 3) else "args")
    # torchtitan 0.3 needs this torch name; where it is missing, 0.2 must be what is installed
    if not hasattr(torch.distributed.fsdp, "DataParallelMeshDims"):
        assert compat.model_api() == "args"


@pytest.mark.parametrize("family,heads", [("llama3", (16, 16)), ("qwen3", (16, 8))])
def test_model_config_reads_alike(family: str, heads: tuple[int, int]) -> None:
    config = build_model_config(family, "debugmodel", n_layers=2)
    assert config.n_layers == 2 and config.heads == heads and config.vocab_size == 2048
    model = build_meta_model(family, "debugmodel", n_layers=2)
    assert len(model.layers) == 2
    assert hasattr(model, config.output_name)
    n_params, flops = config.nparams_and_flops(model, 64)
    # torchtitan's count (0.2 leaves a tied embedding out of Qwen3's), never above the model's
    assert 0.9 * sum(p.numel() for p in model.parameters()) <= n_params <= sum(p.numel() for p in model.parameters())
    assert flops > n_params


def test_single_dim_rules_where_torch_has_them() -> None:
    from torch.distributed.tensor import DTensor

    table = DTensor._op_dispatcher.sharding_propagator.op_single_dim_strategy_funcs
    assert compat.torch_single_dim_rule(aten.mm.default) is table[aten.mm.default].func
    assert (compat.torch_single_dim_rule(aten.nll_loss_forward.default) is None) == (
        aten.nll_loss_forward.default not in table
    )


def _filled(rules: list) -> list:
    """torch 2.14's rules name a sharded dim by a placeholder the expansion fills in."""
    return [[Shard(p.dim) if isinstance(p, _ShardingPlaceholder) else p for p in r] for r in rules]


def test_loss_rules_shard_the_batch_on_every_torch() -> None:
    logits, target = TensorMeta(torch.Size([8, 32]), (32, 1), torch.float32), TensorMeta(
        torch.Size([8]), (1,), torch.int64
    )
    mean = _filled(nll_loss_forward_rule(aten.nll_loss_forward.default, (logits, target, None, 1, -100), {}))
    assert [Partial("avg"), Partial("sum"), Shard(0), Shard(0)] in mean
    total = TensorMeta(torch.Size([]), (), torch.float32)
    back = _filled(nll_loss_backward_rule(
        aten.nll_loss_backward.default, (total, logits, target, None, 1, -100, total), {}
    ))
    assert any(r[0] == Shard(0) and r[2] == Shard(0) and r[-1] == Replicate() for r in back)


def test_set_timeout_prefers_the_public_call(monkeypatch, gloo_one) -> None:
    seen = []
    monkeypatch.setattr(dist, "set_timeout", lambda t, g: seen.append((t, g)), raising=False)
    compat.set_timeout(timedelta(seconds=7), dist.group.WORLD)
    assert seen == [(timedelta(seconds=7), dist.group.WORLD)]
    monkeypatch.delattr(dist, "set_timeout")
    compat.set_timeout(timedelta(seconds=9), dist.group.WORLD)  # torch 2.11's private one
    dist.barrier()


@pytest.mark.parametrize(
    "torch_v,titan_v,names",
    [("2.10.0", "0.3.0", "torch 2.10.0 with torchtitan 0.3.0"),
     ("2.16.0+cu130", "0.3.0", "torch 2.16.0+cu130"),
     ("2.14.1", "0.2.1", "torchtitan 0.2.1"),
     ("2.14.1", None, "torchtitan (not installed)")],
)
def test_unsupported_versions_are_one_line(monkeypatch, torch_v, titan_v, names) -> None:
    monkeypatch.setattr(compat, "installed", {"torch": torch_v, "torchtitan": titan_v}.get)
    with pytest.raises(VersionError) as err:
        compat.check_versions()
    message = str(err.value)
    assert names in message and f"supported: {compat.SUPPORTED}" in message and "\n" not in message


def test_torchtitan_that_does_not_import_is_one_line(monkeypatch) -> None:
    def fail(name, *args):
        raise ImportError("cannot import name 'DataParallelMeshDims' from 'torch.distributed.fsdp'")

    monkeypatch.setattr(compat, "installed", {"torch": "2.11.0", "torchtitan": "0.3.0"}.get)
    monkeypatch.setattr(importlib, "import_module", fail)
    with pytest.raises(VersionError, match=r"torchtitan 0\.3\.0 does not import on torch 2\.11\.0 .*DataParallelMeshDims"):
        compat.check_versions()


def test_launcher_refuses_an_unsupported_torch_before_any_rank() -> None:
    """The launcher's own process, its version lookup made to answer 2.10: exit 2, one line."""
    code = (
        "import sys; from torchtitan_autoparallel import compat; "
        "compat.installed = {'torch': '2.10.0', 'torchtitan': '0.3.0'}.get; "
        "from torchtitan_autoparallel.launch import launch; "
        "sys.exit(launch.main(['--ngpu', '2', '--standalone', '--', '-m', launch.TRAIN_MODULE]))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: unsupported torch 2.10.0 with torchtitan 0.3.0; supported: {compat.SUPPORTED}"]
    assert "[rank" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_fit_rope_shortens_the_cache_and_keeps_its_rows(family: str) -> None:
    """The rotary cache sized for the job's sequence holds the same rows as the flavor's full one."""
    full = build_model_config(family, "debugmodel", n_layers=1)
    fitted = build_model_config(family, "debugmodel", n_layers=1)
    fitted.fit_rope(64)
    assert full.max_seq_len > 64 and fitted.max_seq_len == 64
    long_buffers = {n: b for n, b in full.build().named_buffers() if b.shape[0] == full.max_seq_len}
    short = dict(fitted.build().named_buffers())
    assert long_buffers, "no rotary cache found"
    for name, cache in long_buffers.items():
        assert short[name].shape[0] == 64
        assert torch.equal(short[name], cache[:64])


def test_activation_checkpointing_recomputes_in_the_trace_on_every_torch() -> None:
    """make_fx of the step runs checkpointed blocks for real (``compat.checkpoint_for_real``):
    full recomputation reruns each block's attention in the backward, selective reruns
    some matmuls and no attention, per-block modes only where asked; and the hook is gone after."""
    model = build_meta_model("llama3", "debugmodel", n_layers=2)
    sdpa, mm = aten._scaled_dot_product_flash_attention_for_cpu.default, aten.mm.default

    def calls(mode, op) -> int:
        return sum(n.target is op for n in trace_training_step(model, 2, 32, activation_checkpoint=mode).graph.graph.nodes)

    assert calls("full", sdpa) == calls("none", sdpa) + 2 == 4
    assert calls(("full", "none"), sdpa) == 3
    assert calls("selective", sdpa) == 2 and calls("selective", mm) > calls("none", mm)
    assert compat.checkpoint_module._is_compiling.__name__ == "_is_compiling"
