"""Deterministic, resumable (inputs, labels) batches for data-parallel training.

Stream model. Every document becomes ``bos + ids + eos``; documents are
concatenated into one endless token stream, cut into consecutive samples of
``seq_len + 1`` tokens (inputs are the first ``seq_len``, labels the same
window shifted by one). Global batch ``i`` is samples
``[i * G, (i + 1) * G)`` with ``G = dp_degree * local_batch_size``; rank
``r`` keeps rows ``[r * local_batch_size, (r + 1) * local_batch_size)``. So
the global batch of a step never depends on how it is split across ranks; with
gradient accumulation a step takes that many consecutive batches, so nor does
it depend on how it is split into micro-batches.

Epochs. Local corpora ("default", "text", "jsonl", torchtitan's "c4_test" and a
torchtitan name whose dataset_path is a local folder) are tokenized once per
process and kept in memory; each epoch visits every document once, in an
order shuffled by ``(seed, epoch)``, and a sample may straddle two epochs.
Hugging Face datasets are streamed and simply start again from the first
record when they run out (plain wrap-around, no reshuffle).

Resuming. ``state_dict()`` holds plain ints (and, for streamed datasets, the
few leftover tokens), so a restored loader continues with exactly the batch
an uninterrupted one would have produced next.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import torch

from torchtitan_autoparallel.data.tokenizer import ASSETS_DIR, DataError, Tokenizer, warn_rank0

DEFAULT_CORPUS_PATH = ASSETS_DIR / "corpus.txt"
LOCAL_SUFFIXES = {"text": ".txt", "jsonl": ".jsonl"}
# torchtitan's names for its streamed datasets -> (Hugging Face name, config, split);
# dataset_path, if set, replaces the name (a local copy, read as a folder of JSON
# lines), as in torchtitan
TORCHTITAN_STREAMS = {
    "c4": ("allenai/c4", "en", "train"),
    "c4_validation": ("allenai/c4", "en", "validation"),
}
# torchtitan's local test set: a folder of JSON lines, relative to its repository
# (the working directory); dataset_path replaces it
C4_TEST_FOLDER = Path("tests/assets/c4_test")
JSON_LINES_SUFFIXES = (".json", ".jsonl")
HUB_PROBE_S = 3.0  # how long to wait for the Hub before saying it cannot be reached
# Bounds memory held by tokenizer Encoding objects while tokenizing.
_ENCODE_CHUNK = 1024

# Given a 0-based epoch, yields that pass's documents from the beginning.
DocumentOpener = Callable[[int], Iterable[str]]


@dataclass(frozen=True)
class TokenizedCorpus:
    """Every document as ``bos + ids + eos``, back to back, with its offsets."""

    tokens: np.ndarray  # int32, read-only
    doc_starts: np.ndarray  # int64, num_docs + 1 offsets into ``tokens``

    @property
    def num_docs(self) -> int:
        return len(self.doc_starts) - 1


# Keyed by (tokenizer hash, format, file contents hash): tokenize once per
# process, however many loaders (ranks in one process, tests) are built.
_CORPUS_CACHE: dict[tuple[str, str, str], TokenizedCorpus] = {}


def split_text_documents(text: str) -> list[str]:
    """A blank line separates documents in plain-text sources."""
    return [doc.strip() for doc in re.split(r"\n\s*\n", text) if doc.strip()]


def read_jsonl_documents(path: Path) -> list[str]:
    """The ``"text"`` field of every non-blank line of a JSONL file."""
    documents: list[str] = []
    with path.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{line_no}: invalid JSON ({exc.msg})") from exc
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise DataError(f"{path}:{line_no}: expected an object with a string 'text' field")
            if text.strip():
                documents.append(text)
    return documents


def read_documents(kind: str, path: Path) -> list[str]:
    if kind == "jsonl":
        return read_jsonl_documents(path)
    return split_text_documents(path.read_text(encoding="utf-8"))


def local_source_files(dataset: str, dataset_path: str | None) -> tuple[str, list[Path]]:
    """The format and sorted file list of a local dataset, or ``DataError``."""
    if dataset == "default":
        if dataset_path:
            raise DataError(
                f"dataset_path {dataset_path!r} is only read with dataset='text' or 'jsonl', "
                "not with dataset='default'"
            )
        return "text", [DEFAULT_CORPUS_PATH]
    suffix = LOCAL_SUFFIXES[dataset]
    accepted = f"a {suffix} file or a directory of {suffix} files"
    if not dataset_path:
        raise DataError(f"dataset={dataset!r} needs dataset_path: {accepted}")
    path = Path(dataset_path).expanduser()
    if path.is_file():
        return dataset, [path]
    if not path.is_dir():
        raise DataError(f"dataset_path {dataset_path!r} not found; expected {accepted}")
    files = sorted(p for p in path.rglob(f"*{suffix}") if p.is_file())
    if not files:
        raise DataError(f"dataset_path {dataset_path!r} holds no {suffix} files")
    return dataset, files


def json_lines_files(folder: Path) -> list[Path]:
    """The JSON-lines files (``.json``, ``.jsonl``) of a local dataset folder, as torchtitan
    reads c4_test (``datasets.load_dataset`` on the folder), or ``DataError``."""
    files = sorted(p for p in folder.rglob("*") if p.suffix in JSON_LINES_SUFFIXES and p.is_file())
    if not files:
        raise DataError(f"dataset folder {str(folder)!r} holds no .json or .jsonl files (JSON lines with a 'text' field)")
    return files


def torchtitan_local_folder(dataset: str, dataset_path: str | None) -> Path | None:
    """The local folder a torchtitan dataset name reads, or None where it does not:
    c4_test's folder (None: not here), or a c4 / c4_validation dataset_path that is a
    folder here (None: streamed from the Hub)."""
    if dataset == "c4_test":
        folder = Path(dataset_path).expanduser() if dataset_path else C4_TEST_FOLDER
        if not folder.is_dir():
            if dataset_path:
                raise DataError(f"dataset_path {dataset_path!r} of dataset 'c4_test' is not a folder; accepted: a folder of JSON lines")
            # torchtitan's debug files name its repository's test set; outside a
            # torchtitan checkout the shipped corpus stands in, as the tokenizer does
            warn_rank0(
                f"dataset 'c4_test' reads {str(folder)!r} (torchtitan's test set), which is not here; "
                "training on the shipped corpus instead (run from a torchtitan checkout, or set dataset_path)"
            )
            return None
        return folder
    if dataset in TORCHTITAN_STREAMS and dataset_path and Path(dataset_path).expanduser().is_dir():
        return Path(dataset_path).expanduser()
    return None


def files_fingerprint(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def tokenize_documents(tokenizer: Tokenizer, documents: list[str]) -> TokenizedCorpus:
    """Tokenize in batches (the library runs them on its own threads)."""
    pieces: list[np.ndarray] = []
    for start in range(0, len(documents), _ENCODE_CHUNK):
        for ids in tokenizer.encode_batch(documents[start : start + _ENCODE_CHUNK]):
            piece = np.empty(len(ids) + 2, dtype=np.int32)
            piece[0], piece[1:-1], piece[-1] = tokenizer.bos_id, ids, tokenizer.eos_id
            pieces.append(piece)
    tokens = np.concatenate(pieces)
    doc_starts = np.zeros(len(pieces) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in pieces], out=doc_starts[1:])
    tokens.flags.writeable = False  # shared through the cache
    return TokenizedCorpus(tokens=tokens, doc_starts=doc_starts)


def load_corpus(tokenizer: Tokenizer, kind: str, files: list[Path]) -> TokenizedCorpus:
    key = (tokenizer.fingerprint, kind, files_fingerprint(files))
    if key not in _CORPUS_CACHE:
        documents = [doc for path in files for doc in read_documents(kind, path)]
        if not documents:
            raise DataError(f"no documents found in {', '.join(str(p) for p in files)}")
        _CORPUS_CACHE[key] = tokenize_documents(tokenizer, documents)
    return _CORPUS_CACHE[key]


def shuffled_epoch(corpus: TokenizedCorpus, seed: int, epoch: int) -> np.ndarray:
    """The corpus tokens with documents in this epoch's order."""
    # A (seed, epoch) pair, unlike seed + epoch, never repeats across seeds.
    rng = np.random.default_rng([seed & (2**64 - 1), epoch])
    order = rng.permutation(corpus.num_docs)
    lengths = np.diff(corpus.doc_starts)[order]
    src_starts = corpus.doc_starts[:-1][order]
    dst_starts = np.cumsum(lengths) - lengths
    # One gather instead of a Python loop over documents.
    index = np.arange(len(corpus.tokens)) + np.repeat(src_starts - dst_starts, lengths)
    return corpus.tokens[index]


