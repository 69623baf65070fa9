"""Every module path the docs, the READMEs and the package's comments and docstrings name
exists (``make lint`` runs this): a module renamed or moved leaves no reader looking for the
old name. And docs/architecture.md draws the layers in the order tests/test_layers.py enforces.

A name is ours when some file of the tree is it or ends with it (``usage/rewrite.py``,
``request/usage/rewrite.py`` and ``rewrite.py`` all name ``src/epd_proxy/request/usage/rewrite.py``).
vLLM's own files, which the docs cite as the reference for a behaviour, are told apart by
``VLLM_FOLDERS`` and ``VLLM_FILES``; a name in neither that exists nowhere fails here.
"""

import re
from pathlib import Path

from test_layers import LAYERS

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "epd_proxy"
TREE = ("src", "tests", "scripts", "e2e", "docs")

# A module path: folders (optional) and a file name ending in .py, not inside a longer path
# or URL (a URL's segments follow a slash).
NAME = re.compile(r"(?<![\w./<>-])((?:[\w.-]+/)*\w+\.py)\b")

# vLLM's source tree (and its sdist's), cited by path: the first folder of the path.
VLLM_FOLDERS = ("vllm/", "vllm-", "examples/", "tests/v1/", "entrypoints/", "distributed/", "v1/", "openai/",
                "anthropic/", "serve/", "pooling/", "scale_out/", "nixl/", "chat_completion/", "completion/",
                "responses/")
# vLLM's files (and Python's own, as py-spy names their frames), cited by their file name alone.
VLLM_FILES = {"disagg_epd_proxy.py", "disagg_proxy_multiturn.py", "pull_scheduler.py", "pull_worker.py",
              "base_worker.py", "runners.py", "base_events.py", "serve_command.py"}


def _documents() -> list[Path]:
    return [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", PACKAGE / "sim" / "README.md",
            *sorted(PACKAGE.rglob("*.py"))]


def _tree() -> set[str]:
    files = {p.name for p in ROOT.glob("*.py")}
    for top in TREE:
        files |= {str(p.relative_to(ROOT)) for p in (ROOT / top).rglob("*.py")}
    return files


def _exists(name: str, tree: set[str]) -> bool:
    if name in tree:
        return True
    tail = "/" + name
    return any(path.endswith(tail) for path in tree)


def _vllms(name: str) -> bool:
    return name.startswith(VLLM_FOLDERS) or name in VLLM_FILES


def missing_names(documents: list[Path], tree: set[str]) -> list[str]:
    """``file:line: name`` for each module path a document names that the tree does not hold."""
    out = []
    for doc in documents:
        shown = doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc.name
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for m in NAME.finditer(line):
                name = m.group(1)
                if not _vllms(name) and not _exists(name, tree):
                    out.append(f"{shown}:{n}: {name}")
    return out


def test_every_module_a_doc_or_comment_names_exists():
    assert missing_names(_documents(), _tree()) == []


def test_the_check_finds_an_old_name_and_passes_a_new_one(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("see `usage.py` and `turn_streams.py`, (hidden_usage.py), epd_proxy/pipeline.py;\n"
                   "not `request/usage/rewrite.py`, `turns/streams.py`, `pool.py`, vLLM's "
                   "`vllm/distributed/kv_events.py` or https://example.com/a/old.py\n")
    found = missing_names([doc], _tree())
    assert found == [f"doc.md:1: {n}" for n in ("usage.py", "turn_streams.py", "hidden_usage.py",
                                                 "epd_proxy/pipeline.py")]


def test_the_layer_drawing_is_the_enforced_order():
    """docs/architecture.md's drawing of the folders, top to bottom, is tests/test_layers.py's
    ``LAYERS`` from the top."""
    section = (ROOT / "docs" / "architecture.md").read_text().split("\n## Modules\n", 1)[1]
    drawing = section.split("```", 2)[1]
    drawn = [m.group(1).rstrip("/").removesuffix(".py")
             for m in re.finditer(r"^  ([a-z_]+/|[a-z_]+\.py)\s", drawing, re.M)]
    assert drawn == list(reversed(LAYERS))
