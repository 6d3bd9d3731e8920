"""``train/tensor_memory.py``: a CPU step's peak of tensor memory, counted from storages and
the allocator's traffic (not the process's resident set)."""

from __future__ import annotations

import json

import torch

from torchtitan_autoparallel.train.tensor_memory import (
    TensorMemoryProbe,
    _frees_unseen,
    live_tensor_bytes,
    replay_allocations,
)

MB = 10**6


def _step(held: list, temp_mb: int, keep_mb: int) -> None:
    """A step that makes a temporary of ``temp_mb``, frees it, and keeps ``keep_mb``."""
    temp = torch.empty(temp_mb * MB, dtype=torch.uint8)
    temp.fill_(1)
    del temp
    held.append(torch.ones(keep_mb * MB, dtype=torch.uint8))


def test_the_measured_step_counts_what_was_live_and_its_largest_temporary(tmp_path) -> None:
    held = [torch.zeros(5 * MB, dtype=torch.uint8)]
    with TensorMemoryProbe(2, 1, 0, torch.device("cpu"), str(tmp_path)) as probe:
        _step(held, temp_mb=50, keep_mb=1)  # step 1: not measured
        probe.step(1)
        _step(held, temp_mb=20, keep_mb=3)  # step 2: measured
        probe.step(2)
        _step(held, temp_mb=90, keep_mb=1)  # step 3: not measured
        probe.step(3)
    r = probe.result
    assert r is not None and r.step == 2
    # at its start: 5 + 1 MB held (and whatever else this process keeps)
    assert r.start_bytes >= 6 * MB
    assert 20 * MB <= r.peak_bytes - r.start_bytes < 21 * MB  # the 20 MB temporary, freed before the 3 MB kept
    assert 3 * MB <= r.end_bytes - r.start_bytes < 4 * MB
    written = json.loads((tmp_path / "tensor_memory_rank0.json").read_text())
    assert written["peak_bytes"] == r.peak_bytes


def test_views_share_their_storage_and_count_once() -> None:
    before = live_tensor_bytes()
    base = torch.empty(8 * MB, dtype=torch.uint8)
    views = [base[:MB], base.view(8, MB), base[MB:]]
    assert live_tensor_bytes() - before == 8 * MB
    del views, base


def test_a_gpu_rank_or_step_zero_measures_nothing(tmp_path) -> None:
    with TensorMemoryProbe(0, 1, 0, torch.device("cpu"), str(tmp_path)) as probe:
        probe.step(1)
    with TensorMemoryProbe(1, 1, 0, torch.device("meta"), str(tmp_path)) as gpu_like:
        gpu_like.step(1)
    assert probe.result is None and gpu_like.result is None
    assert not list(tmp_path.iterdir())


def test_a_free_the_profiler_missed_ends_when_its_address_is_handed_out_again() -> None:
    """A collective's buffer freed on gloo's worker thread has no free event; the allocator
    then reuses its address, which the replay takes as that buffer's end."""
    events = [(0xA, 100), (0xB, 50), (0xA, 30), (0xB, -50), (0xC, 10)]
    # The profiler's own total would read 100, 150, 180, 130, 140: 0xA's first 100 kept.
    assert replay_allocations(events) == [100, 150, 80, 30, 40]
    # A free of a storage made before the span was never counted: nothing to take off.
    assert replay_allocations([(0xD, -64), (0xE, 8)]) == [0, 8]


def test_a_free_the_profiler_missed_ends_at_the_next_wait_when_no_tensor_holds_it() -> None:
    """gloo's copy of a reduce-scatter's input is freed on its worker thread, unseen, and its
    address may never be reused: when no tensor holds it at the step's end, it ends at the
    first collective wait after it (its work done), else at the end of the op that made it."""
    # (time, address, size, end of the op that made it)
    events = [(1, 0xA, 100, 2), (3, 0xB, 50, 4), (5, 0xB, -50, 5), (6, 0xC, 8, 7), (9, 0xD, 4, 10)]
    assert _frees_unseen(events, waits=[4, 8], alive_at_end={0xC}) == [(4, 0xA, -100), (10, 0xD, -4)]
    assert _frees_unseen(events, waits=[], alive_at_end={0xA, 0xC, 0xD}) == []
