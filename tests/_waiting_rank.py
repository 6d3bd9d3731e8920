"""A stand-in for the training module: each rank starts its process group, says so,
then waits until told to end (a file), so that a test can look at a running job.

    python -m torchtitan_autoparallel.launch.launch --ngpu 2 ... -- -m _waiting_rank FOLDER
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from torchtitan_autoparallel.mesh.runtime import exit_process, init_runtime, shutdown


def main(folder: Path) -> int:
    runtime = init_runtime()
    (folder / f"ready{runtime.rank}").write_text(str(os.getpid()))
    end = time.monotonic() + 120  # never outlive a test that failed to say "done"
    while not (folder / "done").exists() and time.monotonic() < end:
        time.sleep(0.1)
    shutdown()
    return 0


if __name__ == "__main__":
    exit_process(main(Path(sys.argv[1])))
