"""The weights' first values (``train/initial.py``): whole on every rank, or built once
on rank 0 and scattered; and the host-memory check that comes before either.

The scattered path's end-to-end check (same losses, bit for bit, on 4 gloo
ranks) is in ``test_auto_parity.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from torchtitan_autoparallel.errors import UserError
from torchtitan_autoparallel.mesh.runtime import Runtime
from torchtitan_autoparallel.models.registry import build_meta_model, build_model_config
from torchtitan_autoparallel.train import initial
from torchtitan_autoparallel.train.setup import init_full_model

GIB = 2**30


def _runtime(rank: int, device: str = "cpu") -> Runtime:
    backend = "gloo" if device == "cpu" else "nccl"
    return Runtime(device=torch.device(device), backend=backend, rank=rank, world_size=4, local_rank=rank)


def _model():
    config = build_model_config("qwen3", "debugmodel", n_layers=1)
    return config, build_meta_model("qwen3", "debugmodel", n_layers=1)


def test_a_model_under_the_threshold_is_whole_on_every_rank() -> None:
    config, meta = _model()
    values = initial.full_values(config, meta, 0, _runtime(1), whole=True)
    assert values.src_rank is None
    ref = init_full_model(config, 0, torch.device("cpu"))
    assert all(torch.equal(values.params[k], v) for k, v in ref.named_parameters())


def test_rank0_holds_the_one_rank_init_and_scatters_it() -> None:
    config, meta = _model()
    values = initial.full_values(config, meta, 0, _runtime(0), whole=False)
    assert values.src_rank == 0
    ref = init_full_model(config, 0, torch.device("cpu"))
    assert list(values.params) == [k for k, _ in ref.named_parameters()]
    assert all(torch.equal(values.params[k], v) for k, v in ref.named_parameters())
    assert all(torch.equal(values.buffers[k], v) for k, v in ref.named_buffers())


def test_a_receiving_rank_never_builds_the_model(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a receiving rank built the full model")

    monkeypatch.setattr(initial, "init_full_model", refuse)
    config, meta = _model()
    values = initial.full_values(config, meta, 0, _runtime(2), whole=False)
    assert values.src_rank == 0
    for name, want in list(meta.named_parameters()) + list(meta.named_buffers()):
        got = (values.params if name in values.params else values.buffers)[name]
        assert (got.shape, got.dtype, got.device.type) == (want.shape, want.dtype, "cpu"), name
    # made when asked for: two looks are two tensors, nothing is kept
    name = next(iter(values.params))
    assert values.params[name] is not values.params[name]


def _plan(param_gib: float, peak_gib: float):
    return SimpleNamespace(
        param_bytes_per_device=param_gib * GIB, predicted={"peak_activation_bytes_per_device": peak_gib * GIB}
    )


@pytest.mark.parametrize(
    "device,whole,want_gib",
    [
        ("cpu", True, 2 * (1 * 3 + 0.5) + 2 * 8),  # every CPU rank: its share and a whole model
        ("cpu", False, 2 * (1 * 3 + 0.5) + 8),  # the whole model once, on rank 0
        ("cuda", True, 0.0),  # on the GPUs: the host holds nothing
        ("cuda", False, 8.0),  # rank 0's host copy
    ],
)
def test_host_need(device: str, whole: bool, want_gib: float) -> None:
    need = initial.host_need_bytes(_plan(1, 0.5), _runtime(0, device), 8 * GIB, whole, local_ranks=2)
    assert need == pytest.approx(want_gib * GIB)


def test_a_job_its_host_cannot_hold_is_refused_in_one_line(monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(initial, "available_host_bytes", lambda: 4.0 * GIB)
    with pytest.raises(UserError) as caught:
        initial.check_host_memory(_plan(1, 0.5), _runtime(0), 8 * GIB, whole=False)
    message = str(caught.value)
    assert "\n" not in message
    assert "does not fit this host: its 2 CPU rank(s) need at least 15.00 GiB" in message
    assert "4.00 GiB is available (free on the host, or left under its container's limit); accepted" in message
    # enough memory, or none known: no error
    monkeypatch.setattr(initial, "available_host_bytes", lambda: 15.0 * GIB)
    initial.check_host_memory(_plan(1, 0.5), _runtime(0), 8 * GIB, whole=False)
    monkeypatch.setattr(initial, "available_host_bytes", lambda: None)
    initial.check_host_memory(_plan(100, 100), _runtime(0), 800 * GIB, whole=True)


def test_available_host_memory_is_read_from_meminfo(tmp_path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   2048 kB\n")
    assert initial.available_host_bytes(meminfo, cgroups=()) == 2048 * 1024
    meminfo.write_text("MemTotal:       24000000 kB\n")
    assert initial.available_host_bytes(meminfo, cgroups=()) is None
    assert initial.available_host_bytes(tmp_path / "missing", cgroups=()) is None


def _cgroup(folder, limit: str, usage: int, stat: str, v2: bool = True):
    folder.mkdir()
    names = ("memory.max", "memory.current") if v2 else ("memory.limit_in_bytes", "memory.usage_in_bytes")
    (folder / names[0]).write_text(limit + "\n")
    (folder / names[1]).write_text(f"{usage}\n")
    (folder / "memory.stat").write_text(stat)
    return (folder, *names, "inactive_file" if v2 else "total_inactive_file")


def test_a_container_limit_lowers_what_is_available(tmp_path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemAvailable: {100 * GIB // 1024} kB\n")
    # v2: 8 GiB limit, 5 GiB used of which 1 GiB inactive page cache -> 4 GiB left
    v2 = _cgroup(tmp_path / "v2", str(8 * GIB), 5 * GIB, f"anon 123\ninactive_file {GIB}\nactive_file 7\n")
    assert initial.available_host_bytes(meminfo, cgroups=(v2,)) == 4 * GIB
    # v1 spells it differently; the tighter of host and container wins
    v1 = _cgroup(tmp_path / "v1", str(3 * GIB), 2 * GIB, f"cache 9\ntotal_inactive_file {GIB}\n", v2=False)
    assert initial.available_host_bytes(meminfo, cgroups=(v2, v1)) == 2 * GIB
    # no limit ("max", or v1's huge number) or no cgroup files: the host's figure
    free = _cgroup(tmp_path / "free", "max", GIB, "inactive_file 0\n")
    huge = _cgroup(tmp_path / "huge", "9223372036854771712", GIB, "total_inactive_file 0\n", v2=False)
    gone = (tmp_path / "gone", "memory.max", "memory.current", "inactive_file")
    assert initial.available_host_bytes(meminfo, cgroups=(free, huge, gone)) == 100 * GIB


def test_asking_whether_a_tensor_is_there_makes_none(monkeypatch) -> None:
    """Placement asks ``fqn in values`` before ``values[fqn]``: only the second may
    build the tensor (a host-to-device copy on rank 0)."""
    config, meta = _model()
    values = initial.full_values(config, meta, 0, _runtime(1), whole=False)
    made = []
    monkeypatch.setattr(torch, "empty", lambda *a, **k: made.append(a) or torch.zeros(1))
    name = next(iter(values.params))
    assert name in values.params and "no.such.weight" not in values.params
    assert made == []
    values.params[name]
    assert len(made) == 1


def test_values_scatter_from_the_mesh_first_rank_only(fake_world) -> None:
    from torch.distributed.device_mesh import DeviceMesh

    from torchtitan_autoparallel.execute.step import FullValues, build_executable

    scattered = FullValues({}, {}, src_rank=0)
    with pytest.raises(ValueError, match=r"src_rank 0 on mesh \[\[1, 0\]\]: .* must be the mesh's first rank"):
        build_executable(None, DeviceMesh("cpu", [[1, 0]]), scattered)
    with pytest.raises(ValueError, match=r"src_rank 1 on mesh"):
        build_executable(None, DeviceMesh("cpu", [[0, 1]]), FullValues({}, {}, src_rank=1))
