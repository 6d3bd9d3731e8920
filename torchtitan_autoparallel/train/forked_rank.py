"""A CPU rank forked from the launcher, made to look like a freshly started process.

    launch.py -> torchrun --run-path --start-method fork THIS_FILE MODULE ARGS...

Each rank used to start a new interpreter and import torch, torchtitan and this
package again, about 5 s of CPU per rank, while the launcher had imported them
all already for its preflight check. On CPU hosts, where ranks share a few
cores, the launcher now forks its ranks instead (torchrun's ``--run-path``
runs this file in each child) and they start with everything imported.

A forked child inherits more than modules, so this file undoes what a new
process would not have: the launcher's session (torchrun starts each rank in
its own, so a terminal's Ctrl-C reaches the launcher only), its signal handlers
(torchrun's turn SIGTERM into an exception, which would change how a stopped
rank exits), its logging handlers and exit hooks, and thread counts fixed when
torch was loaded. At the end it runs the rank's own exit hooks, which a forked
child would otherwise skip; ``runtime.exit_process`` returns to torchrun instead
of ending the process, so that torchrun collects the rank's result. GPU and
multi-node jobs keep separate processes (CUDA cannot be used across a fork).
"""

from __future__ import annotations

import atexit
import logging
import os
import runpy
import signal
import sys
import traceback

from torchtitan_autoparallel.distributed.runtime import FORKED_RANK_ENV


def _fresh_process_state() -> None:
    os.environ[FORKED_RANK_ENV] = "1"
    os.setsid()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    atexit._clear()  # the launcher's exit hooks are the launcher's to run, not each rank's
    for handler in list(logging.root.handlers):
        logging.root.removeHandler(handler)
    # a new interpreter is unbuffered under torchrun (``python -u``)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    _share_threads()


def _share_threads() -> None:
    """OpenMP and Inductor read their thread counts when they load, in the launcher,
    before it chose this rank's share (``launch.share_cpu_cores``)."""
    import torch

    threads = _count("OMP_NUM_THREADS")
    if threads:
        torch.set_num_threads(threads)
    compile_threads = _count("TORCHINDUCTOR_COMPILE_THREADS")
    inductor_config = sys.modules.get("torch._inductor.config")
    if compile_threads and inductor_config is not None:
        inductor_config.compile_threads = compile_threads


def _count(name: str) -> int:
    """A positive count from the environment; 0 for unset or unreadable, which
    OpenMP too ignores."""
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else 0


def main() -> None:
    module, args = sys.argv[1], sys.argv[2:]
    _fresh_process_state()
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()  # as an interpreter would; torch's multiprocessing only queues it
        raise
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()


if __name__ == "__main__":  # torchrun runs this file with runpy.run_path
    main()
