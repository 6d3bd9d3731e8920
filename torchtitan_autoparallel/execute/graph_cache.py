"""A cache of each rank's compiled step, so a restart with the same plan skips ``compile``.

Compiling the step re-traces the planned DTensor interpretation with
``make_fx`` (``compiled.py``), which costs several seconds per rank even for
the debug model: on a plan-cache hit it was most of the start-up. The
compiled graph depends only on the traced step, the chosen strategies, the
local batch shapes, this rank's coordinates and the graph passes, so it is
stored per rank under a key over exactly those, beside the plan cache.

Loading is all or nothing: the ranks run collectives whose order is baked
into their graphs, so a run either loads every rank's graph or compiles on
every rank (one small all-gather decides). A stored graph also names the
process groups it calls by their registered names; those must resolve in
this run to groups over the same global ranks, else it is not used.

An entry is JSON (the graph node for node, ``graph_io.py``, its process
groups and the passes' statistics) beside the constants the trace recorded,
in one ``torch.save`` file read back with ``weights_only=True``: loading an
entry unpickles no object and names no code to run, so a planted or spoiled
entry is refused (and the step compiled again), never executed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import fx

from torchtitan_autoparallel.execute.bucketing import BucketStats, check_same_buckets
from torchtitan_autoparallel.execute.graph_io import PackedGraph, pack, unpack
from torchtitan_autoparallel.execute.overlap import OverlapStats, group_name, is_collective
from torchtitan_autoparallel.execute.step import PlannedStep
from torchtitan_autoparallel.planner.plan.cache import package_version

log = logging.getLogger("torchtitan_autoparallel.execute")

# Bump when the entry layout or what a stored graph means changes.
FORMAT_VERSION = 2


class GraphEntryError(ValueError):
    """A stored graph that must not be used; the message says why."""


@dataclass
class GraphEntry:
    key: str
    graph: fx.GraphModule
    groups: dict[str, list[int]]  # process-group name -> its global ranks, when compiled
    bucket_stats: BucketStats | None
    overlap_stats: OverlapStats | None


def graph_key(planned: PlannedStep, local_tokens: torch.Tensor, local_labels: torch.Tensor) -> str:
    """Everything the compiled graph of this rank depends on, hashed."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    parts = [
        f"format {FORMAT_VERSION} package {package_version()} torch {torch.__version__}",
        f"rank {_rank()} of {world}; mesh {planned.mesh.mesh.tolist()} {planned.mesh.mesh_dim_names}",
        f"device {planned.mesh.device_type}; portable {planned.portable_kernels}",
        f"bucket {planned.bucket_collectives}; overlap {planned.overlap_execution}",
        f"batch {_describe(local_tokens)} {_describe(local_labels)}",
        planned.traced.graph.code,
        *(f"{node.name}: {strategy!r}" for node, strategy in planned.chosen.items()),
        *(f"{fqn}: {tuple(p.placements)} {tuple(p.shape)} {p.dtype}" for fqn, p in planned.params.items()),
        *(f"{name}: {tuple(b.placements)} {tuple(b.shape)} {b.dtype}" for name, b in planned.buffers.items()),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def compile_cached(
    planned: PlannedStep, local_tokens: torch.Tensor, local_labels: torch.Tensor, cache_dir: Path | None
) -> bool:
    """Set ``planned.local_graph``: loaded when every rank has a valid entry, else compiled
    (and stored when ``cache_dir`` is given). Returns whether the graph was loaded."""
    if cache_dir is None:
        planned.compile_local(local_tokens, local_labels)
        return False
    key = graph_key(planned, local_tokens, local_labels)
    path = Path(cache_dir) / f"rank{_rank()}-{key}.pt"
    entry = _try_load(path, key)
    if _everyone(entry is not None):
        assert entry is not None
        _install(planned, entry)
        log.info("compiled-step cache hit: %s (compile skipped)", path)
        return True
    if entry is not None:
        log.info("compiled-step cache: another rank has no valid entry; compiling on every rank")
    planned.compile_local(local_tokens, local_labels)
    _store(path, key, planned)
    return False


