"""Rebuild the offline default corpus and tokenizer under ``data/assets/``.

Run ``python -m torchtitan_autoparallel.data.build_assets``. The outputs are
committed, so a fresh clone never needs this script; it exists so that the
assets can be reproduced and audited.

The corpus is English prose taken from the docstrings of a fixed, sorted list
of Python standard-library modules (PSF licensed), because that is the only
real text guaranteed to be on every machine that can run the trainer. The
exact text depends on the CPython version that runs this script, so the
version is recorded in ``assets/README.md``.

Corpus format: plain UTF-8 text, one document per docstring, documents
separated by one blank line. Inside a document, paragraphs are unwrapped to
one line each and separated by a single newline, so a blank line always
means a document boundary.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
VOCAB_SIZE = 2048
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>")

# Fixed and sorted so the corpus order never depends on the environment.
# Left out: modules with import side effects (antigravity, this), GUI or
# platform-specific ones that may be absent (tkinter, idlelib, winreg, ...),
# and the ones deprecated by PEP 594 or removed in 3.12, whose text would
# make the corpus differ between the supported Python versions.
STDLIB_MODULES: tuple[str, ...] = (
    "abc", "argparse", "array", "ast", "asyncio", "asyncio.base_events",
    "asyncio.events", "asyncio.futures", "asyncio.locks", "asyncio.queues",
    "asyncio.streams", "asyncio.subprocess", "asyncio.tasks",
    "asyncio.transports", "atexit", "base64", "bdb", "binascii", "bisect",
    "builtins", "bz2", "cProfile", "calendar", "cmath", "cmd", "code",
    "codecs", "codeop", "collections", "collections.abc", "colorsys",
    "compileall", "concurrent.futures", "concurrent.futures._base",
    "concurrent.futures.process", "concurrent.futures.thread",
    "configparser", "contextlib", "contextvars", "copy", "copyreg", "csv",
    "ctypes", "dataclasses", "datetime", "dbm", "decimal", "difflib", "dis",
    "doctest", "email", "email.charset", "email.contentmanager",
    "email.encoders", "email.errors", "email.feedparser",
    "email.generator", "email.header", "email.headerregistry",
    "email.iterators", "email.message", "email.mime.base",
    "email.mime.multipart", "email.mime.text", "email.parser",
    "email.policy", "email.utils", "enum", "errno", "faulthandler",
    "filecmp", "fileinput", "fnmatch", "fractions", "ftplib", "functools",
    "gc", "getopt", "getpass", "gettext", "glob", "graphlib", "gzip",
    "hashlib", "heapq", "hmac", "html", "html.parser", "http",
    "http.client", "http.cookiejar", "http.cookies", "http.server",
    "imaplib", "importlib", "importlib.abc", "importlib.machinery",
    "importlib.metadata", "importlib.resources", "importlib.util",
    "inspect", "io", "ipaddress", "itertools", "json", "json.decoder",
    "json.encoder", "keyword", "linecache", "locale", "logging",
    "logging.config", "logging.handlers", "lzma", "mailbox", "marshal",
    "math", "mimetypes", "mmap", "modulefinder", "multiprocessing",
    "multiprocessing.connection", "multiprocessing.managers",
    "multiprocessing.pool", "multiprocessing.process",
    "multiprocessing.queues", "multiprocessing.shared_memory",
    "multiprocessing.synchronize", "netrc", "numbers", "opcode",
    "operator", "optparse", "os", "os.path", "pathlib", "pdb", "pickle",
    "pickletools", "pkgutil", "platform", "plistlib", "poplib", "pprint",
    "profile", "pstats", "pty", "py_compile", "pyclbr", "pydoc", "queue",
    "quopri", "random", "re", "reprlib", "rlcompleter", "runpy", "sched",
    "secrets", "selectors", "shelve", "shlex", "shutil", "signal", "site",
    "smtplib", "socket", "socketserver", "sqlite3", "ssl", "stat",
    "statistics", "string", "stringprep", "struct", "subprocess",
    "symtable", "sys", "sysconfig", "tabnanny", "tarfile", "tempfile",
    "textwrap", "threading", "time", "timeit", "token", "tokenize",
    "tomllib", "trace", "traceback", "tracemalloc", "types", "typing",
    "unicodedata", "unittest", "unittest.case", "unittest.loader",
    "unittest.main", "unittest.mock", "unittest.result", "unittest.runner",
    "unittest.suite", "urllib.error", "urllib.parse", "urllib.request",
    "urllib.response", "urllib.robotparser", "uuid", "venv", "warnings",
    "weakref", "webbrowser", "wsgiref.handlers", "wsgiref.headers",
    "wsgiref.simple_server", "wsgiref.util", "wsgiref.validate",
    "xml.dom", "xml.dom.minidom", "xml.dom.pulldom", "xml.etree.ElementTree",
    "xml.sax", "xml.sax.handler", "xml.sax.saxutils", "xml.sax.xmlreader",
    "xmlrpc.client", "xmlrpc.server", "zipapp", "zipfile", "zipimport",
    "zlib", "zoneinfo",
)

_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`!?~?([^`<]*?)(?:\s*<[^>]*>)?`")
# Sphinx directive lines and the rules under reST headings.
_NOISE_LINE = re.compile(r"^\s*(?:\.\. [\w:-]+::.*|[-=*~^#]{3,})\s*$")
_LIST_MARKER = re.compile(r"^\s*(?:[-*+]|\d+[.)]|[a-z][.)]|:\w+[^:]*:)\s")
# Sphinx field lists, rewritten the way a person would write them.
_FIELDS = (
    (
        # ":param int x:" -> "x:" (the optional type is dropped)
        re.compile(r"^(\s*):(?:param|parameter|arg|key|keyword)\s+(?:[\w.\[\], ]+\s+)?(\w+):", re.M),
        r"\1\2:",
    ),
    (re.compile(r"^(\s*):returns?:", re.M), r"\1Returns:"),
    (re.compile(r"^(\s*):raises?\s+([\w.]+):", re.M), r"\1Raises \2:"),
    (re.compile(r"^\s*:(?:r?type)\b[^\n]*\n?", re.M), ""),
)
_MIN_DOC_CHARS = 40


def import_quietly(name: str) -> ModuleType | None:
    """Import a module, or return None where this platform lacks it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(name)
        except ImportError:
            return None


