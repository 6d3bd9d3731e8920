"""A local step graph built by a torch.compile backend (``[compile]``; Inductor by default).

The local graph (``compiled.py``) is ATen-level and functional and holds its
collectives as functional ops, so it goes to the backend as it is, with no
Dynamo trace: Inductor fuses its pointwise kernels and plans its buffers
(Triton on GPUs, C++ on CPUs), and the collectives stay calls on the same
process groups, in the same order.

The backend gets a copy without dead nodes: the CPU attention kernels,
recorded in real mode, leave data-dependent ops (``nonzero``) that nothing
reads, and a backend's fake-tensor pass refuses those. On gloo that copy keeps one
collective in flight, or each group runs them one at a time (``inflight.py``). The traced graph itself
is kept as it is for the plan check and for deriving the validation graph.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable

import torch
from torch import fx

from torchtitan_autoparallel.execute import inflight

logger = logging.getLogger("torchtitan_autoparallel")


class BackendGraph:
    """Runs ``graph`` through ``backend``'s build of it, made on the first call (a
    backend specialises on the shapes, devices and dtypes of real inputs)."""

    def __init__(self, graph: fx.GraphModule, backend: str, what: str) -> None:
        self.graph = graph
        self.backend = backend
        self.what = what  # for the log: which graph this is
        self.compiled: Callable | None = None

    def __call__(self, *inputs: torch.Tensor):
        if self.compiled is None:
            self.compiled = self._build(inputs)
        return self.compiled(*inputs)

    def _build(self, inputs: tuple[torch.Tensor, ...]) -> Callable:
        from torch._dynamo import lookup_backend

        start = time.perf_counter()
        live = copy.deepcopy(self.graph)  # backends may rewrite the graph they are given
        live.graph.eliminate_dead_code()
        live.recompile()
        mode = inflight.gloo_mode()
        if mode == "queued":
            logger.info(
                f"compile: gloo runs the collectives of the {self.what} one per group at a time, "
                "in the backend's order (one worker thread per group; execute/inflight.py)"
            )
        elif mode:
            chained, blocking = inflight.one_in_flight(live, chained=mode == "chained")
            logger.info(
                f"compile: gloo keeps one collective of the {self.what} in flight at a time "
                f"({chained} chained, {blocking} blocking; execute/inflight.py)"
            )
        try:
            compiled = lookup_backend(self.backend)(live, list(inputs))
        except Exception as e:
            raise RuntimeError(
                f"compile.backend = {self.backend!r} failed on the {self.what}; "
                "compile.enable = false runs it uncompiled"
            ) from e
        logger.info(
            f"compile: {self.backend} built the {self.what} in {time.perf_counter() - start:.1f} s "
            f"({len(live.graph.nodes)} of {len(self.graph.graph.nodes)} nodes live)"
        )
        return compiled