class CorpusSampler:
    """Consecutive samples of an in-memory corpus; state is one counter."""

    kind = "corpus"

    def __init__(self, corpus: TokenizedCorpus, sample_len: int, seed: int) -> None:
        self._corpus = corpus
        self._sample_len = sample_len
        self._seed = seed
        self.samples_taken = 0
        self._cached_epoch: tuple[int, np.ndarray] | None = None

    @property
    def epoch(self) -> int:
        return self.samples_taken * self._sample_len // len(self._corpus.tokens)

    def take(self, count: int) -> np.ndarray:
        """The next ``count`` samples as a (count, sample_len) array."""
        flat = self._read(self.samples_taken * self._sample_len, count * self._sample_len)
        self.samples_taken += count
        return flat.reshape(count, self._sample_len)

    def _read(self, offset: int, length: int) -> np.ndarray:
        parts: list[np.ndarray] = []
        while length > 0:
            epoch, position = divmod(offset, len(self._corpus.tokens))
            chunk = self._epoch_tokens(epoch)[position : position + length]
            parts.append(chunk)
            offset, length = offset + len(chunk), length - len(chunk)
        return np.concatenate(parts)

    def _epoch_tokens(self, epoch: int) -> np.ndarray:
        # Reads move forward, so holding only the latest epoch never recomputes.
        if self._cached_epoch is None or self._cached_epoch[0] != epoch:
            self._cached_epoch = (epoch, shuffled_epoch(self._corpus, self._seed, epoch))
        return self._cached_epoch[1]

    def samples_per_pass(self) -> int:
        """Samples that lie whole in one epoch read from the start."""
        return len(self._corpus.tokens) // self._sample_len

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "samples_taken": self.samples_taken}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.samples_taken = int(state["samples_taken"])


