"""Check a job, then start its ranks, in one process: what ``run_train.sh`` runs.

    python -m torchtitan_autoparallel.launch.launch --ngpu N|auto [torchrun options] -- -m MODULE ARGS...

Counting the GPUs, the preflight check (``preflight.py``) and torchrun each
used to be a separate Python process, and each paid for importing torch (and
the check for torchtitan's models) before any rank started: several seconds of
a start-up that should take a few on a cached plan. Here they share one
interpreter: the GPU count and the check happen first, and torchrun's own
``main`` then starts the ranks, exactly as ``python -m torch.distributed.run``.
On a single CPU host the ranks are forked (``forked_rank.py``) from a fork
server forked from this process after the check, so that they start with all
of that imported; GPU and multi-node jobs start new processes.

With ``COMM_MODE=fake_backend`` no ranks are started: the module runs in this
process, playing rank 0 of NGPU ranks on a fake process group.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.util
import os
import runpy
import socket
import sys
import threading
import traceback
import uuid
from collections.abc import MutableMapping
from pathlib import Path
from typing import NoReturn

from torchtitan_autoparallel.compat import check_versions
from torchtitan_autoparallel.config import load_config
from torchtitan_autoparallel.errors import ConfigError, UserError, print_traceback_if_asked
from torchtitan_autoparallel.launch.help import help_for, wants_help
from torchtitan_autoparallel.launch.preflight import check, parse_comm_mode, parse_log_ranks, parse_ngpu
from torchtitan_autoparallel.mesh.runtime import LAUNCHER_PID_ENV, die_with_parent
from torchtitan_autoparallel.train import failures

CPU_DEFAULT_RANKS = 4
TRAIN_MODULE = "torchtitan_autoparallel.launch.main"
FORK_ENV = "AUTOPARALLEL_FORK_RANKS"  # 0: start each CPU rank as a new process
FORKED_RANK = str(Path(__file__).with_name("forked_rank.py"))  # torchrun's --run-path wants a path
FORK_SERVER = "forkserver"  # the start method of forked CPU ranks
SERVER_NAME = "tap-forkserver"  # the fork server's process name (``pgrep -x``)
LOOPBACK, LOOPBACK_INTERFACE = "127.0.0.1", "lo"  # where a single-node job's sockets listen
PR_SET_NAME = 15  # prctl(2)
# What the fork server imports for the ranks: the trainer and what the preflight check
# imports inside its functions (``preflight.check``). A server forked after the check has
# most of it already; one that is not (another module's job, or Python's own server)
# imports it all, and each rank imports anything missing here itself.
RANK_IMPORTS = [
    TRAIN_MODULE, "torchtitan_autoparallel.execute.inflight", "torchtitan_autoparallel.models.registry",
    "torchtitan_autoparallel.train.checkpoint", "torchtitan_autoparallel.train.setup",
    "torchtitan_autoparallel.data.tokenizer", "torchtitan.models.llama3", "torchtitan.models.qwen3",
]
USAGE = "usage: launch --ngpu N|auto [torchrun options] -- -m MODULE [ARGS...]"


def main(argv: list[str]) -> int:
    try:
        check_versions()  # before anything imports torchtitan: an unsupported pair is one line
        ngpu_arg, torchrun_args, module, module_args = _split(argv)
        if module == TRAIN_MODULE and wants_help(module_args):
            print(help_for(module_args))
            return 0
        gpus = _gpu_count()
        ngpu = parse_ngpu(ngpu_arg) if ngpu_arg != "auto" else (gpus or CPU_DEFAULT_RANKS)
        fake = parse_comm_mode(os.environ.get("COMM_MODE", ""))
        if (shown := failures.ranks_filter(torchrun_args)) is not None:
            parse_log_ranks(shown, ngpu)  # torchrun would show no output for a rank it does not start
        start = rank_start(gpus, torchrun_args, os.environ.get(FORK_ENV, "1"))
        if gpus == 0:
            share_cpu_cores(ngpu, os.environ)
        torchrun_args = loopback_only(torchrun_args, gpus, os.environ)
        if module == TRAIN_MODULE:
            check(load_config(module_args), ngpu, fake)
    except UserError as e:
        print_traceback_if_asked()
        print(f"error: {e}", file=sys.stderr)
        return 2
    if FORK_SERVER in start and not fake:
        start_fork_server()
    if fake and module == TRAIN_MODULE:
        os.environ["NGPU"] = str(ngpu)
        sys.argv = [module, *module_args]
        run_as_main(module)
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
    """Start the process that forks the ranks, with the trainer imported.

    The ranks used to be forked from this process once torchrun had started its
    store servers and rendezvous threads here; a child forked while other threads
    run can inherit a lock one of them held, the likeliest cause of the one CI run
    whose last of 8 ranks never got past connecting to the store. The fork server
    runs no thread of torchrun's. It is forked from this process before torchrun
    starts, when the check has imported the trainer and no other Python thread
    runs, so nothing is imported twice. (numpy's OpenBLAS keeps a thread here, but
    stops it for the length of every fork.) Where another Python thread runs,
    Python's own fork server, a new interpreter that imports the trainer again
    (``RANK_IMPORTS``), is started instead. Either passes on this process's
    environment: the ranks' core share and ``LAUNCHER_ENV``.
    """
    os.environ[failures.LAUNCHER_ENV] = "1"
    multiprocessing.set_forkserver_preload(RANK_IMPORTS)
    if threading.active_count() == 1:
        _fork_fork_server()
    multiprocessing.forkserver.ensure_running()  # a no-op when the fork above started it


def _fork_fork_server() -> None:
    """Fork the fork server from here, and register it where multiprocessing looks for it.

    multiprocessing has no public way to adopt a server it did not start; its own
    ``ensure_running`` leaves a running one alone, and sets up the rest (the resource
    tracker, after this fork, so that the server does not hold the tracker's pipe).
    """
    server = multiprocessing.forkserver._forkserver
    listener = socket.socket(socket.AF_UNIX)
    address = multiprocessing.connection.arbitrary_address("AF_UNIX")
    listener.bind(address)
    if not multiprocessing.util.is_abstract_socket_namespace(address):
        os.chmod(address, 0o600)  # only this user's processes may ask for a fork
    listener.listen()
    alive_r, alive_w = os.pipe()  # the server ends when every holder of alive_w has
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(alive_w)
        _serve_forks(listener.fileno(), alive_r)
    os.close(alive_r)
    listener.close()
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid


def _serve_forks(listener_fd: int, alive_r: int) -> NoReturn:
    """The forked server's life: multiprocessing's server loop, until the launcher ends."""
    code = 0
    try:
        name_process(SERVER_NAME)
        die_with_parent()
        multiprocessing.forkserver.main(listener_fd, alive_r, RANK_IMPORTS)
    except SystemExit:
        pass
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)  # never this process's exit hooks: they are the launcher's


def run_as_main(module: str) -> None:
    """Run MODULE as ``python -m MODULE`` would. The preflight check, and the fork
    server's preload, imported it only for its imports; a new interpreter would not
    hold it yet, and runpy warns of that first copy (a RuntimeWarning at the top of
    every job's output), so it is dropped first."""
    sys.modules.pop(module, None)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def name_process(name: str) -> None:
    """Show ``name`` for this process in ps and pgrep (a forked one's command line stays the launcher's)."""
    try:
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode())
    except (OSError, AttributeError):
        pass


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


def loopback_only(torchrun_args: list[str], gpus: int, env: MutableMapping[str, str]) -> list[str]:
    """A single-node job's torchrun options, with its stores reachable from this host only.

    ``--standalone`` has torchrun host its rendezvous store, and the store the ranks'
    process group shares, on every interface of the host: anyone who can reach the
    machine could write into a running job's store. A single-node job needs none of
    that, so its rendezvous runs on 127.0.0.1 (``--local-addr`` is also where the ranks
    find the shared store), both stores listen there only (``_bind_stores_to_loopback``),
    and CPU ranks' gloo connections listen there too (unless ``GLOO_SOCKET_IFNAME`` is
    set). Multi-node options are kept as they are.
    """
    if "--standalone" not in torchrun_args:
        return torchrun_args
    if gpus == 0:
        env.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_INTERFACE)
    rest = [a for a in torchrun_args if a != "--standalone"]
    return ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{LOOPBACK}:0", "--rdzv-id", uuid.uuid4().hex,
            "--local-addr", LOOPBACK, *rest]