def load_entry(path: Path, key: str) -> GraphEntry:
    """The stored graph, checked against this run; raises ``GraphEntryError``."""
    try:
        raw = torch.load(path, weights_only=True)  # tensors and strings only: nothing to unpickle
        header = json.loads(raw["header"])
    except Exception as e:  # a file that is not an entry can fail in many ways; all mean "do not use it"
        raise GraphEntryError(f"unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict) or not isinstance(raw.get("constants"), dict):
        raise GraphEntryError("not a stored graph entry")
    if header.get("format_version") != FORMAT_VERSION:
        raise GraphEntryError(f"format_version {header.get('format_version')!r}, expected {FORMAT_VERSION}")
    if header.get("key") != key:
        raise GraphEntryError("stored key does not match this run")
    try:
        graph = unpack(PackedGraph(header["nodes"], raw["constants"]))
        buckets, overlap = header["bucket_stats"], header["overlap_stats"]
        entry = GraphEntry(
            key,
            graph,
            {str(name): [int(r) for r in ranks] for name, ranks in header["groups"].items() if ranks is not None},
            None if buckets is None else BucketStats(buckets["before"], buckets["after"], tuple(buckets["buckets"])),
            None if overlap is None else OverlapStats(**overlap),
        )
    except Exception as e:  # e.g. an op this torch no longer has, or a target that is not a torch op
        raise GraphEntryError(f"graph does not rebuild ({type(e).__name__}: {e})") from None
    _check_groups(entry)
    return entry


def used_groups(gm: fx.GraphModule) -> dict[str, list[int] | None]:
    """Process-group name -> its global ranks in this run (None: no such group), for every
    group a collective of ``gm`` names."""
    groups: dict[str, list[int] | None] = {}
    for name in sorted(set(_named_groups(gm))):
        try:
            groups[name] = dist.get_process_group_ranks(_resolve(name))
        except (KeyError, ValueError, RuntimeError):
            groups[name] = None
    return groups


def _try_load(path: Path, key: str) -> GraphEntry | None:
    if not path.exists():
        log.info("compiled-step cache miss: %s", path)
        return None
    try:
        return load_entry(path, key)
    except GraphEntryError as e:
        log.warning("compiled-step cache entry %s ignored: %s; compiling again", path, e)
        return None


def _install(planned: PlannedStep, entry: GraphEntry) -> None:
    planned.local_graph = entry.graph
    planned.bucket_stats = entry.bucket_stats
    planned.overlap_stats = entry.overlap_stats
    if entry.bucket_stats is not None:  # as after a compile: the ranks must have merged alike
        check_same_buckets(entry.bucket_stats)


def _store(path: Path, key: str, planned: PlannedStep) -> None:
    """Write atomically; failing to write only costs the next start-up a compile."""
    gm = planned.local_graph
    assert gm is not None
    packed = pack(gm)
    header = {
        "format_version": FORMAT_VERSION,
        "key": key,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "nodes": packed.nodes,
        "groups": used_groups(gm),
        "bucket_stats": _as_dict(planned.bucket_stats),
        "overlap_stats": _as_dict(planned.overlap_stats),
    }
    entry = {"header": json.dumps(header), "constants": packed.attributes}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(entry, f)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except Exception as e:
        log.warning("compiled-step cache entry %s not written: %s", path, e)


def _as_dict(stats: object) -> dict | None:
    return None if stats is None else dataclasses.asdict(stats)


def _check_groups(entry: GraphEntry) -> None:
    for name, ranks in used_groups(entry.graph).items():
        if ranks is None or entry.groups.get(name) != ranks:
            was = entry.groups.get(name, "unrecorded")
            raise GraphEntryError(f"process group {name!r} was over ranks {was}, now {ranks or 'no such group'}")


def _named_groups(gm: fx.GraphModule) -> list[str]:
    names = (group_name(node) for node in gm.graph.nodes if is_collective(node))
    return [name for name in names if name is not None]


def _everyone(mine: bool) -> bool:
    """True when every rank says True (ranks must all load, or all compile)."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return mine
    votes: list[bool | None] = [None] * dist.get_world_size()
    dist.all_gather_object(votes, mine)
    return all(votes)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _resolve(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype}"
