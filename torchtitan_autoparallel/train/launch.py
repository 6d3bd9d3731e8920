"""Check a job, then start its ranks, in one process: what ``run_train.sh`` runs.

    python -m torchtitan_autoparallel.train.launch --ngpu N|auto [torchrun options] -- -m MODULE ARGS...

Counting the GPUs, the preflight check (``preflight.py``) and torchrun each
used to be a separate Python process, and each paid for importing torch (and
the check for torchtitan's models) before any rank started: several seconds of
a start-up that should take a few on a cached plan. Here they share one
interpreter: the GPU count and the check happen first, and torchrun's own
``main`` then starts the ranks, exactly as ``python -m torch.distributed.run``.
On a single CPU host the ranks are forked (``forked_rank.py``) from a fork
server that imports the trainer while the check runs, so that they start
with all of that imported; GPU and multi-node jobs start new processes.

With ``COMM_MODE=fake_backend`` no ranks are started: the module runs in this
process, playing rank 0 of NGPU ranks on a fake process group.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import signal
import sys
from collections.abc import MutableMapping
from pathlib import Path

from torchtitan_autoparallel.config import load_config
from torchtitan_autoparallel.config.help import help_for, wants_help
from torchtitan_autoparallel.errors import ConfigError, UserError
from torchtitan_autoparallel.train import failures
from torchtitan_autoparallel.train.preflight import check, parse_ngpu

CPU_DEFAULT_RANKS = 4
TRAIN_MODULE = "torchtitan_autoparallel.train.main"
FORK_ENV = "AUTOPARALLEL_FORK_RANKS"  # 0: start each CPU rank as a new process
FORKED_RANK = str(Path(__file__).with_name("forked_rank.py"))  # torchrun's --run-path wants a path
FORK_SERVER = "forkserver"  # the start method of forked CPU ranks
# What the fork server imports for the ranks: the trainer and what the preflight check
# imports inside its functions (``preflight.check``), which ranks forked from the
# launcher used to inherit; each rank imports anything missing here itself.
RANK_IMPORTS = [
    TRAIN_MODULE, "torchtitan_autoparallel.execute.inflight", "torchtitan_autoparallel.models.registry",
    "torchtitan_autoparallel.train.checkpoint", "torchtitan_autoparallel.train.setup",
    "torchtitan_autoparallel.data.tokenizer", "torchtitan.models.llama3", "torchtitan.models.qwen3",
]
USAGE = "usage: launch --ngpu N|auto [torchrun options] -- -m MODULE [ARGS...]"


def main(argv: list[str]) -> int:
    try:
        ngpu_arg, torchrun_args, module, module_args = _split(argv)
        if module == TRAIN_MODULE and wants_help(module_args):
            print(help_for(module_args))
            return 0
        gpus = _gpu_count()
        ngpu = parse_ngpu(ngpu_arg) if ngpu_arg != "auto" else (gpus or CPU_DEFAULT_RANKS)
        fake = os.environ.get("COMM_MODE") == "fake_backend"
        start = rank_start(gpus, torchrun_args, os.environ.get(FORK_ENV, "1"))
        if gpus == 0:
            share_cpu_cores(ngpu, os.environ)
        if FORK_SERVER in start and not fake:
            start_fork_server()
        if module == TRAIN_MODULE:
            check(load_config(module_args), ngpu, fake)
    except UserError as e:
        stop_fork_server()
        print(f"error: {e}", file=sys.stderr)
        return 2
    if fake and module == TRAIN_MODULE:
        os.environ["NGPU"] = str(ngpu)
        sys.argv = [module, *module_args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0  # the module exits itself; reached only if it returns
    return _torchrun(["--nproc-per-node", str(ngpu), *torchrun_args, *start, module, *module_args])


def rank_start(gpus: int, torchrun_args: list[str], fork: str = "1") -> list[str]:
    """torchrun's options that start each rank on MODULE: forked from the fork server
    on one CPU host (``forked_rank.py``, ``start_fork_server``), a new ``python -m``
    process otherwise or when ``fork`` (``AUTOPARALLEL_FORK_RANKS``) is 0."""
    if fork not in ("0", "1"):
        raise ConfigError(f"{FORK_ENV}={fork!r} is not accepted; accepted: 1 (fork CPU ranks, the default) or 0")
    if fork == "1" and gpus == 0 and "--standalone" in torchrun_args:
        return ["--run-path", "--start-method", FORK_SERVER, FORKED_RANK]
    return ["-m"]


def start_fork_server() -> None:
    """Start the process that forks the ranks; it imports the trainer while the check runs.

    The ranks used to be forked from this process, once torchrun had started its
    store servers and rendezvous threads here. A child forked while other threads
    run can inherit a lock one of them held, the likeliest cause of the one CI run
    whose last of 8 ranks never got past connecting to the store. Python's fork
    server is a new interpreter that runs no thread of torchrun's. It is started
    with the ranks' environment (their core share, ``LAUNCHER_ENV``), which it
    passes on. It imports the trainer (``RANK_IMPORTS``) whatever the job's module
    is: that one may not guard its ``main`` against being imported.
    """
    os.environ[failures.LAUNCHER_ENV] = "1"
    multiprocessing.set_forkserver_preload(RANK_IMPORTS)
    multiprocessing.forkserver.ensure_running()


def stop_fork_server() -> None:
    """Stop the fork server, if started, when no rank is to be forked: it ends by itself
    only once its import is done, holding this process's output open until then (a
    ``| tee`` would wait for it). multiprocessing has no public way to stop it."""
    pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    if pid:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def share_cpu_cores(ranks: int, env: MutableMapping[str, str]) -> None:
    """Give each CPU rank an equal slice of the cores, unless the user chose already.

    Ranks on one machine that each use every core thrash: for their math threads
    (``OMP_NUM_THREADS``) and for Inductor's compile workers, which by default are
    one process per core in every rank (``TORCHINDUCTOR_COMPILE_THREADS``; at one
    thread a rank compiles in its own process, 11-13% faster on 2 to 4 ranks of
    2 cores).
    """
    per_rank = str(max(1, len(os.sched_getaffinity(0)) // ranks))
    env.setdefault("OMP_NUM_THREADS", per_rank)
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", per_rank)


def _torchrun(args: list[str]) -> int:
    """torchrun's ``main``; a failed rank ends in one ``error:`` line (``failures.py``)
    instead of torchrun's traceback and per-rank report."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run  # its ``main`` less its ``record``

    os.environ[failures.LAUNCHER_ENV] = "1"
    # its "closing signal SIGTERM" and "failed (exitcode: ...)" lines: the report says it
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.CRITICAL)  # the same, for forked ranks
    try:
        run(parse_args(args))
    except ChildFailedError as e:
        return failures.report(e, failures.shown_ranks(args))
    except SignalException as e:
        return failures.report_signal(e.sigval.name, int(e.sigval))
    return 0


def _split(argv: list[str]) -> tuple[str, list[str], str, list[str]]:
    """``--ngpu N [torchrun options] -- -m MODULE ARGS`` -> its four parts."""
    if len(argv) < 2 or argv[0] != "--ngpu" or "--" not in argv:
        raise ConfigError(USAGE)
    cut = argv.index("--")
    rest = argv[cut + 1 :]
    if len(rest) < 2 or rest[0] != "-m":
        raise ConfigError(USAGE)
    return argv[1], argv[2:cut], rest[1], rest[2:]


def _gpu_count() -> int:
    import torch  # imported by the check and by torchrun anyway: once, here

    return torch.cuda.device_count()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
