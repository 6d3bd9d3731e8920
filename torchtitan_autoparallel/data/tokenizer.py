"""Tokenizer loading: the shipped byte-level BPE, or any ``tokenizer.json``."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import tokenizers

from torchtitan_autoparallel.errors import UserError

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
DEFAULT_TOKENIZER_PATH = ASSETS_DIR / "tokenizer.json"
# model.hf_assets_path of torchtitan's debug job files, relative to its repository
TORCHTITAN_TEST_TOKENIZER = Path("tests/assets/tokenizer")

# Ours first; the others let common Hugging Face tokenizer.json files work
# without a rename (LLaMA 3, GPT-2 style, SentencePiece exports).
_BOS_CANDIDATES = ("<|bos|>", "<|begin_of_text|>", "<s>", "<|endoftext|>")
_EOS_CANDIDATES = ("<|eos|>", "<|end_of_text|>", "</s>", "<|endoftext|>")


class DataError(UserError, ValueError):
    """A tokenizer or dataset setting that cannot be honoured, said in one line."""


_WARNED: set[str] = set()  # logged by this process, however many loaders it builds


def warn_rank0(message: str) -> None:
    """Log a data warning in rank 0's log once (the launcher's own checks stay quiet: the
    rank says it; a rank forked from the launcher inherits this set, empty, from it)."""
    if os.environ.get("RANK") == "0" and message not in _WARNED:
        _WARNED.add(message)
        logging.getLogger("torchtitan_autoparallel").warning(f"warning: {message}")


class Tokenizer:
    """Thin wrapper over ``tokenizers.Tokenizer`` with the ids the loader needs."""

    def __init__(self, backend: tokenizers.Tokenizer, source: Path) -> None:
        self._backend = backend
        self.source = source
        self.bos_id = _find_special(backend, _BOS_CANDIDATES, "begin", source)
        self.eos_id = _find_special(backend, _EOS_CANDIDATES, "end", source)
        # Keys the token cache: same file bytes means same ids.
        self.fingerprint = hashlib.sha256(source.read_bytes()).hexdigest()

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without BOS/EOS (the loader adds those)."""
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Like ``encode`` for many texts, using the library's thread pool."""
        encodings = self._backend.encode_batch(list(texts), add_special_tokens=False)
        return [enc.ids for enc in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        # Specials stay visible so a decoded sample shows its document bounds.
        return self._backend.decode(list(ids), skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"Tokenizer(source={str(self.source)!r}, vocab_size={self.vocab_size})"


def resolve_tokenizer_path(path: str | Path | None) -> Path:
    """Map a config value to a tokenizer.json file, or raise ``DataError``."""
    if path is None or str(path) in ("", "default"):
        return DEFAULT_TOKENIZER_PATH
    candidate = Path(path).expanduser()
    if Path(path) == TORCHTITAN_TEST_TOKENIZER and not candidate.exists():
        # torchtitan's debug files name its repository's test tokenizer; outside a
        # torchtitan checkout the shipped one (a small BPE like it) stands in
        warn_rank0(
            f"tokenizer {str(path)!r} (torchtitan's test tokenizer) is not here; "
            f"using the shipped tokenizer {str(DEFAULT_TOKENIZER_PATH)!r} instead"
        )
        return DEFAULT_TOKENIZER_PATH
    if candidate.is_dir():
        candidate = candidate / "tokenizer.json"
    if not candidate.is_file():
        raise DataError(
            f"tokenizer path {str(path)!r} not found; expected 'default', a "
            "tokenizer.json file, or a directory containing tokenizer.json"
        )
    return candidate


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """Load the shipped tokenizer (``None``/"default") or one at ``path``."""
    source = resolve_tokenizer_path(path)
    try:
        backend = tokenizers.Tokenizer.from_file(str(source))
    except Exception as exc:  # the library raises a bare Exception on bad JSON
        raise DataError(f"tokenizer file {str(source)!r} could not be parsed: {exc}") from exc
    return Tokenizer(backend, source)


def _find_special(
    backend: tokenizers.Tokenizer, candidates: tuple[str, ...], role: str, source: Path
) -> int:
    for token in candidates:
        token_id = backend.token_to_id(token)
        if token_id is not None:
            return token_id
    raise DataError(
        f"tokenizer {str(source)!r} has no {role}-of-text token; expected one of {candidates}"
    )