class StreamSampler:
    """Samples tokenized on the fly from a document stream read in order."""

    kind = "stream"

    def __init__(
        self, open_documents: DocumentOpener, tokenizer: Tokenizer, sample_len: int, name: str
    ) -> None:
        self._open = open_documents
        self._tokenizer = tokenizer
        self._sample_len = sample_len
        self._name = name
        self.epoch = 0
        self.docs_read = 0  # within the current epoch, blank ones included
        self._buffer: list[int] = []
        self._docs: Iterator[str] | None = None

    def take(self, count: int) -> np.ndarray:
        needed = count * self._sample_len
        while len(self._buffer) < needed:
            self._buffer.extend(self._next_document_tokens())
        rows = np.asarray(self._buffer[:needed], dtype=np.int64).reshape(count, self._sample_len)
        del self._buffer[:needed]
        return rows

    def _next_document_tokens(self) -> list[int]:
        wraps = 0
        # Two wrap-arounds without a single non-blank document: nothing to read.
        while wraps < 2:
            if self._docs is None:
                self._docs = itertools.islice(iter(self._open(self.epoch)), self.docs_read, None)
            text = next(self._docs, None)
            if text is None:
                self._docs, self.epoch, self.docs_read = None, self.epoch + 1, 0
                wraps += 1
                continue
            self.docs_read += 1
            if text.strip():
                ids = self._tokenizer.encode(text)
                return [self._tokenizer.bos_id, *ids, self._tokenizer.eos_id]
        raise DataError(f"dataset {self._name!r} yielded no non-blank 'text' documents")

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "epoch": self.epoch,
            "docs_read": self.docs_read,
            "buffer": list(self._buffer),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.docs_read = int(state["docs_read"])
        self._buffer = [int(t) for t in state["buffer"]]
        self._docs = None  # reopened lazily, skipping docs_read records


Sampler = CorpusSampler | StreamSampler


