"""The package's folders are layers: each imports only from the layers below it, and no module
imports another in a cycle. Every import counts, including those inside functions and under
``TYPE_CHECKING``: a lazy import is an edge all the same. ``make lint`` runs this file."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "epd_proxy"

# Bottom to top: a layer may import the layers before it in this list, never after.
LAYERS = ("http", "wire", "config", "observe", "state", "encode", "routing", "kvcache", "instances", "tenants",
          "placement", "request", "api", "gateway", "runtime", "cli")
# Beside the stack: what each may import. The simulator stands in for vLLM and shares only the
# transport; the benchmark drives the whole proxy; ``runtime`` may start the simulator
# (``--simulate``) and ``cli`` runs both as commands.
BESIDE = {"sim": {"http"}, "bench": set(LAYERS[:-1]) | {"sim"}}
EXTRA = {"runtime": {"sim"}, "cli": {"sim", "bench", "epd_proxy"}}
# The package's own ``__init__`` (the public API) and ``__main__``.
ROOT = {"epd_proxy": {"config", "runtime"}, "epd_proxy.__main__": {"cli"}}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(importer: str, node: ast.ImportFrom | ast.Import) -> set[str]:
    """The package modules an import statement loads (a ``from pkg import name`` loads the
    submodule ``pkg.name`` when there is one)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name.split(".")[0] == "epd_proxy"} & set(MODULES)
    if node.level:  # relative imports are not used (ruff TID252), but resolve them anyway
        base = importer.split(".")
        is_pkg = MODULES[importer].name == "__init__.py"
        base = base[: len(base) - node.level + (1 if is_pkg else 0)]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    if module.split(".")[0] != "epd_proxy":
        return set()
    found = set()
    for alias in node.names:
        sub = f"{module}.{alias.name}"
        found.add(sub if sub in MODULES else module)
    return found & set(MODULES)


def _graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps |= _resolve(name, node)
        graph[name] = deps - {name}
    return graph


def _unit(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or module == "epd_proxy.__main__":
        return module
    return parts[1]


def _allowed(unit: str) -> set[str]:
    if unit in ROOT:
        return ROOT[unit]
    if unit in BESIDE:
        return BESIDE[unit]
    return set(LAYERS[: LAYERS.index(unit)]) | EXTRA.get(unit, set())


def test_every_folder_is_a_layer():
    units = {_unit(m) for m in MODULES}
    assert units == set(LAYERS) | set(BESIDE) | set(ROOT), "a new folder needs its place in LAYERS or BESIDE"


def test_no_module_imports_a_layer_above_its_own():
    wrong = []
    for module, deps in _graph().items():
        unit = _unit(module)
        for dep in deps:
            target = _unit(dep)
            if target != unit and target not in _allowed(unit):
                wrong.append(f"{module} -> {dep}")
    assert not wrong, "upward or sideways imports:\n" + "\n".join(sorted(wrong))


def test_no_import_cycle():
    graph = _graph()
    # A package's __init__ and its own submodules are one unit of loading: an __init__ that
    # re-exports a submodule is not a cycle with it, but any other loop is.
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for dep in sorted(graph[module]):
            if module.startswith(dep + ".") and MODULES[dep].name == "__init__.py":
                continue  # a submodule importing its own package's __init__ names
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
