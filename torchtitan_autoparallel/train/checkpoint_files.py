"""The files of a checkpoint: checksums, a ``.metadata`` read without running code,
``train_state.json`` read in one line's worth of error, and why a save failed.

Checksum manifest: ``<folder>/step-<N>/checksums.json``, written by rank 0 after
DCP has written every shard and ``.metadata`` and before ``train_state.json``
(whose presence marks the checkpoint complete)::

    {
      "format": 1,
      "algorithm": "sha256",
      "files": {
        "__0_0.distcp": {"bytes": 34826409, "sha256": "<hex digest>"},
        "__1_0.distcp": {"bytes": 40325292, "sha256": "<hex digest>"},
        ".metadata": {"bytes": 238504, "sha256": "<hex digest>"},
        "train_state.json": {"bytes": 124, "sha256": "<hex digest>"}
      }
    }

``files`` lists every file of the save by its name in the step folder: each
rank's DCP shards (``__<rank>_<n>.distcp``, hashed by the rank that wrote them,
so no rank reads another's), DCP's ``.metadata`` and ``train_state.json`` (hashed
by rank 0 from the bytes it then writes). Before a load every rank checks its
share of the listed files (file ``i`` of the sorted names on rank ``i % world``),
so the whole checkpoint is read once; a missing, truncated or changed file is
one error naming it. A checkpoint saved before manifests were written (none in
its folder) loads with a warning that it cannot be verified.

``.metadata`` is a pickle (DCP's format). It is read here, by an unpickler that
admits only the classes DCP's metadata is made of, and handed to DCP, whose own
reader would unpickle anything: a planted file cannot run code.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pickle
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from torchtitan_autoparallel.errors import UserError

MANIFEST = "checksums.json"
STATE_FILE = "train_state.json"
METADATA = ".metadata"
FORMAT = 1
# sha256 over blake2b: 950 MB/s against 620 MB/s reading a debug checkpoint's
# 40 MB shard on this machine (OpenSSL's sha256 uses the CPU's SHA instructions)
ALGORITHM = "sha256"
_CHUNK = 1 << 20  # read files a MiB at a time: a shard may be larger than memory allows


class CheckpointError(UserError):
    pass


# ---------------------------------------------------------------- checksums at save


def digest(path: Path) -> str:
    h = hashlib.new(ALGORITHM)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _entry(size: int, hexdigest: str) -> dict:
    return {"bytes": size, ALGORITHM: hexdigest}


def own_shards(path: Path, rank: int) -> dict[str, dict]:
    """The manifest entries of the shards this rank wrote (DCP names them ``__<rank>_<n>.distcp``)."""
    return {p.name: _entry(p.stat().st_size, digest(p)) for p in sorted(path.glob(f"__{rank}_*.distcp"))}


def write_complete(path: Path, shards: dict[str, dict], train_state: dict) -> None:
    """Rank 0: the manifest (the gathered ``shards``, ``.metadata``, the train state to be
    written), then ``train_state.json``, each written whole or not at all."""
    state = json.dumps(train_state).encode()
    files = dict(shards)
    files[METADATA] = _entry((path / METADATA).stat().st_size, digest(path / METADATA))
    files[STATE_FILE] = _entry(len(state), hashlib.new(ALGORITHM, state).hexdigest())
    manifest = {"format": FORMAT, "algorithm": ALGORITHM, "files": dict(sorted(files.items()))}
    write_atomic(path / MANIFEST, json.dumps(manifest, indent=1).encode())
    write_atomic(path / STATE_FILE, state)


def write_atomic(path: Path, data: bytes) -> None:
    # a crash or a full disk mid-write leaves the old file or none, never half of one
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---------------------------------------------------------------- checksums at load


def read_manifest(path: Path) -> dict | None:
    """The manifest's ``files`` (None: a checkpoint saved before manifests)."""
    file = path / MANIFEST
    if not file.is_file():
        return None
    try:
        manifest = json.loads(file.read_text())
        files = manifest["files"]
        if manifest.get("algorithm") != ALGORITHM or not isinstance(files, dict):
            raise ValueError(f"algorithm {manifest.get('algorithm')!r}")
        return files
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"checkpoint {file} is not a checksum manifest of format {FORMAT} ({e}); accepted: "
            f"the file as the save wrote it, or remove it to load {path} unverified"
        ) from None


def damage(path: Path, name: str, entry: dict) -> str | None:
    """What is wrong with the file ``name`` of ``path`` against its manifest entry (None: nothing)."""
    file = path / name
    if not file.is_file():
        return f"{name} is missing"
    size, want = file.stat().st_size, entry.get("bytes")
    if size != want:
        kind = "truncated" if isinstance(want, int) and size < want else "of another size"
        return f"{name} is {kind} ({size} bytes; {MANIFEST} records {want})"
    if digest(file) != entry.get(ALGORITHM):
        return f"{name} does not match its {ALGORITHM} checksum in {MANIFEST} (changed since it was saved)"
    return None


def verify(path: Path) -> str | None:
    """On every rank at once: what is damaged in the checkpoint at ``path`` (None: nothing,
    or no manifest to check against). Each rank reads its share of the files."""
    files = read_manifest(path)
    if files is None:
        return None
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    names = sorted(files)
    mine = [d for name in names[rank::world] if (d := damage(path, name, files[name]))]
    found = [mine]
    if world > 1:
        found = [None] * world
        dist.all_gather_object(found, mine)
    problems = sorted(p for ps in found for p in ps)
    return problems[0] if problems else None


