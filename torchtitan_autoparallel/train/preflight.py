"""Check a job before any rank starts, so bad input is reported once, in one line.

``run_train.sh`` runs this with the same arguments as the job plus ``--ngpu``;
a non-zero exit stops the launch before torchrun prints per-rank failures.
"""

from __future__ import annotations

import sys
from pathlib import Path

from torchtitan_autoparallel.config import JobConfig, load_config, resolve_degrees
from torchtitan_autoparallel.errors import ConfigError, UserError


def check(job: JobConfig, ngpu: int) -> None:
    from torchtitan_autoparallel.models.registry import build_model_config, get_entry
    from torchtitan_autoparallel.train import checkpoint
    from torchtitan_autoparallel.train.setup import check_model_fits_mesh

    degrees = resolve_degrees(job, ngpu)
    entry = get_entry(job.model.name)
    check_model_fits_mesh(build_model_config(entry.family, job.model.flavor), degrees)
    if entry.auto_parallel:
        _check_cost_profile(job.autoparallel.cost_profile)
    checkpoint.check_resume(job, entry.family)
    t = job.training
    if t.dataset in ("text", "jsonl") and not Path(t.dataset_path).exists():
        raise ConfigError(
            f"training.dataset_path {t.dataset_path!r} does not exist; accepted: a {t.dataset} "
            f"file or a folder of them"
        )


def _check_cost_profile(name: str) -> None:
    from torchtitan_autoparallel.planner.profiles import load_profile

    if name == "auto":
        return
    try:
        load_profile(name)
    except ValueError as e:
        raise ConfigError(f"autoparallel.cost_profile: {e}") from None


def parse_ngpu(text: str) -> int:
    try:
        ngpu = int(text)
    except ValueError:
        raise ConfigError(f"NGPU={text!r} is not a number; accepted: a positive integer") from None
    if ngpu < 1:
        raise ConfigError(f"NGPU={ngpu}; accepted: a positive integer")
    return ngpu


def main(argv: list[str]) -> int:
    try:
        if len(argv) < 2 or argv[0] != "--ngpu":
            raise ConfigError("usage: preflight --ngpu N [--section.key value ...]")
        check(load_config(argv[2:]), parse_ngpu(argv[1]))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
