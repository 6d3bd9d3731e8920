"""The CBC backend of the exact solver: PuLP's bundled CBC binary as a guarded subprocess.

CBC reads an MPS file written from the ``IlpModel``'s CSR arrays (and a MIP
start, when there is one) and writes its plan to a solution file. Its own
``-sec`` limit is not kept on big models (the root LP and preprocessing do not
look at the clock), so the binary runs in its own session and is stopped,
then killed, shortly after the deadline; whatever plan is known is returned.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time

import numpy as np

from torchtitan_autoparallel.planner.problem.problem import Problem
from torchtitan_autoparallel.planner.solve.exact.ilp import (
    LOG,
    MIP_REL_GAP,
    _Heartbeat,
    IlpSolver,
    _remaining,
    _Run,
)
from torchtitan_autoparallel.planner.solve.exact.model import IlpModel

CBC_OVERRUN_S = 1.0  # CBC past its limit for this long is stopped (SIGINT: it writes its plan)
CBC_STOP_WAIT_S = 2.0  # then this long to write it before the whole process group is killed


class CbcILPSolver(IlpSolver):
    """CBC as a subprocess this class controls: CBC's own ``-sec`` is not kept on big
    models (the root LP and preprocessing do not look at the clock), so the binary runs
    in its own session and is stopped, then killed, shortly after the deadline."""

    def __init__(self, name: str = "ilp-cbc", mip_gap: float = MIP_REL_GAP) -> None:
        self.name = name
        self.mip_gap = mip_gap

    def _run(
        self, model: IlpModel, time_limit: float | None, problem: Problem | None = None
    ) -> _Run:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="cbc-") as folder:
            paths = {k: os.path.join(folder, f"model.{k}") for k in ("mps", "mst", "sol", "log")}
            _write_mps(model, paths["mps"])
            if model.start is not None:
                _write_mip_start(model, paths["mst"])
            # writing the files counts against the limit too
            left = _remaining(t0, time_limit)
            LOG.info("%s: model written in %.2f s, running CBC", self.name, time.perf_counter() - t0)
            args = _cbc_args(model, paths, left, self.mip_gap)
            exit_code = _launch_cbc(self.name, args, paths["log"], left)
            with open(paths["log"], errors="replace") as f:
                log_text = f.read()
            found = _read_solution(paths["sol"], model.num_col)
        out_of_time = time_limit is not None and time.perf_counter() - t0 >= time_limit
        return self._outcome(model, exit_code, found, log_text, out_of_time)

    def _outcome(
        self, model: IlpModel, exit_code: int | None, found: tuple[str, np.ndarray | None] | None,
        log_text: str, out_of_time: bool = False,
    ) -> _Run:
        """Map CBC's exit, solution file and log onto a ``_Run``; never raises on a stop."""
        if exit_code is None or exit_code != 0 or found is None:
            # killed past the deadline or crashed: whatever plan is known, unproven
            return _best_known(model, found, "time_limit" if exit_code is None else "feasible")
        head, values = found
        word = head.split()[0] if head.split() else ""
        # preprocessing cut short by the clock says "infeasible" without "Stopped on time"
        stopped = out_of_time or "Stopped on time" in log_text or word == "Stopped"
        if word == "Optimal" and values is not None:
            objective = float(model.col_cost @ values)
            if self.stops_early and "within gap tolerance" in head:  # the log has the bound
                return self._gap_status(_Run("optimal", values, objective, _cbc_bound(log_text, objective)))
            return _Run("optimal", values, objective, objective)
        if values is not None and word == "Stopped":
            run = _best_known(model, found, "time_limit")
            if run.status != "no_solution":  # CBC's proven gap, applied to the plan kept
                run.bound = _cbc_bound(log_text, run.objective)
            return run
        # CBC can call a problem infeasible when the clock stops it before its first
        # LP ends; a known-feasible warm start or "stopped on time" in the log disproves it
        if word in ("Infeasible", "Integer", "Stopped"):
            if model.start is not None:
                return _best_known(model, None, "time_limit" if stopped else "feasible")
            return _Run("no_solution" if stopped else "infeasible")
        raise RuntimeError(f"{self.name}: CBC ended with {head.strip()!r}")


def _cbc_path() -> str:
    """PuLP's bundled CBC binary, else one on PATH."""
    from pulp.apis.coin_api import PULP_CBC_CMD

    bundled = PULP_CBC_CMD.pulp_cbc_path
    if bundled and os.access(bundled, os.X_OK):
        return bundled
    found = shutil.which("cbc")
    if found is None:
        raise RuntimeError("ilp-cbc: no CBC binary (PuLP's bundled one or cbc on PATH)")
    return found


def _cbc_args(
    model: IlpModel, paths: dict[str, str], time_limit: float | None, gap: float = MIP_REL_GAP
) -> list[str]:
    args = [_cbc_path(), paths["mps"], "-ratio", repr(gap), "-timeMode", "elapsed"]
    if model.start is not None:
        args += ["-mips", paths["mst"]]
    if time_limit is not None:
        args += ["-sec", repr(float(time_limit))]
    # "normal" printing lists only the nonzero columns: a much smaller file to parse
    return args + ["-solve", "-printingOptions", "normal", "-solution", paths["sol"]]


