"""A CPU rank forked from the launcher's fork server, made to look like a freshly started process.

    launch.py -> torchrun --run-path --start-method forkserver THIS_FILE MODULE ARGS...

Each rank used to start a new interpreter and import torch, torchtitan and this
package again, about 5 s of CPU per rank. On CPU hosts, where ranks share a few
cores, the launcher instead forks a fork server once its preflight check has
imported the trainer, before torchrun starts; torchrun has the server fork each
rank (its ``--run-path`` runs this file in the child), and the ranks start with
everything imported. The server runs none of torchrun's threads, so a rank
cannot inherit a lock one of them held (``launch.start_fork_server``).

A forked child inherits more than modules, so this file undoes what a new
process would not have: the launcher's session (torchrun starts each rank in
its own, so a terminal's Ctrl-C reaches the launcher only), the server's
process name and multiprocessing start method, any signal handler, logging
handler or exit hook set before the fork, and thread counts fixed when torch
was loaded, before the launcher chose each rank's share of the cores. At the
end it runs the rank's own exit hooks, which a forked child would otherwise
skip; ``runtime.exit_process`` returns to torchrun instead of ending the
process, so that torchrun collects the rank's result. GPU and multi-node jobs
keep separate processes (CUDA cannot be used across a fork).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import signal
import sys
import traceback
from pathlib import Path

from torchtitan_autoparallel.launch.launch import name_process, run_as_main
from torchtitan_autoparallel.mesh.runtime import FORKED_RANK_ENV, die_with_parent


def _fresh_process_state() -> None:
    os.environ[FORKED_RANK_ENV] = "1"
    name_process(Path(sys.executable).name)  # not the fork server's name
    die_with_parent()  # the fork server, which itself ends with the launcher
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
        run_as_main(module)
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
