"""The encode path's modules depend on each other in one direction only."""

import ast
from pathlib import Path

import epd_proxy.encode

PACKAGE = Path(epd_proxy.encode.__file__).parent


def _imports(path: Path) -> set[str]:
    """The encode modules a module imports, ``TYPE_CHECKING`` imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 1:
                names = [module] if module else [a.name for a in node.names]
            elif node.level == 0 and module.startswith("epd_proxy.encode."):
                names = [module.rsplit(".", 1)[1]]
            else:
                continue
            found.update(n for n in names if (PACKAGE / f"{n}.py").exists())
    return found


def test_the_encode_modules_import_each_other_without_a_cycle():
    graph = {p.stem: _imports(p) for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert graph["multimodal"] == set()  # discovery needs nothing downstream of it
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import cycle: {' -> '.join(path + (module,))}"
        if module not in done:
            for dep in graph[module]:
                visit(dep, path + (module,))
            done.add(module)

    for module in graph:
        visit(module, ())
