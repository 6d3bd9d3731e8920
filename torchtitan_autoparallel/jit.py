"""The planner's compiled loops: numba, compiled on first use, or run as Python.

Every compiled module of the planner (``pricer``, ``sums``, the presolve's and
TRW-S' ``kernels``, ``mrf``, ``trws``, ``local_search``) decorates its loops with ``jit`` or
``inline`` from here instead of ``numba.njit``, so that one switch decides, per
plan, whether they run compiled or as the Python they are written in:

* compiled (the default): numba compiles a loop the first time it is called
  and caches the machine code on disk (``cache=True``), so only a machine's
  first run (and the first after an upgrade) pays the compile, minutes on 2
  cores for all of them. Once first calls (compiles, or loads from the cache)
  have taken ``COMPILE_NOTICE_S`` in a process, each one after says on the
  planner's log which loop it is compiling, and one that takes longer than
  that says how long it took, so a cold start is not a silent hang.
  ``compile_seconds`` is the time spent in numba's compiles (and cache loads)
  so far, apart from the first calls' own running time: ``plan_stages``
  reports it as its own line instead of inside the stage that triggered it.
* Python (``compiled(False)``): each loop runs its ``py_func``, and the loops it
  calls do too (a call from Python goes through ``Loop.__call__``), so nothing
  compiles. ``plan_stages`` asks for this on 1-D meshes, whose problems are
  small enough (a few strategies per node) that Python plans them in seconds,
  less than the compile alone; 2-D and 3-D meshes have hundreds of strategies
  per node, where Python is 50x slower than the compiled loops.

Both run the same code, and the loops add in a fixed order, so a plan's
objective is the same either way. ``NUMBA_DISABLE_JIT=1`` makes every loop a
plain function (numba's own switch), for debugging.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numba
from numba.core.registry import CPUDispatcher

LOG = logging.getLogger("torchtitan_autoparallel.planner")
COMPILE_NOTICE_S = 3.0  # a first call still running after this is compiling: say so
_state = {"compiled": True, "first_calls_s": 0.0}  # the seconds first calls took so far
# Compiles nest (a loop compiles the loops it calls inside its own compile): only the
# outermost one is clocked, per thread, so no second is counted twice.
_compile_clock = threading.local()
_compile_total = {"s": 0.0}


def compile_seconds() -> float:
    """Seconds this process has spent in numba compiles (or loading them from its cache)."""
    return _compile_total["s"]


class Loop(CPUDispatcher):
    """A numba dispatcher that runs its Python function while ``compiled(False)``
    is in force, and logs a first call that compiles for long."""

    _called = False

    def __call__(self, *args, **kwargs):
        if not _state["compiled"]:
            return self.py_func(*args, **kwargs)
        if self._called:
            return super().__call__(*args, **kwargs)
        self._called = True  # the first call compiles (or loads) what it calls too
        start = time.perf_counter()
        name = f"{self.py_func.__module__.rsplit('.', 1)[-1]}.{self.py_func.__name__}"
        # loading every loop from the cache takes about a second: past the notice's
        # threshold in all, first calls are compiling, each a few seconds at most
        notice = threading.Timer(max(COMPILE_NOTICE_S - _state["first_calls_s"], 0.0), LOG.info, (
            "compiling the planner's loops for %s, once per machine (numba caches them) ...", name,
        ))
        notice.daemon = True
        notice.start()
        try:
            return super().__call__(*args, **kwargs)
        finally:
            notice.cancel()
            seconds = time.perf_counter() - start
            _state["first_calls_s"] += seconds
            if seconds > COMPILE_NOTICE_S:
                LOG.info("compiled the planner's loops for %s in %.1f s", name, seconds)

    def compile(self, sig):
        if getattr(_compile_clock, "running", False):
            return super().compile(sig)
        _compile_clock.running = True
        start = time.perf_counter()
        try:
            return super().compile(sig)
        finally:
            _compile_clock.running = False
            _compile_total["s"] += time.perf_counter() - start


def _make(options: dict) -> Callable:
    def decorate(fn: Callable) -> Callable:
        if numba.config.DISABLE_JIT:
            return fn
        loop = Loop(py_func=fn, locals={}, targetoptions={"nopython": True, "nogil": True, "boundscheck": None, **options})
        loop.enable_caching()
        return loop

    return decorate


jit = _make({})
inline = _make({"inline": "always"})  # inlined into its compiled callers: no call, no refcounts


@contextmanager
def compiled(on: bool) -> Iterator[None]:
    """Run the loops compiled (``on``) or as Python within the block (module docstring)."""
    before, _state["compiled"] = _state["compiled"], on
    try:
        yield
    finally:
        _state["compiled"] = before