def _launch_cbc(name: str, args: list[str], log_path: str, time_limit: float | None) -> int | None:
    """Run CBC; its exit code, or None when it overran and was stopped."""
    with open(log_path, "w") as log, _Heartbeat(name):
        proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group, so a kill reaches all of it
        )
        try:
            return proc.wait(None if time_limit is None else time_limit + CBC_OVERRUN_S)
        except subprocess.TimeoutExpired:
            pass
        LOG.warning(
            "%s: CBC is still running %.0f s past its %.1f s limit; stopping it",
            name, CBC_OVERRUN_S, time_limit,
        )
        # SIGINT first: CBC then ends its search and writes the best plan it has
        _signal_group(proc, signal.SIGINT)
        try:
            proc.wait(CBC_STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
        return None


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass  # it ended on its own in the meantime


def _best_known(
    model: IlpModel, found: tuple[str, np.ndarray | None] | None, status: str
) -> _Run:
    """The cheaper of CBC's written plan (if complete and feasible) and the warm start."""
    candidates = []
    if found is not None and found[1] is not None and _satisfies(model, found[1]):
        candidates.append(found[1])
    if model.start is not None:
        candidates.append(model.col_values(model.start))
    if not candidates:
        return _Run("no_solution")
    values = min(candidates, key=lambda v: float(model.col_cost @ v))
    return _Run(status, values, float(model.col_cost @ values))


def _satisfies(model: IlpModel, values: np.ndarray, tol: float = 1e-6) -> bool:
    """Every row of the model holds (a written plan may be cut short or infeasible)."""
    x = values[: model.num_x]
    if np.minimum(np.abs(x), np.abs(1.0 - x)).max(initial=0.0) > tol:
        return False
    rows = np.repeat(np.arange(model.num_row), np.diff(model.row_start))
    activity = np.bincount(rows, model.row_value * values[model.row_index], minlength=model.num_row)
    return bool(np.all(activity >= model.row_lower - tol) and np.all(activity <= model.row_upper + tol))


def _write_mps(model: IlpModel, path: str) -> None:
    """The model as an MPS file, written from the CSR arrays in bulk (column-major)."""
    num_row, num_col = model.num_row, model.num_col
    equal = model.row_lower == model.row_upper
    row_of = np.repeat(np.arange(num_row), np.diff(model.row_start))
    # one entry per matrix nonzero and per nonzero cost (row -1: the objective), by column
    # (a column with no matrix entry gets a zero cost entry: it must still be declared)
    in_matrix = np.zeros(num_col, dtype=bool)
    in_matrix[model.row_index] = True
    cost_cols = np.flatnonzero((model.col_cost != 0.0) | ~in_matrix)
    cols = np.concatenate([cost_cols, model.row_index])
    rows = np.concatenate([np.full(len(cost_cols), -1), row_of])
    vals = np.concatenate([model.col_cost[cost_cols], model.row_value])
    order = np.lexsort((rows, cols))
    names = ["OBJ"] + [f"R{r}" for r in range(num_row)]
    with open(path, "w") as f:
        f.write("NAME sharding\nROWS\n N OBJ\n")
        f.writelines(f" {'E' if equal[r] else 'L'} R{r}\n" for r in range(num_row))
        f.write("COLUMNS\n")
        split = int(np.searchsorted(cols[order], model.num_x))
        _write_entries(f, cols[order[:split]], rows[order[:split]], vals[order[:split]], names,
                       integer=True)
        _write_entries(f, cols[order[split:]], rows[order[split:]], vals[order[split:]], names,
                       integer=False)
        f.write("RHS\n")
        rhs = model.row_upper.tolist()
        f.writelines(f" RHS R{r} {rhs[r]!r}\n" for r in range(num_row) if rhs[r] != 0.0)
        f.write("BOUNDS\n")
        # CBC reads BOUNDS by fixed MPS columns when the names fit them: pad to those
        f.writelines(f" UP BND       {'C' + str(c):<8}  1\n" for c in range(num_col))
        f.write("ENDATA\n")


def _write_entries(f, cols: np.ndarray, rows: np.ndarray, vals: np.ndarray,  # noqa: ANN001
                   names: list[str], integer: bool) -> None:
    if integer:
        f.write(" MARKER 'MARKER' 'INTORG'\n")
    f.writelines(
        f" C{c} {names[r + 1]} {v!r}\n" for c, r, v in zip(cols.tolist(), rows.tolist(), vals.tolist())
    )
    if integer:
        f.write(" MARKER 'MARKER' 'INTEND'\n")


def _write_mip_start(model: IlpModel, path: str) -> None:
    """The warm start in CBC's solution format (read back by ``-mips``): every binary."""
    values = model.col_values(model.start)[: model.num_x].tolist()
    with open(path, "w") as f:
        f.write("Stopped on time - objective value 0\n")
        f.writelines(f"{i} C{i} {v:g} 0\n" for i, v in enumerate(values))


def _read_solution(path: str, num_col: int) -> tuple[str, np.ndarray | None] | None:
    """CBC's status line and column values (None when the file lists no plan or is
    cut short); None when there is no file."""
    if not os.path.exists(path):
        return None
    with open(path, errors="replace") as f:
        head = f.readline()
        values = np.zeros(num_col)
        try:
            for line in f:
                parts = line.split()
                if parts and parts[0] == "**":  # CBC marks infeasible entries so
                    parts = parts[1:]
                if len(parts) >= 3 and parts[1].startswith("C"):
                    values[int(parts[1][1:])] = float(parts[2])
        except (ValueError, IndexError):
            return head, None  # a truncated file: the plan is not usable
    has_plan = "objective value" in head
    return head, values if has_plan else None


def _cbc_bound(log_text: str, objective: float) -> float:
    """CBC's best bound from its log (PuLP does not expose it); -inf if absent."""
    found = re.search(r"Lower bound:\s*([-+0-9.eE]+)", log_text)
    if not found:
        return -math.inf
    # CBC's printed figures may differ from ours by PuLP's handling of constants;
    # keep only the gap it proves, applied to our objective
    printed = re.search(r"Objective value:\s*([-+0-9.eE]+)", log_text)
    gap = float(printed.group(1)) - float(found.group(1)) if printed else math.inf
    return objective - max(gap, 0.0)
