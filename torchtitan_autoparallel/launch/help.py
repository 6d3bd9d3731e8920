"""``./run_train.sh --help``: every key a job accepts, with its type, default and meaning.

The meanings are the comments beside (or just above) each field in
``job_config.py``, read from its source, so the help and the code cannot drift
apart. With a config file, the value it sets is shown beside the default.
"""

from __future__ import annotations

import inspect
import re
import typing
from dataclasses import fields

from torchtitan_autoparallel.config import validate as v
from torchtitan_autoparallel.config.job_config import JobConfig
from torchtitan_autoparallel.config.parser import load_config, type_name
from torchtitan_autoparallel.errors import UserError
from torchtitan_autoparallel.models.registry import MODELS

HELP_FLAGS = ("-h", "--help")
USAGE = """usage: [NGPU=N] [CONFIG_FILE=job.toml] ./run_train.sh [--section.key value ...]

Every key of the TOML job file can be set on the command line as --section.key value
(or --section.key=value); the command line wins over the file, the file over the default.
A bool key alone is true and with no- before it false, as in torchtitan: --compile.enable,
--compile.no-enable.
Environment: NGPU (ranks), CONFIG_FILE, LOG_RANK (ranks whose output is shown),
COMM_MODE=fake_backend (one process plans for NGPU ranks), CALIBRATE=1 (measure this
cluster); see the head of run_train.sh and the README.
torchtitan's own keys (0.2.2 and mid-2025) are read too, under our names or accepted with a
warning where they have no effect here: docs/torchtitan_keys.md lists them."""

_FIELD = re.compile(r"^\s+(\w+):[^=]+=[^#]*(?:#\s*(.*))?$")
_COMMENT = re.compile(r"^\s+#\s?(.*)$")


def wants_help(argv: list[str]) -> bool:
    return any(a in HELP_FLAGS for a in argv)


def help_for(argv: list[str]) -> str:
    """The help, with the values of the job that ``argv`` (less the help flag) describes;
    a job that does not load is shown as the defaults alone."""

    try:
        job = load_config([a for a in argv if a not in HELP_FLAGS])
    except UserError:
        job = None
    return help_text(job)


def field_notes(cls: type) -> dict[str, str]:
    """Field name -> its comment in the class source (the lines above, then the one beside)."""
    notes: dict[str, str] = {}
    above: list[str] = []
    for line in inspect.getsource(cls).splitlines()[1:]:
        if m := _COMMENT.match(line):
            above.append(m.group(1).strip())
        elif m := _FIELD.match(line):
            if note := " ".join(above + ([m.group(2).strip()] if m.group(2) else [])):
                notes[m.group(1)] = note
            above = []
        else:
            above = []
    return notes


def help_text(file_values: JobConfig | None = None) -> str:
    """The usage and every section's keys; ``file_values``: a loaded job, whose values
    other than the defaults are shown."""
    defaults = JobConfig()
    choices = _choices()
    lines = [USAGE]
    for section in fields(JobConfig):
        cls = type(getattr(defaults, section.name))
        notes = field_notes(cls)
        hints = typing.get_type_hints(cls)
        lines += ["", f"[{section.name}]"]
        for f in fields(cls):
            default = getattr(defaults, section.name).__dict__[f.name]
            entry = f"  --{section.name}.{f.name} {_type_name(hints[f.name])} (default {default!r})"
            if file_values is not None:
                value = getattr(getattr(file_values, section.name), f.name)
                if value != default:
                    entry += f", this job: {value!r}"
            lines.append(entry)
            if notes.get(f.name):
                lines.append(f"      {notes[f.name]}")
            if accepted := choices.get(f"{section.name}.{f.name}"):
                lines.append(f"      accepted: {', '.join(accepted)}")
    return "\n".join(lines)


def _choices() -> dict[str, tuple[str, ...]]:
    """The keys whose values come from a list, with that list (as the checks use it)."""

    return {
        "model.name": tuple(MODELS),
        "training.mixed_precision_param": v.DTYPES,
        "optimizer.name": v.OPTIMIZERS,
        "lr_scheduler.decay_type": v.DECAY_TYPES,
        "checkpoint.export_dtype": v.EXPORT_DTYPES,
        "checkpoint.async_mode": v.ASYNC_MODES,
        "activation_checkpoint.mode": v.AC_MODES,
        "autoparallel.solver": v.SOLVERS,
        "autoparallel.ilp_backend": v.ILP_BACKENDS,
    }


def _type_name(hint) -> str:

    comma = " (comma-separated on the command line)" if typing.get_origin(hint) is list else ""
    return type_name(hint) + comma
