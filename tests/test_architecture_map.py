"""docs/architecture.md's module map names exactly the package's modules: each top-level
module in a row of its own; a subpackage's modules in rows of their own (``sub/x.py``),
in the subpackage's row, or in the README table that row points to."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "epd_proxy"
DOC = ROOT / "docs" / "architecture.md"
SPECIAL = {"__init__.py", "__main__.py"}


def _module_rows() -> list[tuple[set[str], str]]:
    """(the names in the row's first cell, the rest of the row), for each row of the map."""
    section = DOC.read_text().split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if line.startswith("| `"):
            first, rest = line[1:].split("|", 1)
            rows.append((_names(first), rest))
    return rows


def _names(text: str) -> set[str]:
    return set(re.findall(r"`([^`]+)`", text))


def _subpackages() -> set[str]:
    return {p.name for p in PACKAGE.iterdir() if p.is_dir() and any(p.glob("*.py"))}


def test_every_top_level_module_and_subpackage_has_a_row():
    listed = {n for first, _ in _module_rows() for n in first if "/" not in n or n.endswith("/")}
    assert listed == {p.name for p in PACKAGE.glob("*.py")} | {s + "/" for s in _subpackages()}


def test_every_subpackage_module_is_named():
    """Nested folders too (``request/turns/``, ``bench/scenarios/cluster/``): a module is named
    by its path below the top-level subpackage, ``turns/reuse.py``; a nested ``__init__.py``
    is named when it holds more than its docstring."""
    rows = _module_rows()
    for sub in _subpackages():
        base = PACKAGE / sub
        modules = {str(p.relative_to(base)) for p in base.rglob("*.py")
                   if p.name not in SPECIAL or (p.parent != base and _has_code(p))}
        named = {n.split("/", 1)[1] for first, _ in rows for n in first
                 if n.startswith(sub + "/") and n.endswith(".py")}
        for first, rest in rows:
            if sub + "/" not in first:
                continue
            readme = re.search(r"\]\((\.\./src/epd_proxy/[^)]+README\.md)\)", rest)
            if readme:  # the row points to the subpackage's own table
                table = (DOC.parent / readme.group(1)).read_text()
                named |= {n for line in table.splitlines() if line.startswith("| `")
                          for n in _names(line[1:].split("|", 1)[0]) if n.endswith(".py")}
            else:
                named |= {n for n in _names(rest) if n.endswith(".py")}
        assert named - {n for n in named if n in SPECIAL} == modules, sub


def _has_code(path: Path) -> bool:
    """More than a docstring: a nested package whose ``__init__`` defines something."""
    import ast
    body = ast.parse(path.read_text()).body
    return any(not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)) for node in body)


def test_test_files_have_unique_names():
    """The test folders have no ``__init__.py``: two test files of one name cannot both be
    collected, so a folder mirroring the package must not repeat another's file name."""
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []
