"""Rewrite references to planner/solvers/* (issue 73 item 3) to planner/solve/*.

    python scripts/solve_paths.py FILE...     # rewrites in place

Dotted module paths (``planner.solvers.X``) and file paths (``solvers/X.py``) both;
longest names first so ``overlap_presolve`` is not read as ``overlap``.
"""

import re
import sys

MODULES = {  # old module under planner.solvers -> new module under planner.solve
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
    text = text.replace("planner.solvers.ilp import SolverTimeout", "planner.solve.base import SolverTimeout")
    # the overlap solver by name is composed where every other solver is
    text = text.replace("planner.solvers.overlap import overlap_solver", "planner.solve.registry import overlap_solver")
    text = DOTTED.sub(lambda m: "planner.solve." + MODULES[m.group(1)], text)
    text = FILES.sub(lambda m: "solve/" + MODULES[m.group(1)].replace(".", "/") + ".py", text)
    text = re.sub(r"planner\.solvers\b", "planner.solve", text)
    return re.sub(r"planner/solvers/", "planner/solve/", text)


for path in sys.argv[1:]:
    with open(path) as f:
        old = f.read()
    new = rewrite(old)
    if new != old:
        with open(path, "w") as f:
            f.write(new)
        print("rewrote", path)
