"""The trainer with one rank held up, for the collective-timeout tests.

    python -m torchtitan_autoparallel.launch.launch --ngpu 2 ... -- -m _stalling_rank WHERE SECONDS JOB_ARGS...

``solve``: rank 0's solve takes SECONDS longer, while the other ranks wait for its plan.
``step``: rank 1 starts its second step SECONDS late, while rank 0 waits in a collective.
"""

from __future__ import annotations

import os
import sys
import time

from torch.distributed.elastic.multiprocessing.errors import record

from torchtitan_autoparallel.launch import main as train_main
from torchtitan_autoparallel.mesh.runtime import exit_process
from torchtitan_autoparallel.planner.plan import agree
from torchtitan_autoparallel.train.auto import AutoTraining


def _slow_solve(seconds: float) -> None:
    original = agree.solve_on_rank0

    def solve_on_rank0(built, solve, group=None):
        def slow():
            print(f"stalling the solve for {seconds:.0f} s", file=sys.stderr, flush=True)
            time.sleep(seconds)
            return solve()

        return original(built, slow, group)

    agree.solve_on_rank0 = solve_on_rank0


def _late_second_step(seconds: float) -> None:
    original = AutoTraining.train_step
    calls = []

    def train_step(self, batches):
        calls.append(1)
        if len(calls) == 2:
            time.sleep(seconds)
        return original(self, batches)

    AutoTraining.train_step = train_step


if __name__ == "__main__":
    where, seconds, job_args = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
    rank = os.environ["RANK"]
    if where == "solve" and rank == "0":
        _slow_solve(seconds)
    elif where == "step" and rank == "1":
        _late_second_step(seconds)
    exit_process(record(train_main.main)(job_args))
