"""A plan cache: a start-up whose problem and settings match an earlier one reuses its solution.

The entry holds only the solution (assignment, objective, bound, solver,
status), not the plan: every rank traces and builds the problem anyway (the
executor needs the graph), so the solve is the only stage worth skipping.

The key is a sha256 over the problem's fingerprint (``agree.fingerprint``:
node names, strategy counts and labels), the traced tensor shapes, and the
settings the costs depend on (mesh, batch, dtypes, cost profile, solver,
memory budget, plus whatever the caller adds, e.g. the model config). A hit is
still checked against this run's tables before it is trusted; an entry that
is unreadable, from another format or package version, or no longer an
optimum-priced feasible assignment of this problem is ignored with a warning,
and the fresh solution overwrites it.

Only the solve closure reads or writes the cache, and ``agree_on_solution``
calls it on rank 0 alone, so other ranks never touch the folder and all ranks
still receive rank 0's solution by broadcast.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_leaves

from torchtitan_autoparallel.planner.plan.agree import agree_on_solution, fingerprint
from torchtitan_autoparallel.planner.plan.api import SolveHook
from torchtitan_autoparallel.planner.plan.options import PlannerOptions
from torchtitan_autoparallel.planner.problem.build import BuiltProblem
from torchtitan_autoparallel.planner.solve.base import Solution

log = logging.getLogger("torchtitan_autoparallel.execute")

# Bump when the entry layout or the meaning of a stored field changes.
FORMAT_VERSION = 1
# A stored objective must match this run's recomputed one this closely (relative).
OBJECTIVE_RTOL = 1e-6
class CacheEntryError(ValueError):
    """A stored entry that must not be used; the message says why."""


def package_version() -> str:
    try:
        return metadata.version("torchtitan_autoparallel")
    except metadata.PackageNotFoundError:  # a source checkout that was never installed
        return "unknown"


def plan_settings(mesh: DeviceMesh, options: PlannerOptions, extra: Mapping[str, Any] | None = None) -> dict:
    """The cache-relevant settings of one ``plan_stages`` call, as JSON-ready values.

    ``extra`` (model config, knobs) is merged last, so the caller can add what
    the problem fingerprint cannot see.
    """
    settings: dict[str, Any] = {
        "mesh_dim_names": list(mesh.mesh_dim_names or ()),
        "mesh_shape": list(mesh.mesh.shape),
    }
    settings.update(options.cache_settings())
    settings.update(extra or {})
    return _jsonable(settings)


def cache_key(built: BuiltProblem, settings: Mapping[str, Any]) -> str:
    parts = {
        "format_version": FORMAT_VERSION,
        "problem": fingerprint(built).digest,
        "shapes": _shapes_digest(built),
        "settings": _jsonable(dict(settings)),
    }
    return hashlib.sha256(_canonical(parts).encode()).hexdigest()


def load_entry(path: Path, key: str, built: BuiltProblem) -> Solution:
    """The stored solution, validated against this run's problem; raises ``CacheEntryError``."""
    try:
        entry = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CacheEntryError(f"unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(entry, dict):
        raise CacheEntryError("not a JSON object")
    _check_versions(entry, key)
    solution = _solution_from(entry)
    _check_fits(solution, built)
    return solution


def store_entry(path: Path, key: str, solution: Solution, settings: Mapping[str, Any]) -> None:
    """Write atomically: a concurrent or interrupted start-up sees the old entry or the new, never half."""
    entry = {
        "format_version": FORMAT_VERSION,
        "package_version": package_version(),
        "key": key,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "settings": _jsonable(dict(settings)),  # for a reader wondering what this entry is
        "assignment": [int(s) for s in np.asarray(solution.assignment).ravel()],
        "objective": float(solution.objective),
        "lower_bound": float(solution.lower_bound),
        "solver": solution.solver,
        "status": solution.status,
        "seconds": float(solution.seconds),
        "memory_fit": {k: float(v) for k, v in solution.memory_fit.items()},
        "block_recompute": list(solution.block_recompute),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cached_solve(
    built: BuiltProblem, solve: Callable[[], Solution], cache_dir: Path, settings: Mapping[str, Any]
) -> Solution:
    """A valid stored solution for this key, else ``solve()`` (stored for next time)."""
    start = time.perf_counter()
    key = cache_key(built, settings)
    path = cache_dir / f"{key}.json"
    if path.exists():
        try:
            solution = load_entry(path, key, built)
        except CacheEntryError as e:
            log.warning("plan cache entry %s ignored: %s; planning again", path, e)
        else:
            log.info("plan cache hit: %s (solve skipped)", path)
            solution.seconds = time.perf_counter() - start  # what this start-up spent on the solve stage
            return solution
    else:
        log.info("plan cache miss: %s", path)
    solution = solve()
    try:
        store_entry(path, key, solution, settings)
    except OSError as e:  # the cache only saves time; failing to fill it must not stop training
        log.warning("plan cache entry %s not written: %s", path, e)
    return solution


def cached_solve_hook(cache_dir: str | Path | None, settings: Mapping[str, Any]) -> SolveHook:
    """``agree_on_solution`` whose rank-0 solve goes through the cache (no cache when ``cache_dir`` is None)."""
    if cache_dir is None:
        return agree_on_solution
    folder = Path(cache_dir)

    def hook(built: BuiltProblem, solve: Callable[[], Solution]) -> Solution:
        # agree_on_solution runs the closure on rank 0 only: one reader, one writer.
        return agree_on_solution(built, lambda: cached_solve(built, solve, folder, settings))

    return hook


def _check_versions(entry: dict, key: str) -> None:
    if entry.get("format_version") != FORMAT_VERSION:
        raise CacheEntryError(f"format_version {entry.get('format_version')!r}, expected {FORMAT_VERSION}")
    if entry.get("package_version") != package_version():
        raise CacheEntryError(f"written by version {entry.get('package_version')!r}, this is {package_version()!r}")
    if entry.get("key") != key:  # a file copied or renamed by hand
        raise CacheEntryError("stored key differs from its file name")


def _solution_from(entry: dict) -> Solution:
    try:
        assignment = np.asarray([int(s) for s in entry["assignment"]], dtype=np.int64)
        return Solution(
            assignment=assignment,
            objective=float(entry["objective"]),
            lower_bound=float(entry["lower_bound"]),
            solver=str(entry["solver"]),
            status=str(entry["status"]),
            seconds=float(entry["seconds"]),
            memory_fit={str(k): float(v) for k, v in entry.get("memory_fit", {}).items()},
            block_recompute=tuple(str(m) for m in entry.get("block_recompute", [])),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise CacheEntryError(f"malformed entry ({type(e).__name__}: {e})") from None


def _check_fits(solution: Solution, built: BuiltProblem) -> None:
    """The stored choice must still be a feasible, equally priced assignment of this problem."""
    problem = built.problem
    x = solution.assignment
    if len(x) != problem.num_nodes:
        raise CacheEntryError(f"assigns {len(x)} nodes, the problem has {problem.num_nodes}")
    if np.any(x < 0) or np.any(x >= problem.num_strategies):
        raise CacheEntryError("a strategy index is out of range")
    if not problem.is_feasible(x):
        raise CacheEntryError("the assignment is infeasible for this problem")
    energy = problem.energy(x)
    # Same key but other costs means the cost model changed: the stored optimum may no longer be one.
    if not math.isclose(energy, solution.objective, rel_tol=OBJECTIVE_RTOL, abs_tol=1e-9):
        raise CacheEntryError(
            f"objective {solution.objective:.6g} us stored, {energy:.6g} us with this run's tables"
        )


def _shapes_digest(built: BuiltProblem) -> str:
    """Shapes and dtypes of every problem node's values: the model config as the graph sees it."""
    rows = []
    for node in built.nodes:
        leaves = tree_leaves(node.meta.get("val"))
        rows.append([(tuple(t.shape), str(t.dtype)) for t in leaves if isinstance(t, torch.Tensor)])
    return hashlib.sha256(repr(rows).encode()).hexdigest()


def _jsonable(value: Any) -> Any:
    """Settings as plain JSON values, so the key is stable across processes."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "to_dict"):  # HardwareProfile: priced by its numbers, not its name
        return _jsonable(value.to_dict())
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)  # torch.dtype and the like


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))
