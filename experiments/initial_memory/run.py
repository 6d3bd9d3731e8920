#!/usr/bin/env python
"""Host memory of a planned job's start, with the weights initialised whole on every
rank or once on rank 0 and scattered (``training.full_init_max_gib``, ``train/initial.py``).

Each case launches ``run_train.sh`` as a user would (1 training step) twice:
``whole`` (``--training.full_init_max_gib 100``: every rank builds the model)
and ``scattered`` (``--training.full_init_max_gib 0``: rank 0 builds it, each
tensor is scattered). A thread samples the host's ``MemAvailable`` every 50 ms;
memory in use is its drop below the value just before launch, so it counts
every rank (and anything else the host did meanwhile: run on an idle machine).

* ``start_peak_gib``: the most in use up to the log's ``plan agreed and placed``
  line (planning, initialisation and placement);
* ``run_peak_gib``: the most in use over the whole job (the step included);
* ``place_s``: plan.json's ``place`` timing (initialisation and placement);
* the first step's loss and gradient norm, which must be equal bit for bit.

Each pair is launched ``--repeats`` times (whole and scattered alternating);
the table shows the median and the range. A small job's figures are mostly
the host's noise (page cache, the kernel giving memory back): about 1.5 GiB
on this machine, so read the debug model's rows for time and numerics only.

    .venv/bin/python experiments/initial_memory/run.py [--only qwen3] [--repeats 3]

Writes ``results.json`` and ``README.md`` beside this file.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(HERE.parent))

from _run import CONFIGS, read_metrics, run_launcher  # noqa: E402
from bench_args import add_case_args, pick_cases, rewrite_report  # noqa: E402

from torchtitan_autoparallel.train.initial import available_host_bytes  # noqa: E402

INITS = {"whole": "100", "scattered": "0"}
_PLACED = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) plan agreed and placed")


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    flavor: str
    ngpu: int
    extra: tuple[str, ...] = ()


CASES = [
    Case("qwen3-0.6B fsdp 4", "qwen3", "0.6B", 4),
    Case("llama3-debug fsdp 2 x tp 2", "llama3", "debugmodel", 4, ("--parallelism.tensor_parallel_degree", "2")),
]


class MemorySampler(threading.Thread):
    """``MemAvailable`` every ``period`` seconds, with the time it was read."""

    def __init__(self, period: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.period, self.samples, self.done = period, [], threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.samples.append((time.time(), available_bytes()))
            time.sleep(self.period)

    def peak_used(self, baseline: float, until: float = float("inf")) -> float:
        return baseline - min(a for t, a in self.samples if t <= until)


def available_bytes() -> float:
    available = available_host_bytes(cgroups=())  # the host's MemAvailable
    if available is None:
        raise SystemExit("error: /proc/meminfo has no MemAvailable line; this benchmark needs Linux")
    return available


def settled_available(tolerance: float = 64 * 2**20, limit_s: float = 60.0) -> float:
    """``MemAvailable`` once the last job's memory is given back (two reads a second
    apart within ``tolerance``), so it is not counted as this job's."""
    before, start = available_bytes(), time.time()
    while time.time() - start < limit_s:
        time.sleep(1.0)
        now = available_bytes()
        if abs(now - before) < tolerance:
            return now
        before = now
    return before


def launch(case: Case, init: str, dump: Path) -> dict:
    args = ["--model.name", f"{case.model}_auto_parallel", "--model.flavor", case.flavor, *case.extra,
            "--training.full_init_max_gib", INITS[init], "--training.steps", "1",
            "--training.seq_len", "32", "--training.local_batch_size", "1",
            "--metrics.peak_tflops", "1", "--metrics.enable_tensorboard", "false"]  # fmt: skip
    baseline = settled_available()
    sampler = MemorySampler()
    sampler.start()
    run = run_launcher([*args, "--job.dump_folder", str(dump)], ngpu=case.ngpu, config=CONFIGS[case.model], timeout=900)
    sampler.done.set()
    sampler.join()
    out = run.stdout + run.stderr
    placed = _PLACED.search(out)
    placed_at = datetime.strptime(placed.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if placed else None
    row = {
        "case": case.name, "init": init, "rc": run.returncode, "wall_s": round(run.seconds, 1),
        "command": f"NGPU={case.ngpu} CONFIG_FILE={CONFIGS[case.model].relative_to(REPO)} ./run_train.sh "
                   + " ".join(args) + " --job.dump_folder <dump>",
        "start_peak_gib": round(sampler.peak_used(baseline, placed_at) / 2**30, 2) if placed_at else None,
        "run_peak_gib": round(sampler.peak_used(baseline) / 2**30, 2),
        "scattered_logged": "scattering each tensor" in out,
    }  # fmt: skip
    if run.returncode == 0:
        first = read_metrics(dump)[0]
        plan = json.loads((dump / "plan.json").read_text())
        row.update(place_s=round(plan["timings"]["place"], 2), loss=first["loss"], grad_norm=first["grad_norm"])
    else:
        row["error"] = run.tail(3)
    return row


def _spread(rows: list[dict], key: str) -> str:
    values = [r[key] for r in rows if r.get(key) is not None]
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def write_markdown(rows: list[dict], path: Path) -> None:
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["case"], r["init"]), []).append(r)
    lines = [
        "# Host memory at start-up: weights built whole on every rank, or once and scattered",
        "",
        f"Made by `experiments/initial_memory/run.py` on {rows[0]['date']} (2-core, 24 GiB machine, gloo ranks). "
        "Memory is the host's `MemAvailable` drop below its value before launch, sampled every 50 ms, "
        "all ranks together. `start`: up to `plan agreed and placed`; `run`: the whole job (one step). "
        "Median of the launches, range in brackets. Commands in `results.json`.",
        "",
        "| case | init | launches | exits | start peak GiB | run peak GiB | place s | first loss | first grad norm |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (case, init), group in groups.items():
        numerics = {(r.get("loss"), r.get("grad_norm")) for r in group}
        loss, norm = numerics.pop() if len(numerics) == 1 else ("varies", "varies")
        cells = [case, init, len(group), ",".join(str(r["rc"]) for r in group), _spread(group, "start_peak_gib"),
                 _spread(group, "run_peak_gib"), _spread(group, "place_s"), loss, norm]  # fmt: skip
        lines.append("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    lines += [
        "",
        "The start peak falls by about what the ranks other than rank 0 no longer build (the model "
        "once per rank), and placing is quicker because one rank, not all of them, runs the "
        "initialisation on the shared cores. The whole job's peak is the training step's here, so "
        "it falls less. On GPUs, where every rank would otherwise build the whole model on its "
        "device, the scattered path is what lets a model larger than one device start (not "
        "measured here: this machine has no GPU).",
        "",
    ]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_case_args(ap)
    ap.add_argument("--repeats", type=int, default=2, help="launches of each case's pair")
    a = ap.parse_args(argv)
    if a.repeats < 1:
        print(f"error: --repeats must be at least 1, got {a.repeats}", file=sys.stderr)
        return 2
    if a.report_only:
        return rewrite_report(HERE, write_markdown)
    cases = pick_cases(CASES, a.only)
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = []
    with tempfile.TemporaryDirectory(prefix="initial_memory_") as tmp:
        for case in cases:
            for i in range(a.repeats):
                for init in INITS:
                    rows.append({"date": date, **launch(case, init, Path(tmp) / f"{case.model}-{init}-{i}")})
                    print(json.dumps(rows[-1]), flush=True)
    (HERE / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    write_markdown(rows, HERE / "README.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
