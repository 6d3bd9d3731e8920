"""Compile the planner's numba loops now, into numba's on-disk cache.

``make setup`` runs this once, so that the first plan on a machine does not
spend its first minute and a half compiling (``solvers/kernels.py``); any
later run loads the cached code in about a second. Run it again by hand
after changing a compiled module, or let the next plan recompile (logged).

    python -m torchtitan_autoparallel.planner.warm_up
"""

from __future__ import annotations

import logging
import time

from torchtitan_autoparallel.planner import pricer
from torchtitan_autoparallel.planner.solvers import kernels


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    pricer.warm_up()
    kernels.warm_up()
    logging.getLogger(__name__).info("planner kernels ready (%.1f s)", time.perf_counter() - start)


if __name__ == "__main__":
    main()
