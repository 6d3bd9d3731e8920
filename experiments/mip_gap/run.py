#!/usr/bin/env python
"""What ``--autoparallel.mip_gap`` buys: planning time against the plan's proven gap.

Each row plans one job as a user checks a cluster they do not have: the
launcher with ``COMM_MODE=fake_backend`` (one process plays rank 0 of the
world size), a fresh dump folder and the plan cache off. It reads plan.json:
the solve stage's time, the whole planning time, the plan's objective, its
proven lower bound and status. ``vs optimum`` compares the objective with the
case's run without a gap (the proven optimum, or the best plan known where
that run stopped short of a proof).

    .venv/bin/python experiments/mip_gap/run.py            # every case
    .venv/bin/python experiments/mip_gap/run.py --only 8B  # cases whose name contains "8B"

Writes ``results.json`` and ``README.md`` beside this file. Run on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "tests"))

from _run import run_launcher  # noqa: E402

QWEN3 = REPO / "train_configs" / "qwen3_debugmodel.toml"
# fp32 matmuls at TF32 rates, as when the committed tables were measured (docs/cost_model.md)
SHAPE = ["--training.seq_len", "2048", "--training.local_batch_size", "1", "--training.float32_matmul_precision", "high"]
MESH_8X8 = ["--parallelism.tensor_parallel_degree", "8"]
MESH_8X8X8 = ["--parallelism.data_parallel_replicate_degree", "8", *MESH_8X8]


@dataclass(frozen=True)
class Case:
    name: str
    ngpu: int
    args: list[str]
    gaps: tuple[float | None, ...]  # None first: the reference run
    config: Path | None = None


CASES = [
    Case("llama3-70B 3-D 8x8x8", 512, ["--model.flavor", "70B", *MESH_8X8X8], (None, 0.001, 0.01)),
    Case("qwen3-8B 3-D 8x8x8", 512, ["--model.flavor", "8B", *MESH_8X8X8], (None, 0.001, 0.01), QWEN3),
    Case("llama3-8B 2-D 8x8 overlap", 64, ["--model.flavor", "8B", *MESH_8X8, "--autoparallel.overlap", "true"],
         (None, 0.005, 0.02)),
    Case("llama3-70B 3-D 8x8x8 overlap", 512,
         ["--model.flavor", "70B", *MESH_8X8X8, "--autoparallel.overlap", "true"], (None, 0.005, 0.01)),
]


def command(case: Case, gap: float | None) -> list[str]:
    args = ["--model.name", f"{'qwen3' if case.config == QWEN3 else 'llama3'}_auto_parallel",
            *case.args, *SHAPE, "--autoparallel.plan_cache", "false"]
    return args + ([] if gap is None else ["--autoparallel.mip_gap", repr(gap)])


def plan_once(case: Case, gap: float | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="mip-gap-") as dump:
        args = [*command(case, gap), "--job.dump_folder", dump]
        load = os.getloadavg()[0]
        run = run_launcher(args, ngpu=case.ngpu, config=case.config, comm_mode="fake_backend", timeout=1800)
        if run.returncode != 0:
            raise SystemExit(f"{case.name} (mip_gap {gap}) failed:\n{run.tail()}")
        plan = json.loads((Path(dump) / "plan.json").read_text())
    objective, bound = plan["objective"], plan["lower_bound"]
    return {
        "mip_gap": gap,
        "solver": plan["solver"],
        "status": plan["status"],
        "solve_s": round(plan["timings"]["solve"], 2),
        "planning_s": round(plan["timings"]["total"], 2),
        "wall_s": round(run.seconds, 2),
        "objective_us": objective,
        "lower_bound_us": bound,
        "proven_gap": (objective - bound) / objective,
        "load_average": load,
        "command": f"COMM_MODE=fake_backend NGPU={case.ngpu}"
        + (f" CONFIG_FILE={case.config.relative_to(REPO)}" if case.config else "")
        + " ./run_train.sh " + " ".join(command(case, gap)),
    }


def run_case(case: Case) -> dict:
    rows = []
    for gap in case.gaps:
        row = plan_once(case, gap)
        reference = rows[0]["objective_us"] if rows else row["objective_us"]
        row["vs_optimum"] = (row["objective_us"] - reference) / reference
        rows.append(row)
        print(f"{case.name} mip_gap={gap}: solve {row['solve_s']} s, {row['status']}, "
              f"proven gap {100 * row['proven_gap']:.3f}%", flush=True)
    return {"case": case.name, "runs": rows}


def _gap_text(gap: float | None) -> str:
    return "none" if gap is None else f"{100 * gap:g}%"


def write_readme(results: dict) -> None:
    lines = [
        "# mip_gap: planning time against the proven gap",
        "",
        f"Measured on {platform.node()} ({platform.machine()}, {os.cpu_count()} cores), "
        f"{results['date']}, H100 cost profile (fp32 matmuls at TF32 rates), fake process group, sequence 2048, one sample per "
        "data-parallel rank. Each row is one launcher run (`COMM_MODE=fake_backend`, plan cache "
        "off); its command is under `command` in `results.json`. Reproduce: "
        "`.venv/bin/python experiments/mip_gap/run.py`.",
        "",
        "`solve s`: the solve stage (plan.json's timings); `planning s`: trace to plan. "
        "`proven gap`: (objective - lower bound) / objective, as plan.json states it. "
        "`vs optimum`: the objective against the row without a gap (the proven optimum, "
        "where that row says optimal).",
        "",
        "| case | mip_gap | solver | status | solve s | planning s | proven gap | vs optimum |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for case in results["cases"]:
        for r in case["runs"]:
            lines.append(
                f"| {case['case']} | {_gap_text(r['mip_gap'])} | {r['solver']} | {r['status']} | "
                f"{r['solve_s']:.2f} | {r['planning_s']:.2f} | {100 * r['proven_gap']:.3f}% | "
                f"{100 * r['vs_optimum']:+.3f}% |"
            )
    old = HERE / "README.md"
    notes = ""
    if old.exists() and "<!-- notes -->" in (text := old.read_text()):
        notes = text[text.index("<!-- notes -->"):]
    (HERE / "README.md").write_text("\n".join(lines) + "\n\n" + (notes or "<!-- notes -->\n"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="run the cases whose name contains this")
    args = ap.parse_args(argv)
    cases = [c for c in CASES if args.only in c.name]
    if not cases:
        raise SystemExit(f"error: no case matches --only {args.only!r}; cases: {', '.join(c.name for c in CASES)}")
    results = {"date": time.strftime("%Y-%m-%d"), "cases": [run_case(c) for c in cases]}
    (HERE / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    write_readme(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
