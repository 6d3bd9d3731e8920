"""``jit.py``: loops compiled on first use, or run as Python, to the same plan."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from torchtitan_autoparallel import jit

# Plans the debug model on a 1-D and a 2-D fake mesh; prints each plan's objective
# and how many loop versions numba compiled or loaded for it.
_PLAN = r"""
import json
import numba
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchtitan_autoparallel import jit
from torchtitan_autoparallel.models.registry import build_meta_model
from torchtitan_autoparallel.planner.cost import pricer
from torchtitan_autoparallel.planner.cost.profiles import load_profile
from torchtitan_autoparallel.planner.plan.api import plan_stages
from torchtitan_autoparallel.planner.plan.options import PlannerOptions
from torchtitan_autoparallel.planner.problem import sums
from torchtitan_autoparallel.planner.solve.approx import kernels as approx_kernels
from torchtitan_autoparallel.planner.solve.approx import local_search, mrf, trws
from torchtitan_autoparallel.planner.solve.presolve import kernels

def compiled_versions():
    return sum(len(f.signatures) for m in (pricer, sums, kernels, approx_kernels, local_search, mrf, trws)
               for f in vars(m).values() if isinstance(f, jit.Loop))

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
out = {}
for shape, names in (((8,), ("dp_shard",)), ((2, 4), ("dp_shard", "tp"))):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    stages = plan_stages(build_meta_model("llama3", "debugmodel", n_layers=2), mesh,
                         PlannerOptions(global_batch_size=8, seq_len=128, profile=load_profile("h100")))
    out[len(shape)] = [stages.plan.objective, compiled_versions()]
print("RESULT", json.dumps(out))
"""


def _plan(env: dict[str, str]) -> dict[str, list[float]]:
    done = subprocess.run(
        [sys.executable, "-c", _PLAN], capture_output=True, text=True, timeout=900,
        env={**os.environ, **env},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.split("RESULT", 1)[1])


def test_a_1d_plan_compiles_nothing_and_every_mode_plans_the_same() -> None:
    """A 1-D mesh plans with the loops as Python (no version compiled or loaded), a
    2-D one compiled; with numba switched off (``NUMBA_DISABLE_JIT=1``) both plan
    as Python, to the same objectives."""
    default = _plan({})
    assert default["1"][1] == 0  # nothing compiled for the 1-D plan
    assert default["2"][1] > 0  # the 2-D plan ran compiled
    python = _plan({"NUMBA_DISABLE_JIT": "1"})
    assert python["1"][0] == default["1"][0]
    assert python["2"][0] == default["2"][0]


@jit.inline
def _twice(x: float) -> float:
    return 2.0 * x


@jit.jit
def _sum_twice(v: np.ndarray) -> float:
    total = 0.0
    for x in v:
        total += _twice(x)
    return total


def test_python_mode_compiles_neither_the_loop_nor_what_it_calls() -> None:
    v = np.arange(5.0)
    with jit.compiled(False):
        assert _sum_twice(v) == 20.0
    assert not _sum_twice.signatures and not _twice.signatures
    assert _sum_twice(v) == 20.0  # compiled now, the same answer
    assert _sum_twice.signatures


@jit.jit
def _slow(x: float) -> float:
    return x + 1.0


def test_a_first_call_that_takes_long_says_it_is_compiling(monkeypatch, caplog) -> None:
    """A cold cache compiles for minutes: the log says so while it runs, then how long."""
    monkeypatch.setattr(jit, "COMPILE_NOTICE_S", 0.05)
    monkeypatch.setitem(jit._state, "first_calls_s", 0.0)
    # a compile that takes 0.3 s, without numba's own time on top
    monkeypatch.setattr(jit.CPUDispatcher, "__call__", lambda self, *a: time.sleep(0.3) or self.py_func(*a))
    with caplog.at_level(logging.INFO, logger="torchtitan_autoparallel.planner"):
        assert _slow(1.0) == 2.0
        assert _slow(2.0) == 3.0  # later calls: no more lines
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert said[0].startswith("compiling the planner's loops for test_jit._slow, once per machine")
    assert said[1].startswith("compiled the planner's loops for test_jit._slow in 0.")


@jit.jit
def _first(x: float) -> float:
    return x + 1.0


@jit.jit
def _second(x: float) -> float:
    return x + 2.0


def test_short_first_calls_that_add_up_say_they_are_compiling(monkeypatch, caplog) -> None:
    """A solve's many loops each compile in a few seconds: once their first calls
    add up past the threshold, the next one says it is compiling."""
    monkeypatch.setattr(jit, "COMPILE_NOTICE_S", 1.0)
    monkeypatch.setitem(jit._state, "first_calls_s", 0.0)
    monkeypatch.setattr(jit.CPUDispatcher, "__call__", lambda self, *a: time.sleep(0.6) or self.py_func(*a))
    with caplog.at_level(logging.INFO, logger="torchtitan_autoparallel.planner"):
        assert _first(1.0) == 2.0  # 0.6 s: under the threshold, not a word
        assert not caplog.records
        assert _second(1.0) == 3.0  # 1.2 s in all: said as it ran
    said = [r.getMessage() for r in caplog.records]
    assert said == ["compiling the planner's loops for test_jit._second, once per machine "
                    "(numba caches them) ..."], said


def _uncached_loop(fn):
    """A loop as ``jit.jit`` makes it, without numba's disk cache: its first call compiles."""
    return jit.Loop(py_func=fn, locals={}, targetoptions={"nopython": True})


def test_compile_time_is_counted_once_and_apart_from_the_run() -> None:
    """A loop's first call compiles it and the loop it calls (a nested compile): the
    clock counts that once (never more than the call's wall time), and later calls,
    which compile nothing, add nothing."""

    def inner(x):
        return x * 3.0

    inner_loop = _uncached_loop(inner)

    def outer(v):
        total = 0.0
        for x in v:
            total += inner_loop(x)
        return total

    outer_loop = _uncached_loop(outer)
    v = np.arange(4.0)
    before = jit.compile_seconds()
    start = time.perf_counter()
    assert outer_loop(v) == 18.0
    first_call = time.perf_counter() - start
    compiled = jit.compile_seconds() - before
    assert inner_loop.signatures and outer_loop.signatures  # both compiled in that call
    assert 0.05 < compiled <= first_call  # a real compile (tenths of a second), counted once
    again = jit.compile_seconds()
    assert outer_loop(v) == 18.0 and jit.compile_seconds() == again  # compiled: no more clocking


def test_a_stage_clock_books_compiles_apart(monkeypatch) -> None:
    """Seconds spent compiling during a stage go to "compile", not to the stage."""
    from torchtitan_autoparallel.planner.plan import api

    compile_total = {"s": 10.0}
    monkeypatch.setattr(jit, "compile_seconds", lambda: compile_total["s"])
    clock = api._StageClock()
    time.sleep(0.05)
    clock.lap("trace")  # nothing compiled
    time.sleep(0.3)
    compile_total["s"] += 0.2  # of the 0.3 s, 0.2 s compiled
    clock.lap("solve")
    t = clock.timings
    assert list(t) == ["trace", "solve", "compile"]
    assert t["compile"] == pytest.approx(0.2)
    assert 0.09 <= t["solve"] < 0.25 and t["trace"] >= 0.05
    assert sum(t.values()) == pytest.approx(clock.elapsed(), abs=0.02)
