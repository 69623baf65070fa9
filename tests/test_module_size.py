"""No module of the package is over 700 lines: past that, a module holds more than one concept
and is split along one (docs/architecture.md, "Code shape")."""

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "epd_proxy"
LIMIT = 700


def test_no_module_is_over_700_lines():
    over = {str(path.relative_to(PACKAGE)): n for path in PACKAGE.rglob("*.py")
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > LIMIT}
    assert over == {}, f"modules over {LIMIT} lines: {over}"
