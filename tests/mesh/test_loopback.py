"""A single-node job listens on loopback only (``launch.loopback_only``): torchrun's
rendezvous store, the store its ranks share and gloo's connections, on 127.0.0.1,
not on every interface of the host as ``--standalone`` had them."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
from _run import REPO, child_pids, module_launch

from torchtitan_autoparallel.launch.launch import LOOPBACK, loopback_only

LISTEN = "0A"  # the LISTEN state in /proc/net/tcp


def test_only_a_single_node_job_is_moved_to_loopback() -> None:
    env: dict[str, str] = {}
    args = loopback_only(["--standalone", "--tee", "3"], 0, env)
    assert args[:2] == ["--rdzv-backend", "c10d"] and args[args.index("--rdzv-endpoint") + 1] == f"{LOOPBACK}:0"
    assert args[args.index("--local-addr") + 1] == LOOPBACK and args[-2:] == ["--tee", "3"]
    assert "--standalone" not in args and env == {"GLOO_SOCKET_IFNAME": "lo"}
    multi = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "host:29400"]
    assert loopback_only(multi, 0, env) == multi
    gpu_env: dict[str, str] = {}
    loopback_only(["--standalone"], 8, gpu_env)
    assert gpu_env == {}  # gloo's setting; NCCL picks its own interface
    mine = {"GLOO_SOCKET_IFNAME": "eth1"}
    loopback_only(["--standalone"], 0, mine)
    assert mine == {"GLOO_SOCKET_IFNAME": "eth1"}  # a value the user set is kept


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").glob("*"):
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp{,6}'s local address (32-bit words in host byte order)."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def listening(pids: list[int]) -> list[tuple[int, str]]:
    """(pid, address:port) of every TCP socket that ``pids`` hold in the LISTEN state."""
    owner = {inode: pid for pid in pids for inode in _socket_inodes(pid)}
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == LISTEN and inode in owner:
                address, port = local.split(":")
                found.append((owner[inode], f"{_address(address)}:{int(port, 16)}"))
    return found


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.rsplit(":", 1)[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


@pytest.mark.multirank
@pytest.mark.parametrize("fork", ["1", "0"])
def test_a_single_node_job_listens_on_loopback_only(tmp_path: Path, fork: str) -> None:
    cmd, env = module_launch("_waiting_rank", str(tmp_path), env={**os.environ, "AUTOPARALLEL_FORK_RANKS": fork})
    env.pop("GLOO_SOCKET_IFNAME", None)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=30)[0][-3000:]
            time.sleep(0.2)
        ranks = [int((tmp_path / f"ready{r}").read_text()) for r in (0, 1)]
        sockets = listening([proc.pid, *child_pids(proc.pid), *ranks])
        launcher = [a for pid, a in sockets if pid == proc.pid]
        assert len(launcher) >= 2, sockets  # the rendezvous store and the ranks' shared store
        assert [a for _, a in sockets if not _loopback(a)] == [], f"listening beyond this host: {sockets}"
        (tmp_path / "done").write_text("")
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out[-3000:]
    finally:
        proc.kill()


def test_the_address_reader_reads_proc_net_tcp() -> None:
    # a socket of this test's own, read back as the job's are
    server = socket.create_server(("127.0.0.1", 0))
    try:
        port = server.getsockname()[1]
        assert (os.getpid(), f"127.0.0.1:{port}") in listening([os.getpid()])
    finally:
        server.close()
    assert not _loopback("0.0.0.0:1") and not _loopback(":::1") and _loopback("::1:5")
