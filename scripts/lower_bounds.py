"""The declared lower bounds, tested: install every runtime dependency at exactly its lower bound.

pyproject.toml says ``msgspec>=0.19``, ``redis[hiredis]>=5.0`` and so on; a bound nobody runs
drifts into a lie as the code starts to use newer APIs. This builds a virtualenv (``.venv-lower``
unless ``VENV`` says otherwise) where each runtime dependency, the core's and the ``gateway``
extra's, is pinned to its bound (``>=X`` becomes ``==X``), installs the project with its test
tools at their usual versions (only the proxy's own dependencies are what an operator's image
pins), and runs the tests given on the command line (default: the suites that exercise each of
those dependencies: the wire formats, HTTP, metrics, DNS membership, the Redis store, the ZMQ
event feed, the media hash and the gateway's gRPC picker).

    python scripts/lower_bounds.py [pytest args...]
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import tomllib
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TESTS = ["tests/wire", "tests/http", "tests/observe", "tests/instances/test_discovery.py",
                 "tests/state", "tests/kvcache", "tests/encode", "tests/gateway/test_ext_proc.py",
                 "tests/tenants/test_redis_counters.py", "tests/request/test_pipeline.py",
                 "tests/request/test_apis.py", "tests/cli/test_serve_command.py"]


def pins(project: dict) -> list[str]:
    """``name==bound`` (markers kept) for every runtime requirement with a ``>=`` bound."""
    reqs = list(project["dependencies"]) + list(project["optional-dependencies"]["gateway"])
    out = []
    for req in reqs:
        spec, _, marker = req.partition(";")
        m = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*>=\s*([^,\s]+)\s*", spec)
        if m is None:
            raise SystemExit(f"lower_bounds: no single >= bound in {req!r}")
        pin = f"{m.group(1)}=={m.group(3)}"
        out.append(f"{pin};{marker}" if marker.strip() else pin)
    return out


def _release(version: str) -> tuple[int, ...]:
    """``0.19`` and ``0.19.0`` alike (PEP 440 pads a release with zeros)."""
    parts = [int(p) for p in version.split(".")]
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def main(argv: list[str]) -> int:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    constraints = pins(project)
    env_dir = Path(os.environ.get("VENV", ROOT / ".venv-lower"))
    py = env_dir / "bin" / "python"
    if not py.exists():
        venv.create(env_dir, with_pip=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(constraints) + "\n")
    pip = [str(py), "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["-U", "pip"], check=True)
    subprocess.run(pip + ["-c", f.name, "-e", f"{ROOT}[test,gateway]"], check=True)
    # The installed versions must be the bounds themselves (a constraint the resolver could not
    # meet fails the install above; this proves nothing newer slipped in).
    frozen = subprocess.run([str(py), "-m", "pip", "freeze"], check=True, capture_output=True, text=True).stdout
    have = {line.split("==")[0].lower().replace("_", "-"): line.split("==")[1]
            for line in frozen.splitlines() if "==" in line}
    wrong = []
    for pin in constraints:
        name, version = pin.split(";")[0].split("==")
        got = have.get(name.lower().replace("_", "-"))
        if ";" not in pin and (got is None or _release(got) != _release(version)):
            wrong.append(f"{name}: {got} installed, {version} wanted")
    if wrong:
        print("lower_bounds: " + "; ".join(wrong), file=sys.stderr)
        return 1
    print("lower_bounds: " + ", ".join(p.split(";")[0] for p in constraints), flush=True)
    tests = argv or DEFAULT_TESTS
    return subprocess.run([str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
