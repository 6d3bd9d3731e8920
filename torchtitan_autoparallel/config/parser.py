"""TOML file + ``--section.key value`` overrides -> a validated ``JobConfig``.

Every mistake becomes a ``ConfigError`` whose one-line message names the bad
value and what would be accepted; the launcher prints it without a traceback.
"""

from __future__ import annotations

import types
import typing
from dataclasses import fields
from functools import cache
from pathlib import Path
from typing import Any

import tomli

from torchtitan_autoparallel.config.compat import INERT, INERT_SECTIONS, Inert, translate
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
    if path:
        _apply(config, read_toml(path), source=str(path), from_cli=False)
        config.job.config_file = str(path)
    _apply(config, overrides, source="command line", from_cli=True)
    validate(config)
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


def _is_key(section: str, name: str) -> bool:
    return name in _section_hints(section) or (section, name) in INERT


def _is_bool_key(section: str, name: str) -> bool:
    key = translate(section, name)
    hint = key.hint if isinstance(key, Inert) else _section_hints(section).get(key)
    return hint is not None and not _is_str_list(hint) and bool in _base_types(hint)


def _apply(config: JobConfig, data: dict[str, Any], *, source: str, from_cli: bool) -> None:
    for section, values in data.items():
        if section not in SECTIONS and section not in INERT_SECTIONS:
            raise ConfigError(
                f"unknown section [{section}] in {source}; known sections: {', '.join(SECTIONS)}"
            )
        if not isinstance(values, dict):
            raise ConfigError(f"[{section}] in {source} must be a table of keys")
        target = getattr(config, section, None)
        known = [f.name for f in fields(target)] if target is not None else INERT_SECTIONS[section]
        read = _from_text if from_cli else _check_type
        for old_key, raw in values.items():
            key = translate(section, old_key)  # torchtitan's older keys (compat.py)
            if isinstance(key, Inert):
                key.check(f"{section}.{old_key}", raw, read, source)
                continue
            if key not in known:
                raise ConfigError(
                    f"unknown key {section}.{key} in {source}; known keys of [{section}]: "
                    f"{', '.join(known)}"
                )
            hint = typing.get_type_hints(type(target))[key]
            value = read(raw, hint)
            if value is _BAD:
                raise ConfigError(
                    f"{section}.{key} = {raw!r} in {source} is not a valid {type_name(hint)}"
                )
            setattr(target, key, value)


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
