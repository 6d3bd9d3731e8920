"""README.md is user documentation: short, current, and naming only what exists.

History (dates, machines, timings of a given day) belongs in git log; the docs/
reference pages are held to the same rule. No launch: these read files only.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import fields
from pathlib import Path

import pytest

from torchtitan_autoparallel.config.job_config import AutoParallel, Parallelism

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
# docs/torchtitan_keys.md is generated from config/compat.py (tests/config/test_torchtitan_keys.py)
REFERENCE = sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "torchtitan_keys.md")
MAX_LINES = 400

DATE = re.compile(
    r"\b20\d\d-\d\d-\d\d\b"  # 2026-11-27
    r"|\b\d{1,2} (?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]* 20\d\d\b"  # 25 Nov 2026
    r"|\b(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]* \d{1,2},? 20\d\d\b"  # Nov 25, 2026
)
HISTORY = re.compile(
    r"\bVMs?\b|\bvm\b|this machine|the machine here|\d-core machine|last session|previous run"
    r"|earlier run|\bon \d{1,2} (?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)\b"
)
# repository paths the README points at: each must exist
PATH = re.compile(r"(?<![\w/.])((?:docs|experiments|train_configs|constraints|scripts)/[\w./-]*\w)")
MODULE = re.compile(r"python -m (torchtitan_autoparallel(?:\.\w+)+)")


def _offending(pattern: re.Pattern, text: str) -> list[str]:
    return [f"line {n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if pattern.search(line)]


def test_the_readme_is_at_most_400_lines() -> None:
    lines = README.read_text().splitlines()
    assert 100 < len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; at most {MAX_LINES}"


@pytest.mark.parametrize("path", [README, *REFERENCE], ids=lambda p: p.name)
def test_no_dates_or_history(path: Path) -> None:
    text = path.read_text()
    assert not _offending(DATE, text), f"{path.name} holds dates:\n" + "\n".join(_offending(DATE, text))
    assert not _offending(HISTORY, text), f"{path.name} holds history:\n" + "\n".join(_offending(HISTORY, text))


def test_the_checks_catch_what_they_are_for() -> None:
    for line in ["rerun on 25 Nov 2026", "measured 2026-11-30", "Measured on vm (2 cores)",
                 "on this machine it took 3 s", "on the 2-core machine", "the VM's load"]:
        assert DATE.search(line) or HISTORY.search(line), line
    for line in ["torchtitan's mid-2025 job files", "a virtual machine image", "LLaMA3-8B on 8x8"]:
        assert not (DATE.search(line) or HISTORY.search(line)), line


def test_every_planner_and_parallelism_key_is_documented() -> None:
    text = README.read_text()
    missing = [f"{section}.{f.name}" for section, cls in (("autoparallel", AutoParallel), ("parallelism", Parallelism))
               for f in fields(cls) if f"`{f.name}`" not in text]
    assert not missing, f"README.md does not document {missing}"


@pytest.mark.parametrize("path", [README, *REFERENCE], ids=lambda p: p.name)
def test_paths_named_exist(path: Path) -> None:
    named = set(PATH.findall(path.read_text()))
    missing = sorted(p for p in named if not (REPO / p.split("#")[0]).exists())
    assert not missing, f"{path.name} names paths that do not exist: {missing}"


def test_the_commands_named_exist() -> None:
    text = README.read_text()
    modules = set(MODULE.findall(text))
    assert {"torchtitan_autoparallel.report", "torchtitan_autoparallel.calibrate"} <= modules, modules
    missing = sorted(m for m in modules if importlib.util.find_spec(m) is None)
    assert not missing, f"README.md runs modules that do not exist: {missing}"


def test_install_is_two_make_targets_and_the_default_job_is_planned() -> None:
    text = README.read_text()
    assert "    make train" in text and "    make test" in text
    makefile = (REPO / "Makefile").read_text()
    recipe = re.search(r"^train:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert recipe and recipe.group(1).strip() == "./run_train.sh", recipe and recipe.group(1)
    default = re.search(r'CONFIG_FILE:-([^}]+)\}', (REPO / "run_train.sh").read_text()).group(1)
    assert re.search(r'^name = "llama3_auto_parallel"$', (REPO / default).read_text(), re.M), default