def doc_of(obj: object) -> str:
    """An object's own docstring; some descriptors carry non-string ``__doc__``."""
    doc = getattr(obj, "__doc__", None)
    return doc if isinstance(doc, str) else ""


def iter_docstrings(module: ModuleType) -> Iterator[str]:
    """Yield the raw docstrings of a module and of what it defines itself."""
    yield doc_of(module)
    for name in sorted(vars(module)):
        obj = vars(module)[name]
        # Re-exports would repeat another module's text under this one.
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj):
            yield doc_of(obj)
            for attr in sorted(vars(obj)):
                if attr.startswith("_") and attr != "__init__":
                    continue
                member = vars(obj)[attr]
                if callable(member) or isinstance(member, (property, classmethod, staticmethod)):
                    yield doc_of(member)
        elif callable(obj):
            yield doc_of(obj)


def clean_docstring(raw: str, seen: set[str]) -> str:
    """Turn reST-flavoured text into prose: drop code, directives, markup.

    ``seen`` holds the paragraphs already in the corpus; it is updated.
    """
    text = _ROLE.sub(r"\1", inspect.cleandoc(raw)).replace("``", "")
    paragraphs: list[str] = []
    introduces_example = False
    for block in re.split(r"\n\s*\n", text):
        lines = [ln.rstrip() for ln in block.splitlines() if not _NOISE_LINE.match(ln)]
        if is_code(lines, introduces_example):
            continue
        paragraph = unwrap(lines)
        for pattern, replacement in _FIELDS:
            paragraph = pattern.sub(replacement, paragraph)
        introduces_example = paragraph.endswith(":")
        if paragraph.endswith("::"):
            paragraph = paragraph[:-1]
        # The help topics nest (e.g. "compound" holds "for"), and docstrings
        # repeat boilerplate; repeated paragraphs would only be memorised.
        if looks_like_prose(paragraph) and paragraph not in seen:
            seen.add(paragraph)
            paragraphs.append(paragraph)
    return "\n".join(paragraphs)