def _bind_stores_to_loopback() -> None:
    """torchrun's two TCP stores (the rendezvous's, and the one it shares with the ranks)
    listen on every interface whatever host they are given; where that host is a
    loopback address, each is handed a socket already listening there instead."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, dynamic_rendezvous

    c10d_rendezvous_backend.TCPStore = _store_on_host
    dynamic_rendezvous.DynamicRendezvousHandler._create_tcp_store_server = (
        lambda self, addr, port: _store_on_host(addr, port, is_master=True, multi_tenant=True)
    )


def _store_on_host(host: str, port: int, *args, is_master: bool = False, **kwargs):
    """``TCPStore(host, port, ...)``; a server on a loopback host listens on it alone."""
    from torch.distributed import TCPStore

    if not is_master or not _is_loopback(host) or "master_listen_fd" in kwargs:
        return TCPStore(host, port, *args, is_master=is_master, **kwargs)
    listener = socket.create_server((host, port), backlog=socket.SOMAXCONN)
    bound = listener.getsockname()[1]  # a chosen port when ``port`` is 0
    return TCPStore(host, bound, *args, is_master=True, master_listen_fd=listener.detach(), **kwargs)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _torchrun(args: list[str]) -> int:
    """torchrun's ``main``; a failed rank ends in one ``error:`` line (``failures.py``)
    instead of torchrun's traceback and per-rank report."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run  # its ``main`` less its ``record``

    os.environ[failures.LAUNCHER_ENV] = "1"
    # a rank started as a new process ends with this one (``runtime.end_with_launcher``)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    # its "closing signal SIGTERM" and "failed (exitcode: ...)" lines: the report says it
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.CRITICAL)  # the same, for forked ranks
    _bind_stores_to_loopback()
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
