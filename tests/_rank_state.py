"""A stand-in for the training module: each rank writes down the process state it
started in, then leaves by ``runtime.exit_process`` as the trainer does.

    python -m torchtitan_autoparallel.launch.launch --ngpu 2 ... -- -m _rank_state OUT_FOLDER
"""

from __future__ import annotations

import atexit
import json
import logging
import multiprocessing
import os
import signal
import sys
from pathlib import Path

import torch
from _run import process_name  # tests/ is on the ranks' path

from torchtitan_autoparallel.mesh.runtime import FORKED_RANK_ENV, exit_process


def main(out: Path) -> None:
    rank = os.environ["RANK"]
    state = {
        "forked": os.environ.get(FORKED_RANK_ENV) == "1",
        "own_session": os.getsid(0) == os.getpid(),
        "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "sigint_raises": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "root_log_handlers": len(logging.root.handlers),
        "default_start_method": multiprocessing.get_start_method() == multiprocessing.get_all_start_methods()[0],
        "parent_threads": _thread_names(os.getppid()),
        "name": process_name(os.getpid()),
        "parent_name": process_name(os.getppid()),
    }
    (out / f"state{rank}.json").write_text(json.dumps(state))
    atexit.register(lambda: (out / f"exit_hook{rank}").write_text("ran"))
    print(f"rank {rank} reported", flush=True)


def _thread_names(pid: int) -> list[str]:
    """The names of ``pid``'s threads; torch names its store and torchrun threads ``pt_...``."""
    return sorted({(task / "comm").read_text().strip() for task in Path(f"/proc/{pid}/task").iterdir()})


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    exit_process(0)