def is_code(lines: list[str], introduces_example: bool) -> bool:
    """Doctests, and indented non-list blocks right after a colon, are examples."""
    if not lines or any(ln.lstrip().startswith((">>>", "...")) for ln in lines):
        return True
    indented = all(ln.startswith((" ", "\t")) for ln in lines)
    return introduces_example and indented and not _LIST_MARKER.match(lines[0])


def unwrap(lines: list[str]) -> str:
    """Join hard-wrapped lines of equal indent, keeping list items apart."""
    out: list[str] = []
    for line in lines:
        indent = len(line) - len(line.lstrip())
        if out and not _LIST_MARKER.match(line):
            prev_indent = len(out[-1]) - len(out[-1].lstrip())
            continues = indent > prev_indent and not out[-1].endswith(":")
            if continues or indent == prev_indent or (indent > 0 and prev_indent > 0):
                out[-1] = f"{out[-1]} {line.strip()}"
                continue
        out.append(line)
    return "\n".join(out)


def looks_like_prose(paragraph: str) -> bool:
    """Keep paragraphs that are mostly words, so tables and code drop out."""
    if len(paragraph.split()) < 3:
        return False
    wordish = sum(ch.isalpha() or ch.isspace() for ch in paragraph)
    return wordish / len(paragraph) >= 0.8


def iter_raw_texts() -> Iterator[str]:
    """All source texts in corpus order: module docstrings, then help topics."""
    for name in STDLIB_MODULES:
        module = import_quietly(name)
        if module is None:
            print(f"skipped missing module {name}", file=sys.stderr)
            continue
        with warnings.catch_warnings():
            # Touching deprecated aliases (typing.io, ...) warns; harmless here.
            warnings.simplefilter("ignore")
            yield from list(iter_docstrings(module))
    # The interactive help() topics are the language reference rendered as
    # text; shipped with every CPython, and far richer prose than docstrings.
    topics_module = import_quietly("pydoc_data.topics")
    topics: dict[str, str] = getattr(topics_module, "topics", {})
    for key in sorted(topics):
        yield topics[key]


def build_corpus() -> list[str]:
    """Collect cleaned, de-duplicated documents in a deterministic order."""
    seen: set[str] = set()
    documents: list[str] = []
    for raw in iter_raw_texts():
        doc = clean_docstring(raw, seen) if raw.strip() else ""
        if len(doc) >= _MIN_DOC_CHARS:
            documents.append(doc)
    return documents


def train_tokenizer(documents: list[str]) -> Tokenizer:
    """Train a byte-level BPE whose vocabulary, specials included, is 2048."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols up front, so any input text stays encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"trained vocab is {tokenizer.get_vocab_size()}, expected {VOCAB_SIZE}")
    return tokenizer


def write_assets(out_dir: Path) -> None:
    """Build both assets and print their sizes and hashes for the README."""
    out_dir.mkdir(parents=True, exist_ok=True)
    documents = build_corpus()
    corpus = "\n\n".join(documents) + "\n"
    corpus_path = out_dir / "corpus.txt"
    corpus_path.write_text(corpus, encoding="utf-8")
    tokenizer_path = out_dir / "tokenizer.json"
    train_tokenizer(documents).save(str(tokenizer_path), pretty=True)
    for path in (corpus_path, tokenizer_path):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        print(f"{path.name}: {path.stat().st_size} bytes sha256={digest}")
    print(f"documents: {len(documents)}  python: {sys.version.split()[0]}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=ASSETS_DIR)
    args = parser.parse_args(argv)
    write_assets(args.out_dir)


if __name__ == "__main__":
    main()
