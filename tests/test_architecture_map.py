"""docs/architecture.md's module map names exactly the package's modules (and each
subpackage's, in its row or in the README its row points to)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "epd_proxy"
DOC = ROOT / "docs" / "architecture.md"


def _module_rows() -> list[tuple[str, str]]:
    text = DOC.read_text()
    section = text.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if line.startswith("| `"):
            first, rest = line[1:].split("|", 1)
            rows.append((first.strip(), rest))
    return rows


def _names(cell: str) -> set[str]:
    return set(re.findall(r"`([^`]+)`", cell))


def _modules(directory: Path) -> set[str]:
    return {p.name for p in directory.glob("*.py")}


def test_every_top_level_module_has_a_row_and_every_row_a_module():
    listed = set().union(*(_names(first) for first, _ in _module_rows()))
    modules = _modules(PACKAGE)
    subpackages = {p.name + "/" for p in PACKAGE.iterdir() if p.is_dir() and any(p.glob("*.py"))}
    assert listed == modules | subpackages


def test_every_subpackage_row_names_its_modules():
    for first, rest in _module_rows():
        if not first.endswith("/`"):
            continue
        sub = first.strip("`").rstrip("/")
        modules = _modules(PACKAGE / sub) - {"__init__.py", "__main__.py"}
        readme = re.search(r"\]\((\.\./src/epd_proxy/[^)]+README\.md)\)", rest)
        if readme:  # the row points to the subpackage's own table
            table = (DOC.parent / readme.group(1)).read_text()
            named = {m for line in table.splitlines() if line.startswith("| `")
                     for m in _names(line[1:].split("|", 1)[0]) if m.endswith(".py")}
        else:
            named = {n for n in _names(rest) if n.endswith(".py")}
        assert named == modules, sub
