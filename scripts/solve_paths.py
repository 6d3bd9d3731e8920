"""Rewrite references to planner/solve/* (issue 73 item 3) to planner/solve/*.

    python scripts/solve_paths.py FILE...     # rewrites in place

Dotted module paths (``planner.solve.X``) and file paths (``solvers/X.py``) both;
longest names first so ``overlap_presolve`` is not read as ``overlap``. Not rewritten
(by hand): several names imported from the package in one statement, the compiled
loops of the local search and MRF (``tree_block``, ``neighbour_costs``, ``picked_sum``:
``solve.approx.kernels``), and the deleted ``LPSolver`` / ``get_solver("lp")``.
"""

import re
import sys

MODULES = {  # old module under planner.solve -> new module under planner.solve
    "overlap_presolve": "overlap.presolve",
    "overlap_dominance": "overlap.dominance",
    "overlap_lagrange": "overlap.lagrange",
    "overlap_model": "overlap.model",
    "overlap_terms": "overlap.terms",
    "overlap": "overlap.solver",
    "local_search": "approx.local_search",
    "brute_force": "brute_force",
    "ilp_model": "exact.model",
    "collapse": "presolve.collapse",
    "presolve": "presolve.pipeline",
    "rounding": "exact.rounding",
    "kernels": "presolve.kernels",  # the local search's and MRF's kernels: approx.kernels
    "reduce": "presolve.reduce",
    "fixing": "exact.fixing",
    "approx": "approx.solver",
    "trws": "approx.trws",
    "auto": "registry",
    "base": "base",
    "cbc": "exact.cbc",
    "ilp": "exact.ilp",
    "lp": "exact.lp_bound",
    "mrf": "approx.mrf",
}
NAMES = "|".join(sorted(MODULES, key=len, reverse=True))
DOTTED = re.compile(rf"planner\.solvers\.({NAMES})\b")
FILES = re.compile(rf"\bsolvers/({NAMES})\.py\b")


def rewrite(text: str) -> str:
    # SolverTimeout moved from the ILP module to the interface every solver shares
    text = text.replace("planner.solve.base import SolverTimeout", "planner.solve.base import SolverTimeout")
    # the overlap solver by name is composed where every other solver is
    text = text.replace("planner.solve.registry import overlap_solver", "planner.solve.registry import overlap_solver")
    # helpers that moved down so that presolve/ imports nothing above it
    for name, home in (("tie_components", "presolve.collapse"), ("group_components", "presolve.collapse"),
                       ("memory_message", "base")):
        text = text.replace(f"planner.solve.exact.model import {name}\n", f"planner.solve.{home} import {name}\n")
    # a module imported as a name of the package: the package is now solve, the module one level down
    for name, package in (("kernels", "presolve"), ("collapse", "presolve"), ("reduce", "presolve"),
                          ("local_search", "approx"), ("mrf", "approx"), ("trws", "approx")):
        text = text.replace(f"planner.solve import {name}\n", f"planner.solve.{package} import {name}\n")
    # the presolve function (``solve.presolve`` is now its package)
    text = text.replace("planner.solve import presolve\n", "planner.solve.presolve.pipeline import presolve\n")
    text = DOTTED.sub(lambda m: "planner.solve." + MODULES[m.group(1)], text)
    text = FILES.sub(lambda m: "solve/" + MODULES[m.group(1)].replace(".", "/") + ".py", text)
    text = re.sub(r"planner\.solvers\b", "planner.solve", text)
    return re.sub(r"planner/solve/", "planner/solve/", text)


for path in sys.argv[1:]:
    with open(path) as f:
        old = f.read()
    new = rewrite(old)
    if new != old:
        with open(path, "w") as f:
            f.write(new)
        print("rewrote", path)
