"""Shared test helpers: launcher runs, and their output shown on failure.

``run_launcher`` (from ``tests/_run.py``) runs ``./run_train.sh`` with a
timeout and returns ``(returncode, stdout, stderr)`` (a ``Run`` that also
unpacks as that tuple). When a test fails, the tail of the output of every
launcher run made during it (fixture set-up included) is added to the report.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _run  # noqa: E402

_FIRST_RUN_KEY = pytest.StashKey[int]()


@pytest.fixture
def gloo_one(tmp_path):
    """A real one-rank gloo group: collectives run, and their values are exact."""
    import torch.distributed as dist

    if dist.is_initialized():  # another test leaked its group: a bug to fix, not to skip over
        pytest.fail("a process group is already open in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


@pytest.fixture
def run_launcher():
    """The launcher helper as a fixture: ``rc, out, err = run_launcher(args, ngpu=..)``."""
    return _run.run_launcher


def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_FIRST_RUN_KEY] = len(_run.RUNS)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    report = yield
    if report.failed:
        first = item.stash.get(_FIRST_RUN_KEY, len(_run.RUNS))
        for i, run in enumerate(_run.RUNS[first:][-3:]):  # the last few runs of this test
            report.sections.append((f"launcher run {i + 1}", run.tail(30)))
    return report


@pytest.fixture(scope="module")
def fake_world():
    """A fake process group of 8 ranks, so planning tests build meshes in one process.

    Reuses a group a test module already opened, and closes only its own.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    yield
    if created:
        dist.destroy_process_group()


@pytest.fixture
def fake_two():
    """A fake process group of 2 ranks, for one test; a group left open by another test is an error."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.fail("a process group is already open in this process (a test leaked it)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()
