"""The package reads as its pipeline: each folder imports only the folders before it,
no module imports itself back through others, and no import hides inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "torchtitan_autoparallel"

# Pipeline order; a module may import its own layer and the layers above it in this list.
LAYERS = [
    "errors", "jit", "compat", "cpu_compat",
    "config", "mesh", "data", "models",
    "planner.trace", "planner.strategies", "planner.cost", "planner.problem",
    "planner.solve", "planner.solve", "planner.plan", "planner",
    "execute", "report", "train", "calibrate", "launch",
]


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def layer(module: str) -> int:
    best = max((l for l in LAYERS if module == l or module.startswith(l + ".")), key=len, default=LAYERS[0])
    return LAYERS.index(best)


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    return {id(n) for stmt in tree.body if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test)
            for n in ast.walk(stmt)}


def project_imports(module: str, path: Path):
    """(imported module, line, at module level?) for each import of the project's own modules."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    top = {id(s) for s in tree.body}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skip or not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1] if package else []
                base = ".".join([p for p in parts if p] + ([base] if base else []))
            elif base.startswith("torchtitan_autoparallel"):
                base = base.removeprefix("torchtitan_autoparallel").lstrip(".")
            else:
                continue
            names = [f"{base}.{a.name}".lstrip(".") if f"{base}.{a.name}".lstrip(".") in MODULES else base
                     for a in node.names]
        for name in names:
            name = name.removeprefix("torchtitan_autoparallel").lstrip(".")
            if name in MODULES and name != module:
                yield name, node.lineno, id(node) in top


def test_every_module_belongs_to_a_layer():
    assert all(layer(m) >= 0 for m in MODULES)


def test_each_folder_imports_only_the_folders_before_it():
    late = [f"{m}:{line} imports {t}" for m, p in MODULES.items() for t, line, _ in project_imports(m, p)
            if layer(t) > layer(m)]
    assert late == [], "\n".join(late)


def test_no_function_level_imports_of_the_project():
    hidden = [f"{m}:{line} imports {t}" for m, p in MODULES.items() for t, line, top in project_imports(m, p)
              if not top]
    assert hidden == [], "\n".join(hidden)


def test_no_module_import_cycles():
    graph = {m: {t for t, _, _ in project_imports(m, p) if not m.startswith(t + ".")} for m, p in MODULES.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(m, stack):
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == [], "\n".join(cycles)


def test_the_executor_takes_the_plan_not_the_planner_internals():
    """execute/ runs an ExecutablePlan: it never reaches into the problem tables or the solvers."""
    internals = ("planner.problem", "planner.solve", "planner.solve")
    reached = [f"{m}:{line} imports {t}" for m, p in MODULES.items() if m.startswith("execute")
               for t, line, _ in project_imports(m, p) if t.startswith(internals)]
    assert reached == [], "\n".join(reached)
