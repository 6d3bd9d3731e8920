"""The garbage collector on a schedule during training (``training.gc_freq``)."""

from __future__ import annotations

import gc

import pytest

from torchtitan_autoparallel.train.garbage import ScheduledGC


@pytest.fixture
def collections(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation) or 0)
    was_enabled = gc.isenabled()
    yield calls
    gc.enable() if was_enabled else gc.disable()


def test_off_while_training_and_collected_every_freq_steps(collections: list[int]) -> None:
    gc.enable()
    with ScheduledGC(3) as collector:
        assert not gc.isenabled()
        assert collections == [1]  # once before the first step
        for step in range(1, 8):
            collector.step(step)
    assert collections == [1, 1, 1]  # ... and after steps 3 and 6
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off(collections: list[int]) -> None:
    gc.disable()
    with ScheduledGC(1) as collector:
        collector.step(1)
    assert not gc.isenabled() and collections == [1, 1]


def test_restored_when_training_stops_with_an_error(collections: list[int]) -> None:
    gc.enable()
    with pytest.raises(KeyboardInterrupt), ScheduledGC(5):
        raise KeyboardInterrupt
    assert gc.isenabled()
