"""A CPU rank forked from the launcher's fork server, made to look like a freshly started process.

    launch.py -> torchrun --run-path --start-method forkserver THIS_FILE MODULE ARGS...

Each rank used to start a new interpreter and import torch, torchtitan and this
package again, about 5 s of CPU per rank. On CPU hosts, where ranks share a few
cores, the launcher instead starts Python's fork server, which imports the
trainer once while the launcher runs its preflight check; torchrun has the server
fork each rank (its ``--run-path`` runs this file in the child), and the ranks
start with everything imported. The server is a new interpreter that runs none
of torchrun's threads, so a rank cannot inherit a lock one of them held
(``launch.start_fork_server``).

A forked child inherits more than modules, so this file undoes what a new
process would not have: the launcher's session (torchrun starts each rank in
its own, so a terminal's Ctrl-C reaches the launcher only), the server's
multiprocessing start method, and any signal handler, logging handler or exit
hook set while the server imported the trainer. At the end it runs the rank's
own exit hooks, which a forked child would otherwise skip;
``runtime.exit_process`` returns to torchrun instead of ending the process, so
that torchrun collects the rank's result. GPU and multi-node jobs keep separate
processes (CUDA cannot be used across a fork).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
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
    atexit._clear()  # the fork server's exit hooks are its own to run, not each rank's
    # the server's start method would be this rank's default: its locks and queues would
    # then be registered with the launcher's resource tracker, which warns of each one a
    # stopped rank leaves behind
    multiprocessing.set_start_method(None, force=True)
    for handler in list(logging.root.handlers):
        logging.root.removeHandler(handler)
    # a new interpreter is unbuffered under torchrun (``python -u``)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)


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
