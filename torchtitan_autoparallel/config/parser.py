"""TOML file + ``--section.key value`` overrides -> a validated ``JobConfig``.

Every mistake becomes a ``ConfigError`` whose one-line message names the bad
value and what would be accepted; the launcher prints it without a traceback.
torchtitan's own keys are read too (``compat.py``): mapped ones under our
names, the others accepted, with one warning each where they would change what
torchtitan does.
"""

from __future__ import annotations

import os
import sys
import types
import typing
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import tomli

from torchtitan_autoparallel.config.compat import ACCEPTED, ACCEPTED_SECTIONS, MAPPED
from torchtitan_autoparallel.config.job_config import SECTIONS, JobConfig
from torchtitan_autoparallel.config.validate import validate
from torchtitan_autoparallel.errors import ConfigError

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def load_config(argv: list[str] | None = None, config_file: str | None = None) -> JobConfig:
    """Build the config from an optional TOML file and CLI overrides, then validate it."""
    overrides = parse_overrides(argv or [])
    path = config_file or overrides.get("job", {}).get("config_file")
    config = JobConfig()
    accepted: dict[str, tuple[Any, str]] = {}
    if path:
        _apply(config, read_toml(path), source=str(path), from_cli=False, accepted=accepted)
        config.job.config_file = str(path)
    _apply(config, overrides, source="command line", from_cli=True, accepted=accepted)
    validate(config)
    _show(_warn_accepted(config, accepted))
    return config


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(path)!r} not found; pass an existing .toml file")
    try:
        with p.open("rb") as f:
            return tomli.load(f)
    except tomli.TOMLDecodeError as e:
        raise ConfigError(f"TOML syntax error in {str(path)!r}: {e}") from None
    except UnicodeDecodeError as e:  # TOML is UTF-8 by its spec; tomli decodes before it parses
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
            "accepted: a UTF-8 TOML file"
        ) from None


def parse_overrides(argv: list[str]) -> dict[str, dict[str, str]]:
    """``['--training.steps', '5', '--x.y=z']`` -> ``{'training': {'steps': '5'}, 'x': {'y': 'z'}}``.

    torchtitan's own spellings (its CLI is tyro's) read the same: a bool key
    alone is true (``--compile.enable``), ``no-`` before it is false
    (``--compile.no-enable``), and ``-`` in a name reads as ``_``.
    """
    out: dict[str, dict[str, str]] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(
                f"unexpected argument {arg!r}; overrides look like --section.key value"
            )
        key, eq, value = arg[2:].partition("=")
        section, _, name = key.replace("-", "_").partition(".")
        if not eq:
            following = argv[i + 1] if i + 1 < len(argv) else None
            name, value = _flag(section, name, following)
            if value is None:
                if following is None or _is_override(following):
                    raise ConfigError(f"override {arg!r} has no value; use {arg} VALUE")
                value = following
                i += 1
        out.setdefault(section, {})[name] = value
        i += 1
    return out


def _flag(section: str, name: str, following: str | None) -> tuple[str, str | None]:
    """``name`` and its value where ``--section.name`` stands alone as a bool flag
    (the value None where the next argument is the value)."""
    if _is_bool_key(section, name):
        alone = following is None or _is_override(following)
        return name, "true" if alone else None  # else the spelled-out --compile.enable true
    positive = name.removeprefix("no_")
    if positive != name and _is_bool_key(section, positive) and not _is_key(section, name):
        return positive, "false"
    return name, None


def _is_override(arg: str) -> bool:
    """Whether ``arg`` starts the next override rather than being a value (``-1`` is a value)."""
    return arg.startswith("--") and "." in arg and arg[2:3].isalpha()


@cache  # asked up to three times per argument
def _section_hints(section: str) -> dict[str, Any]:
    if section not in SECTIONS:
        return {}
    return typing.get_type_hints(typing.get_type_hints(JobConfig)[section])


def _ours(dotted: str) -> str:
    """The key ``dotted`` (torchtitan's or ours) is read as here."""
    return MAPPED.get(dotted, dotted)


def _hint(dotted: str) -> Any:
    """The type of a known key, None for an unknown one."""
    if dotted in ACCEPTED:
        return ACCEPTED[dotted].hint
    section, _, name = _ours(dotted).partition(".")
    return _section_hints(section).get(name)


def _is_key(section: str, name: str) -> bool:
    return _hint(f"{section}.{name}") is not None


def _is_bool_key(section: str, name: str) -> bool:
    hint = _hint(f"{section}.{name}")
    return hint is not None and not _is_str_list(hint) and bool in _base_types(hint)