# ---------------------------------------------------------------- .metadata without pickle's reach

# What DCP's metadata pickles hold (listed from checkpoints of torch 2.11 to 2.14): its
# dataclasses, torch's sizes, dtypes, layouts and memory formats, and paths.
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": None,  # None: any class of the module
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice", "object"},
    "copyreg": {"_reconstructor"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        names = _ALLOWED.get(module, set())
        if module == "torch":
            found = getattr(torch, name, None)
            if name == "Size" or isinstance(found, (torch.dtype, torch.layout, torch.memory_format)):
                return found
        elif names is None or name in names:
            found = super().find_class(module, name)
            if names is not None or isinstance(found, type):
                return found
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


def read_metadata(path: Path) -> Metadata:
    """DCP's ``.metadata`` of ``path``, unpickled only as far as DCP's own classes go."""
    file = path / METADATA
    try:
        metadata = _MetadataUnpickler(io.BytesIO(file.read_bytes())).load()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} has no {METADATA}; accepted: a folder DCP saved") from None
    except Exception as e:  # noqa: BLE001 - whatever a damaged or planted pickle raises
        raise CheckpointError(
            f"checkpoint {file} is not DCP metadata ({e}); it was not loaded, as loading it could "
            f"run code; accepted: the {METADATA} that torch.distributed.checkpoint wrote"
        ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint {file} holds a {type(metadata).__name__}, not DCP metadata; "
                              f"accepted: the {METADATA} that torch.distributed.checkpoint wrote")
    return metadata


class CheckedReader(FileSystemReader):
    """DCP's file reader, given the metadata ``read_metadata`` read safely: DCP's own
    ``read_metadata`` would unpickle the file with no restriction."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:  # noqa: ARG002 - DCP passes rank= on some versions
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id  # as torch's reader does
        return self._metadata


# ---------------------------------------------------------------- train_state.json


def read_state_file(path: Path) -> dict:
    """``path``'s train_state.json, refused in one line when it is not what a save writes."""
    file = path / STATE_FILE
    try:
        state = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"checkpoint {file} is not valid JSON ({e}); accepted: the file as the save wrote it, "
            f"checkpoint.load_step = <an older step>, or remove {path}"
        ) from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise CheckpointError(
            f"checkpoint {file} holds no step (a JSON object with an integer \"step\" is written by "
            f"each save); accepted: the file as the save wrote it, checkpoint.load_step = <an older step>, "
            f"or remove {path}"
        )
    named = path.name.removeprefix("step-")
    if path.name.startswith("step-") and named.isdigit() and int(named) != state["step"]:
        raise CheckpointError(
            f"checkpoint {file} says step {state['step']}, but its folder is {path.name}; accepted: "
            f"the train_state.json this step's save wrote (was it copied from another step?), "
            f"checkpoint.load_step = <an older step>, or remove {path}"
        )
    return state


# ---------------------------------------------------------------- why a save failed

_REASONS = {
    errno.ENOSPC: ("no space left on device", "free space on that file system, or a checkpoint.folder on another"),
    errno.EDQUOT: ("disk quota exceeded", "free space in the quota, or a checkpoint.folder outside it"),
    errno.EACCES: ("permission denied", "a checkpoint.folder this user can write"),
    errno.EPERM: ("permission denied", "a checkpoint.folder this user can write"),
    errno.EROFS: ("read-only file system", "a checkpoint.folder on a writable file system"),
}


def root_os_error(e: BaseException) -> OSError | None:
    """The OSError under a failed save: in a CheckpointException's per-rank failures,
    or in an exception's cause or context."""
    seen, todo = set(), [e]
    while todo:
        exc = todo.pop(0)
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc
        if isinstance(exc, CheckpointException):
            todo += [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]
        todo += [exc.__cause__, exc.__context__]
    return None


# torch's zip writer reports a short write as "unexpected pos" without the errno under
# it: a file system left with less than this free is taken to be the cause.
_NEARLY_FULL = 1 << 20


def save_failure(path: Path, e: BaseException) -> tuple[str, str]:
    """Why the save into ``path`` failed, and what would let it succeed, in words
    (before the partial save is removed: a full disk shows in its free space)."""
    os_error = root_os_error(e)
    if os_error is not None:
        cause, fix = _REASONS.get(os_error.errno, (os_error.strerror or str(os_error), "a writable checkpoint.folder"))
        where = f"writing {os_error.filename}" if os_error.filename else f"in {path}"
        return f"{cause} {where}", fix
    free = _free_bytes(path)
    if free is not None and free < _NEARLY_FULL:
        return f"no space left on device in {path} ({free} bytes free)", _REASONS[errno.ENOSPC][1]
    exc = e
    if isinstance(e, CheckpointException) and e.failures:
        exc = next(iter(e.failures.values()))
        exc = exc[0] if isinstance(exc, tuple) else exc
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return f"{type(exc).__name__}: {first}", "a checkpoint.folder on a file system that works"


def _free_bytes(path: Path) -> int | None:
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        return shutil.disk_usage(existing).free
    except OSError:
        return None


def first_failure(e: CheckpointException) -> str:
    for failure in e.failures.values():
        exc = failure[0] if isinstance(failure, tuple) else failure
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return str(e)