class TokenDataLoader:
    """Iterator of (inputs, labels) LongTensors of shape (local_bs, seq_len)."""

    def __init__(
        self, sampler: Sampler, seq_len: int, local_batch_size: int, dp_rank: int, dp_degree: int
    ) -> None:
        self._sampler = sampler
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree

    @property
    def global_batch_size(self) -> int:
        return self.local_batch_size * self.dp_degree

    @property
    def epoch(self) -> int:
        return self._sampler.epoch

    def batches_per_pass(self) -> int | None:
        """Global batches in one pass over the data from its start; None for a stream."""
        if isinstance(self._sampler, CorpusSampler):
            return self._sampler.samples_per_pass() // self.global_batch_size
        return None

    def __iter__(self) -> TokenDataLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self._sampler.take(self.global_batch_size)
        first = self.dp_rank * self.local_batch_size
        mine = torch.from_numpy(rows[first : first + self.local_batch_size].astype(np.int64))
        return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()

    def state_dict(self) -> dict[str, Any]:
        # Counts whole samples, so it is the same on every rank and also
        # resumes under a different dp_degree with the same global batch.
        return {"seq_len": self.seq_len, **self._sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("seq_len") != self.seq_len or state.get("kind") != self._sampler.kind:
            raise DataError(
                f"data loader state is for seq_len={state.get('seq_len')} "
                f"source={state.get('kind')!r}, but this loader has "
                f"seq_len={self.seq_len} source={self._sampler.kind!r}"
            )
        self._sampler.load_state_dict(state)


def check_hub_reachable(name: str) -> None:
    """One line at once where the Hub cannot be reached, instead of ``datasets``' retries
    (tens of seconds of them, each logged): offline by the environment, or no connection
    to the Hub within ``HUB_PROBE_S``."""
    accepted = (
        "accepted: network access to the Hub, dataset = 'default' (the shipped corpus), 'c4_test' "
        "with its folder, 'text' or 'jsonl' with dataset_path, or dataset_path naming a local folder"
    )
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").lower() in ("1", "true", "yes", "on"):
            raise DataError(f"Hugging Face dataset {name!r} is on the Hub, and {var} is set; {accepted}")
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    outcome: list[BaseException | None] = []

    def probe() -> None:  # in a thread: name resolution takes no timeout
        try:
            socket.create_connection((host, 443), timeout=HUB_PROBE_S).close()
            outcome.append(None)
        except OSError as e:
            outcome.append(e)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(HUB_PROBE_S + 0.5)
    if not outcome or outcome[0] is not None:
        reason = f"{type(outcome[0]).__name__}: {outcome[0]}" if outcome else f"no answer in {HUB_PROBE_S:g} s"
        raise DataError(f"Hugging Face dataset {name!r} is on the Hub, which cannot be reached from here ({reason}); {accepted}")


def open_hf_documents(name: str, config: str | None, split: str = "train") -> DocumentOpener:
    """Stream the ``"text"`` field of a Hugging Face dataset's ``split``."""
    if not Path(name).expanduser().exists():  # a local copy needs no network
        check_hub_reachable(name)
    try:
        import datasets  # slow to import; only this source needs it

        stream = datasets.load_dataset(name, config or None, split=split, streaming=True)
        first = next(iter(stream))
    except Exception as exc:  # offline, unknown name, gated, empty: all one story
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise DataError(
            f"could not open Hugging Face dataset {name!r} ({type(exc).__name__}: {reason}); "
            "it needs network access — offline, use dataset='default', or 'text'/'jsonl' "
            "with dataset_path"
        ) from exc
    if not isinstance(first, dict) or "text" not in first:
        fields = sorted(first) if isinstance(first, dict) else type(first).__name__
        raise DataError(f"Hugging Face dataset {name!r} has no 'text' field (has {fields})")

    def documents(epoch: int) -> Iterator[str]:
        return (record["text"] for record in stream)

    return documents


def check_layout(seq_len: int, local_batch_size: int, dp_rank: int, dp_degree: int) -> None:
    if seq_len < 1 or local_batch_size < 1 or dp_degree < 1:
        raise DataError(
            f"seq_len ({seq_len}), local_batch_size ({local_batch_size}) and "
            f"dp_degree ({dp_degree}) must all be at least 1"
        )
    if not 0 <= dp_rank < dp_degree:
        raise DataError(f"dp_rank {dp_rank} is outside [0, dp_degree={dp_degree})")


def build_sampler(
    tokenizer: Tokenizer, dataset: str, dataset_path: str | None, sample_len: int, seed: int
) -> Sampler:
    if dataset in ("default", *LOCAL_SUFFIXES):
        kind, files = local_source_files(dataset, dataset_path)
        return CorpusSampler(load_corpus(tokenizer, kind, files), sample_len, seed)
    if (folder := torchtitan_local_folder(dataset, dataset_path)) is not None:
        return CorpusSampler(load_corpus(tokenizer, "jsonl", json_lines_files(folder)), sample_len, seed)
    if dataset == "c4_test":  # its folder is not here (a warning said so)
        return CorpusSampler(load_corpus(tokenizer, "text", [DEFAULT_CORPUS_PATH]), sample_len, seed)
    if dataset in TORCHTITAN_STREAMS:
        name, config, split = TORCHTITAN_STREAMS[dataset]
        opener = open_hf_documents(dataset_path or name, config, split)
    else:  # any other name is a Hugging Face dataset; dataset_path picks its config
        opener = open_hf_documents(dataset, dataset_path)
    return StreamSampler(opener, tokenizer, sample_len, dataset)


def build_dataloader(
    tokenizer: Tokenizer,
    dataset: str = "default",
    dataset_path: str | None = None,
    seq_len: int = 256,
    local_batch_size: int = 8,
    dp_rank: int = 0,
    dp_degree: int = 1,
    seed: int = 0,
) -> TokenDataLoader:
    """The loader for one data-parallel rank; see the module docstring."""
    check_layout(seq_len, local_batch_size, dp_rank, dp_degree)
    sampler = build_sampler(tokenizer, dataset, dataset_path or None, seq_len + 1, seed)
    return TokenDataLoader(sampler, seq_len, local_batch_size, dp_rank, dp_degree)
