"""A stand-in for the training module in the launcher tests: rank 1 fails as told.

    python -m torchtitan_autoparallel.launch.launch --ngpu 2 ... -- -m _failing_rank crash|user|kill

Every other rank waits until the agent stops it, as ranks blocked in a
collective would be. ``kill``: rank 1 dies of SIGKILL (as by the out-of-memory
killer) while rank 0 waits for it in a gloo collective, which fails as the
trainer's would (``failures.explain_collective_failure``).
"""

from __future__ import annotations

import os
import sys
import time

from torch.distributed.elastic.multiprocessing.errors import record

from torchtitan_autoparallel.train.failures import USER_ERROR_EXIT, record_user_error

BAD_INPUT = "rank.setting = 7 is too large; accepted: 1 to 5"


@record
def main(how: str) -> None:
    if os.environ["RANK"] != "1":
        time.sleep(60)
        return
    if how == "crash":
        raise RuntimeError("boom on rank 1")
    record_user_error(BAD_INPUT)
    sys.exit(USER_ERROR_EXIT)


def killed_peer() -> int:
    import signal

    import torch
    import torch.distributed as dist

    from torchtitan_autoparallel.train.failures import explain_collective_failure

    dist.init_process_group("gloo")
    dist.barrier()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        dist.all_reduce(torch.ones(1))  # rank 1 never comes: gloo finds its connection gone
    except Exception as e:
        if (status := explain_collective_failure(e)) is None:
            raise
        return status
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "kill":
        os._exit(killed_peer())
    main(sys.argv[1])
