"""Python's garbage collector on a schedule during training (torchtitan's ``training.gc_freq``).

Left automatic, the collector runs whenever allocations cross its thresholds:
at a different moment on every rank, and a rank paused in a collection holds
up every collective the others are waiting in. So while the loop runs it is
off, and every rank collects the younger generations at the same steps.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger("torchtitan_autoparallel")

GENERATION = 1  # the two younger generations: what a step's short-lived cycles land in


class ScheduledGC:
    def __init__(self, freq: int) -> None:
        self.freq = freq
        self.was_enabled = True  # read again on entry

    def __enter__(self) -> ScheduledGC:
        self.was_enabled = gc.isenabled()
        gc.disable()
        gc.collect(GENERATION)  # planning's garbage: collected once, before the first step
        return self

    def __exit__(self, *exc) -> None:
        if self.was_enabled:
            gc.enable()

    def step(self, step: int) -> None:
        if step % self.freq == 0:
            start = time.perf_counter()
            gc.collect(GENERATION)
            logger.debug(f"garbage collection after step {step}: {time.perf_counter() - start:.3f} s")