def _flatten(data: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every leaf; torchtitan nests tables (``[quantize.linear.float8]``)."""
    for key, value in data.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _known_keys(section: str) -> list[str]:
    ours = [f"{section}.{name}" for name in _section_hints(section)]
    theirs = [k for k in (*MAPPED, *ACCEPTED) if k.startswith(f"{section}.")]
    return [k.partition(".")[2] for k in ours + theirs]


def _apply(
    config: JobConfig, data: dict[str, Any], *, source: str, from_cli: bool, accepted: dict[str, tuple[Any, str]]
) -> None:
    """Set every key of ``data`` on ``config``; torchtitan's keys without a feature here
    go to ``accepted`` (key -> (value, source)) for ``_warn_accepted``."""
    read = _from_text if from_cli else _check_type
    for section, values in data.items():
        if section not in SECTIONS and section not in _THEIR_SECTIONS:
            raise ConfigError(
                f"unknown section [{section}] in {source}; known sections: {', '.join(SECTIONS + _THEIR_SECTIONS)}"
            )
        if not isinstance(values, dict):
            raise ConfigError(f"[{section}] in {source} must be a table of keys")
        for dotted, raw in _flatten(values, f"{section}."):
            hint = _hint(dotted)
            if hint is None:
                raise ConfigError(
                    f"unknown key {dotted} in {source}; known keys of [{section}]: {', '.join(_known_keys(section))}"
                )
            value = read(raw, hint) if dotted not in ACCEPTED or from_cli else raw
            if value is _BAD:
                raise ConfigError(f"{dotted} = {raw!r} in {source} is not a valid {type_name(hint)}")
            if dotted in ACCEPTED:
                accepted[dotted] = (value, source)
                continue
            target, _, name = _ours(dotted).partition(".")
            setattr(getattr(config, target), name, value)


def _warn_accepted(config: JobConfig, accepted: dict[str, tuple[Any, str]]) -> list[str]:
    """One line per accepted torchtitan key whose value would make torchtitan run
    differently from this job (compat.ACCEPTED)."""

    def get(dotted: str) -> Any:
        if dotted in accepted:
            return accepted[dotted][0]
        if dotted in ACCEPTED:
            return ACCEPTED[dotted].same
        section, _, name = dotted.partition(".")
        return getattr(getattr(config, section), name)

    return [
        f"{key} = {value!r} in {source} has no effect here; in torchtitan it {ACCEPTED[key].does}"
        for key, (value, source) in accepted.items()
        if ACCEPTED[key].warns(value, get)
    ]


_THEIR_SECTIONS = tuple(s for s in ACCEPTED_SECTIONS if s not in SECTIONS)
_SHOWN: set[str] = set()  # warnings printed by this process: the launcher and a fake-backend run load twice
# set by the launcher for its ranks (train/failures.py): it printed the warnings already
_LAUNCHER_ENV = "TORCHTITAN_AUTOPARALLEL_LAUNCHER"


def _show(warnings: list[str]) -> None:
    """Print each warning once per job: by the launcher, or else by rank 0 alone."""
    if os.environ.get(_LAUNCHER_ENV) or os.environ.get("RANK", "0") != "0":
        return
    for line in warnings:
        if line not in _SHOWN:
            _SHOWN.add(line)
            print(f"warning: {line}", file=sys.stderr)


_BAD = object()


def _base_types(hint: Any) -> tuple[type, ...]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return tuple(t for t in typing.get_args(hint) if t is not type(None))
    return (hint,)


def _optional(hint: Any) -> bool:
    return type(None) in typing.get_args(hint)


def _is_str_list(hint: Any) -> bool:
    return typing.get_origin(hint) is list


def type_name(hint: Any) -> str:
    if _is_str_list(hint):
        return "list of str"
    names = [t.__name__ for t in _base_types(hint)]
    return " or ".join(names + (["none"] if _optional(hint) else []))


def _from_text(text: str, hint: Any) -> Any:
    if _is_str_list(hint):  # on the command line: comma-separated
        return [item.strip() for item in text.split(",") if item.strip()]
    if _optional(hint) and text.lower() in {"none", "null", ""}:
        return None
    for t in _base_types(hint):
        value = _parse_one(text, t)
        if value is not _BAD:
            return value
    return _BAD


def _parse_one(text: str, t: type) -> Any:
    if t is bool:
        low = text.lower()
        return True if low in _TRUE else False if low in _FALSE else _BAD
    if t in (int, float):
        try:
            return t(text)
        except ValueError:
            return _BAD
    return text


def _check_type(value: Any, hint: Any) -> Any:
    if _is_str_list(hint):
        return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else _BAD
    bases = _base_types(hint)
    if isinstance(value, bool):
        return value if bool in bases else _BAD
    if isinstance(value, int) and float in bases and int not in bases:
        return float(value)
    return value if isinstance(value, bases) else _BAD
