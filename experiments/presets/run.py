#!/usr/bin/env python
"""The cluster job files in ``train_configs/``, each planned for its cluster from
this machine (``COMM_MODE=fake_backend``, one process playing rank 0).

For each file the launcher runs as a user would, with ``NGPU`` the ranks the
file's header names; the row reads back ``plan.json``: the planner's time, the
solver's status and certified gap, the parameter bytes per device, and the
memory check against one H100 (``h100`` profile: weights and AdamW's two
states, plus the step's predicted peak of activations and gradients).

    .venv/bin/python experiments/presets/run.py [--only llama3]

Writes ``results.json`` and ``README.md`` beside this file.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(HERE.parent))

from _run import run_launcher  # noqa: E402
from bench_args import add_case_args, kept_notes, pick_cases, previous_rows, rewrite_report, save_rows  # noqa: E402

from torchtitan_autoparallel.report.common import GIB  # noqa: E402


@dataclass(frozen=True)
class Case:
    name: str  # the row; train_configs/<name>.toml unless ``job_file`` says otherwise
    ngpu: int
    job_file: str = ""
    extra: tuple[str, ...] = ()  # overrides on top of the file

    @property
    def config(self) -> str:
        return self.job_file or self.name


CASES = [
    Case("llama3_8b", 64), Case("llama3_70b", 64), Case("llama3_405b", 128), Case("qwen3_32b", 8),
    # The 405B file on 16 times its cluster: over 256 ranks FSDP's cheapest plan keeps gathered
    # weights for the backward and outgrows the device, so the solve trades step time to fit;
    # HSDP's shard groups of 16 fit as they are.
    Case("llama3_405b-fsdp256", 2048, "llama3_405b"),
    Case("llama3_405b-hsdp16", 2048, "llama3_405b", ("--parallelism.data_parallel_replicate_degree", "16")),
]


def run_case(case: Case) -> dict:
    config = REPO / "train_configs" / f"{case.config}.toml"
    with tempfile.TemporaryDirectory() as out:
        run = run_launcher(["--job.dump_folder", out, *case.extra], config=config, ngpu=case.ngpu,
                           comm_mode="fake_backend", timeout=1800)
        row = {"case": case.name, "ngpu": case.ngpu, "rc": run.returncode, "wall_s": round(run.seconds, 1),
               "command": " ".join([f"CONFIG_FILE=train_configs/{case.config}.toml NGPU={case.ngpu} "
                                    "COMM_MODE=fake_backend ./run_train.sh", *case.extra])}
        if run.returncode != 0:
            return {**row, "error": run.stderr.strip().splitlines()[-1:]}
        plan = json.loads((Path(out) / "plan.json").read_text())
    p = plan["predicted"]
    state = 3 * p["param_bytes_per_device"]
    return {
        **row,
        "mesh": dict(zip(plan["mesh"]["names"], plan["mesh"]["sizes"])),
        "plan_s": round(plan["timings"]["total"], 2),
        "solver": plan["solver"],
        "status": plan["status"],
        "gap": (plan["objective"] - plan["lower_bound"]) / plan["objective"],
        "param_gib": p["param_bytes_per_device"] / GIB,
        "state_gib": state / GIB,
        "peak_gib": p["peak_activation_bytes_per_device"] / GIB,
        "weight_copies_gib": p["peak_weight_copy_bytes_per_device"] / GIB,
        "step_s": plan["objective"] / 1e6,
        "device_gib": plan["device_memory_bytes"] / GIB,
        "fits": state + p["peak_activation_bytes_per_device"] <= plan["device_memory_bytes"],
        "memory_fit": plan.get("memory_fit", {}),
    }


def write_markdown(rows: list[dict], path: Path) -> None:
    lines = [
        "# The cluster job files, planned from one machine",
        "",
        f"Made by `experiments/presets/run.py` on {rows[0]['date']} (2-core machine, no GPU; "
        "`COMM_MODE=fake_backend`, `h100` cost profile). `plan s`: the planner's own time "
        "(trace to plan); `wall s`: the whole launch. Memory per device, as the planner "
        "predicts it: `state` is the weights and AdamW's two states, `peak` the step's "
        "activations and gradients at their worst moment, `weights` the part of it that is weights "
        "cast or gathered and kept for the backward; `step s` the plan's predicted step time. "
        "`unbounded`: where the cheapest plan overflowed the device's memory less 10%, its whole peak "
        "and step time; the plan shown is then the one solved again under memory rows, and `price` its "
        "extra step time (or that no plan was found under the bound). Commands in `results.json`.",
        "",
        "| job file | ranks | mesh | plan s | wall s | solver, status | gap | step s | params GiB | state GiB "
        "| peak GiB | weights GiB | total / device GiB | fits | unbounded GiB, step s | price |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['ngpu']} | error: {r['error']} |")
            continue
        mesh = " x ".join(f"{k} {v}" for k, v in r["mesh"].items())
        total = r["state_gib"] + r["peak_gib"]
        cells = [r["case"], r["ngpu"], mesh, r["plan_s"], r["wall_s"], f"{r['solver']}, {r['status']}",
                 f"{100 * r['gap']:.3f}%", _figure_or_dash(r, "step_s"), f"{r['param_gib']:.2f}",
                 f"{r['state_gib']:.2f}", f"{r['peak_gib']:.2f}", _figure_or_dash(r, "weight_copies_gib"),
                 f"{total:.2f} / {r['device_gib']:.2f}", "yes" if r["fits"] else "no", *_unbounded(r)]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    path.write_text("\n".join(lines) + "\n\n" + kept_notes(path))


def _unbounded(row: dict) -> list[str]:
    fit = row.get("memory_fit")
    if not fit:
        return ["-", "-"]
    price = 100 * (row["step_s"] / (fit["unbounded_objective"] / 1e6) - 1)
    unbounded = f"{fit['unbounded_peak_bytes'] / GIB:.2f}, {fit['unbounded_objective'] / 1e6:.2f}"
    if not fit["fits"]:
        return [unbounded, f"none found under {fit['usable_bytes'] / GIB:.2f} GiB"]
    return [unbounded, f"+{price:.1f}%"]


def _figure_or_dash(row: dict, key: str) -> str:
    """Rows from before a column existed show a dash there."""
    return f"{row[key]:.2f}" if key in row else "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_case_args(ap)
    a = ap.parse_args(argv)
    if a.report_only:
        return rewrite_report(HERE, write_markdown)
    previous = previous_rows(HERE)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    for case in pick_cases(CASES, a.only):
        print(f"planning {case.name} for {case.ngpu} ranks ...", flush=True)
        previous[case.name] = {**run_case(case), "date": str(date.today()), "commit": commit}
        save_rows(HERE, [previous[c.name] for c in CASES if c.name in previous], write_markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
