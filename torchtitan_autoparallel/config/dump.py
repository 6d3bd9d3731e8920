"""A run's resolved configuration (TOML file plus overrides) as a TOML file of its own.

Rank 0 writes it into the dump folder as ``job_config.toml``, so the folder
says which settings produced its metrics, plan and checkpoints, and
``CONFIG_FILE=<dump_folder>/job_config.toml ./run_train.sh`` runs the same job
again. Keys whose value is none are left out: their default is none too.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

from torchtitan_autoparallel.config.job_config import JobConfig

FILE_NAME = "job_config.toml"
_NOT_WRITTEN = {("job", "config_file")}  # set from the path the file is loaded from


def to_toml(config: JobConfig) -> str:
    lines = []
    for section in fields(config):
        lines.append(f"[{section.name}]")
        values = getattr(config, section.name)
        for key in fields(values):
            value = getattr(values, key.name)
            if value is not None and (section.name, key.name) not in _NOT_WRITTEN:
                lines.append(f"{key.name} = {_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _value(value: object) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # inf and nan are TOML's spellings too
    # a JSON string (ASCII, escaped) is a TOML basic string
    return json.dumps(str(value))


def write_resolved(config: JobConfig) -> Path:
    folder = Path(config.job.dump_folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / FILE_NAME
    origin = config.job.config_file or "no file"
    header = f"# the resolved configuration of the latest run in this folder ({origin} plus its overrides)\n"
    path.write_text(header + to_toml(config))
    return path
