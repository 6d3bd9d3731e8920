"""A stand-in for the training module in the launcher tests: rank 1 fails as told.

    python -m torchtitan_autoparallel.train.launch --ngpu 2 ... -- -m _failing_rank crash|user

Every other rank waits until the agent stops it, as ranks blocked in a
collective would be.
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


if __name__ == "__main__":
    main(sys.argv[1])
