"""Process-group start-up: the device and backend are picked from the machine.

* ``cuda`` + NCCL where GPUs exist, else ``cpu`` + gloo;
* ``COMM_MODE=fake_backend``: one process plays rank 0 of ``NGPU`` ranks on a
  fake process group, to check configs and plan for clusters we do not have.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from torchtitan_autoparallel.compat import set_timeout
from torchtitan_autoparallel.cpu_compat import one_gloo_worker_thread, point_torchtitan_at

FORKED_RANK_ENV = "TORCHTITAN_AUTOPARALLEL_FORKED_RANK"  # set in a rank forked by the launcher
# where each rank whose collective timed out says so, in the job's store (``ranks_that_never_arrived``)
TIMED_OUT_KEY = "autoparallel/collective_timed_out/"
LAUNCHER_PID_ENV = "TORCHTITAN_AUTOPARALLEL_LAUNCHER_PID"  # the launcher's pid, for its ranks
PR_SET_PDEATHSIG = 1  # prctl(2)
ARRIVAL_GRACE_S = 10.0  # how long such a rank waits for the others to say the same


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    backend: str  # "nccl" | "gloo" | "fake"
    rank: int
    world_size: int
    local_rank: int

    @property
    def device_type(self) -> str:
        return self.device.type

    @property
    def fake(self) -> bool:
        return self.backend == "fake"


def detect_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_runtime(comm_mode: str = "", timeout: timedelta | None = None, one_gloo_thread: bool = False) -> Runtime:
    """Start the process group for this rank (torchrun sets RANK/WORLD_SIZE).

    ``timeout``: every collective's, until ``set_collective_timeout`` (None: torch's default).
    ``one_gloo_thread``: gloo groups (this one and the device mesh's) get one worker
    thread each (``cpu_compat.one_gloo_worker_thread``).
    """
    end_with_launcher()
    device_type = detect_device_type()
    point_torchtitan_at(device_type)
    if comm_mode == "fake_backend":
        return _init_fake(int(os.environ.get("NGPU", os.environ.get("WORLD_SIZE", "1"))))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        if one_gloo_thread:
            one_gloo_worker_thread()
    if "RANK" not in os.environ:  # a plain `python -m`: be a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group(backend=backend, device_id=device if backend == "nccl" else None, timeout=timeout)
    # gloo's connectFullMesh can return on one rank while a peer is still handshaking;
    # a rank that then exits at once (a bad argument found right after start-up) would
    # crash that peer with "Connection closed by peer" on top of the one-line error.
    dist.barrier()
    return Runtime(device, backend, dist.get_rank(), dist.get_world_size(), local_rank)


def end_with_launcher() -> None:
    """A rank our launcher started as a new process (GPU, multi-node, or
    ``AUTOPARALLEL_FORK_RANKS=0``) ends when the launcher does, even by SIGKILL.

    torchrun's agent runs inside the launcher and starts each rank as its child; a
    launcher killed outright runs no handler, so its ranks used to train on, then wait
    forever in a collective once a peer went. Forked ranks follow their fork server
    instead (``forked_rank.py``). The variable is removed so that the rank's own
    children (Inductor's compile workers) do not read it as theirs.
    """
    launcher = os.environ.pop(LAUNCHER_PID_ENV, "")
    if launcher.isdigit() and not os.environ.get(FORKED_RANK_ENV):
        die_with_parent(parent=int(launcher))


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Have the kernel send ``sig`` to this process when its parent ends (Linux).

    A launcher killed with SIGKILL runs no handler, so without this its fork server
    and every rank forked from it would finish their steps and then wait forever on
    collectives, holding their memory. The signal follows the parent's death, in
    a chain: launcher, then the fork server, then the ranks it forked. A rank
    started as a new process (``end_with_launcher``) has the launcher as
    its parent, and calls this once imported: ``parent`` is the launcher's pid,
    so that a launcher that died before that is noticed too.
    """
    expected = os.getppid() if parent is None else parent
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, int(sig))
    except (OSError, AttributeError):
        return
    if os.getppid() != expected:  # the parent ended before the request took effect
        os.kill(os.getpid(), sig)


def startup_timeout(init_timeout_s: float, solver_time_limit_s: float) -> timedelta:
    """Start-up's collective timeout: the other ranks wait in a broadcast while rank 0
    solves, for up to the solver's time limit and as long again for an optimality check."""
    return timedelta(seconds=init_timeout_s + 2 * solver_time_limit_s)


def set_collective_timeout(timeout: timedelta) -> None:
    """Every process group's (the world's and the device mesh's), for the collectives to come."""
    for group in dist.distributed_c10d._world.pg_map:
        if dist.get_backend(group) != "fake":
            set_timeout(timeout, group)


def ranks_that_never_arrived(grace_s: float = ARRIVAL_GRACE_S) -> list[int] | None:
    """On a rank whose collective just timed out: the ranks that never reached one
    (None: unknown, no process group or store to ask).

    A timed-out collective says how long it waited, not for whom. Each rank that
    waited in a collective times out about ``timeout`` after it got there, so each
    says so in the job's store (torchrun's TCP store, which a failed collective
    leaves working) and waits up to ``grace_s`` for the others to do the same: one
    that has not by then never got to a collective (frozen, stuck elsewhere, or far
    slower). Every waiting rank, not only the first, names them; the launcher stops
    the frozen ones once the first of these ranks has exited.
    """
    try:
        store = dist.distributed_c10d._get_default_store()
        world = dist.get_world_size()
        store.set(f"{TIMED_OUT_KEY}{dist.get_rank()}", "1")
        missing, end = list(range(world)), time.monotonic() + grace_s
        while True:
            missing = [r for r in missing if not store.check([f"{TIMED_OUT_KEY}{r}"])]
            if not missing or time.monotonic() >= end:
                return missing
            time.sleep(0.2)
    except (RuntimeError, ValueError):  # no process group, or its store is gone too
        return None


def _init_fake(world_size: int) -> Runtime:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    return Runtime(torch.device("cpu"), "fake", 0, world_size, 0)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End a launched rank with ``code`` without the interpreter's finalisation.

    Process groups stay alive past ``destroy_process_group`` while a device mesh
    or a module still refers to them; gloo's worker threads then die during
    finalisation, when destroying the tensors they hold needs the GIL of an
    interpreter that is being torn down, and the rank aborts (SIGABRT,
    "terminate called without an active exception") after a successful run.
    Everything worth keeping (metrics, TensorBoard events, checkpoints) is
    written and closed before this is called; only the streams need a flush.
    A rank forked by the launcher (``launch/forked_rank.py``) is never finalised:
    it returns to torchrun, which collects its result and ends it the same way.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if os.environ.get(FORKED_RANK_ENV):
        raise SystemExit(code)
    os._exit(code)
