"""vLLM's reference multi-turn P/D proxy (``disagg_proxy_multiturn.py``, vLLM 0.33) as a
benchmark target.

The file ships only in vLLM's source distribution on the package index
(``vllm-0.33.0.tar.gz``, ``examples/disaggregated/disaggregated_serving/``). ``pip
download`` cannot fetch that sdist without building its metadata (it needs torch), so
:func:`fetch` asks pip's own package finder, in a subprocess, for the sdist's link under
pip's configuration (index, certificates, proxies), downloads it with pip's session and
extracts that one file into a cache directory; the next run finds it there.

The proxy is a FastAPI app (fastapi, httpx, uvicorn: the ``bench`` extra). It routes P and D
round-robin, needs a ``conversation_id`` in every request body to link turns, and reads
decode's ``kv_transfer_params`` only from decode's stream chunks.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys

from epd_proxy.bench.procs import Service
from epd_proxy.bench.targets import TEXT_KINDS, SimInfo, Target, free_port

VLLM_VERSION = "0.33.0"
MEMBER = "examples/disaggregated/disaggregated_serving/disagg_proxy_multiturn.py"
FILE = "disagg_proxy_multiturn.py"
NEEDS = ("fastapi", "httpx", "uvicorn")

# Run by the interpreter with pip: find vllm's sdist, download it, extract MEMBER to argv[3].
_FETCH = r"""
import hashlib, os, sys, tarfile, tempfile
from pip._internal.commands import create_command
from pip._vendor.packaging.specifiers import SpecifierSet
version, member, dest = sys.argv[1:4]
cmd = create_command("download")
options, _ = cmd.parse_args(["--no-deps", "--no-binary", ":all:", "vllm==" + version])
with cmd.main_context():
    session = cmd.get_default_session(options)
    finder = cmd._build_package_finder(options=options, session=session)
    best = finder.find_best_candidate("vllm", specifier=SpecifierSet("==" + version)).best_candidate
    if best is None or not best.link.filename.endswith(".tar.gz"):
        sys.exit(f"no source distribution of vllm {version} on the configured index")
    link = best.link
    fd, tmp = tempfile.mkstemp(suffix=".tar.gz", dir=os.path.dirname(dest))
    sha = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            resp = session.get(link.url, stream=True, timeout=180)
            resp.raise_for_status()
            for chunk in resp.iter_content(1 << 20):
                sha.update(chunk)
                out.write(chunk)
        want = link.hashes.get("sha256") if getattr(link, "hashes", None) else None
        if want and want != sha.hexdigest():
            sys.exit(f"{link.filename}: sha256 {sha.hexdigest()} != the index's {want}")
        with tarfile.open(tmp) as tar:
            name = f"vllm-{version}/{member}"
            data = tar.extractfile(tar.getmember(name)).read()
    finally:
        os.unlink(tmp)
    with open(dest + ".part", "wb") as f:
        f.write(data)
    os.replace(dest + ".part", dest)
    print(link.url)
"""


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "epd-proxy-bench", f"vllm-{VLLM_VERSION}")


def fetch(path: str | None = None, *, timeout: float = 600.0) -> str:
    """The reference proxy's file: ``path`` when given, else the cached copy, else fetched from
    the package index into the cache. Raises ``RuntimeError`` saying why it cannot."""
    if path:
        if not os.path.isfile(path):
            raise RuntimeError(f"{path}: no such file")
        return path
    dest = os.path.join(cache_dir(), FILE)
    if os.path.isfile(dest):
        return dest
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    print(f"bench: fetching vLLM {VLLM_VERSION}'s {FILE} from the package index (its sdist, once)",
          file=sys.stderr, flush=True)
    try:
        proc = subprocess.run([sys.executable, "-c", _FETCH, VLLM_VERSION, MEMBER, dest], capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"fetching vllm {VLLM_VERSION}'s sdist took over {timeout:g} s") from None
    if proc.returncode != 0 or not os.path.isfile(dest):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"cannot fetch vllm {VLLM_VERSION}'s {FILE}: {' / '.join(tail)}")
    return dest


def digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def missing_modules() -> list[str]:
    return [m for m in NEEDS if importlib.util.find_spec(m) is None]


def reference_target(sim: SimInfo, *, cpus=None, log_dir: str, path: str | None = None,
                     name: str = "vllm-multiturn") -> Target:
    """The reference proxy in front of the simulator's prefills and decodes (no encoders), or
    an unavailable target that says why."""
    missing = missing_modules()
    if missing:
        return Target(name, "", None, TEXT_KINDS, available=False,
                      note=f"needs {', '.join(missing)} (pip install -e '.[bench]')")
    try:
        script = fetch(path)
    except RuntimeError as exc:
        return Target(name, "", None, TEXT_KINDS, available=False, note=str(exc))
    port = free_port()

    def hosts_ports(urls: list[str]) -> tuple[list[str], list[str]]:
        pairs = [u.split("://", 1)[1].rsplit(":", 1) for u in urls]
        return [h for h, _ in pairs], [p for _, p in pairs]

    ph, pp = hosts_ports(sim.prefill)
    dh, dp = hosts_ports(sim.decode)
    argv = [sys.executable, script, "--host", "127.0.0.1", "--port", str(port), "--prefiller-hosts", *ph,
            "--prefiller-ports", *pp, "--decoder-hosts", *dh, "--decoder-ports", *dp]
    url = f"http://127.0.0.1:{port}"
    svc = Service(name, argv, cpus=cpus, log_path=os.path.join(log_dir, f"{name}.log"), url=url)
    return Target(name, url, svc, TEXT_KINDS,
                  note=f"vLLM {VLLM_VERSION}'s {FILE} (sha256 {digest(script)[:12]}): round-robin P and D, "
                       "conversation_id from the client, decode's parameters from its stream")
