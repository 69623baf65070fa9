"""The Dockerfile builds an image that serves: podman builds it from this checkout, runs it
on a loopback port in front of the proxy's embedded simulated cluster, and a chat request
goes through it.

Marked ``container`` (not part of ``make test``: the build takes about a minute); run by
``e2e/container.sh`` (``make e2e``), which installs the tools and makes a base image from
Debian packages. Skipped with the reason when podman, runc or the base image is missing,
unless EPD_CONTAINER_REQUIRE=1 (the script), where that is a failure.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from procs import free_port

pytestmark = pytest.mark.container

REPO = Path(__file__).resolve().parents[1]
BASE = os.environ.get("EPD_CONTAINER_BASE", "localhost/epd-base:bookworm")
REQUIRE = os.environ.get("EPD_CONTAINER_REQUIRE") == "1"
BUILD_TIMEOUT = float(os.environ.get("EPD_CONTAINER_BUILD_TIMEOUT", "900"))


def _runtime_options() -> list[str]:
    """runc, and resource limits the container may have: podman's defaults (1048576 open
    files; the process limit of podman itself) are above what an unprivileged sandbox's
    hard limits allow, and raising a hard limit needs CAP_SYS_RESOURCE."""
    nofile = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 65536)
    return ["--runtime", "runc", "--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", "nproc=4096:4096"]


def _podman(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {out.returncode}:\n{out.stdout}\n{out.stderr}")
    return out


def _unavailable() -> str | None:
    for tool in ("podman", "runc"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (scripts/ensure-container-tools.sh installs it when root)"
    if _podman("image", "exists", BASE, check=False).returncode != 0:
        return f"no base image {BASE} (e2e/container.sh makes one from Debian packages)"
    return None


@pytest.fixture(scope="module")
def image():
    reason = _unavailable()
    if reason:
        if REQUIRE:
            pytest.fail(reason)
        pytest.skip(reason)
    tag = f"localhost/epd-proxy:test-{uuid.uuid4().hex[:8]}"
    t0 = time.monotonic()
    # --layers=false: no intermediate images are kept (the builder stage with its compiler).
    _podman("build", *_runtime_options(), "--network", "host", "--format", "docker", "--layers=false",
            "--build-arg", f"BASE={BASE}", "-t", tag, str(REPO), timeout=BUILD_TIMEOUT)
    print(f"\nbuilt {tag} from {BASE} in {time.monotonic() - t0:.1f}s")
    try:
        yield tag
    finally:
        _podman("rmi", "-f", tag, check=False)


def test_the_image_runs_the_proxy_as_a_non_root_user_without_build_tools(image):
    inspected = json.loads(_podman("image", "inspect", image).stdout)[0]
    config = inspected["Config"]
    assert config["Entrypoint"] == ["epd-proxy"]
    assert config["Cmd"] == ["serve", "--host", "0.0.0.0", "--port", "8000"]
    assert config["User"] == "10001:10001"
    assert "8000/tcp" in config["ExposedPorts"]
    assert "/health" in " ".join(inspected["Healthcheck"]["Test"])
    probe = ("import shutil, importlib.util, os; "
             "print(os.getuid(), [t for t in ('gcc', 'cc', 'make', 'pip', 'curl') if shutil.which(t)], "
             "importlib.util.find_spec('pip') is not None, importlib.util.find_spec('uvloop') is not None)")
    out = _podman("run", "--rm", *_runtime_options(), "--network", "none", "--entrypoint", "python3", image,
                  "-c", probe).stdout.strip()
    assert out == "10001 [] False True"


def _get(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_container_serves_a_chat_request(image):
    port = free_port()
    name = f"epd-proxy-test-{uuid.uuid4().hex[:8]}"
    base = f"http://127.0.0.1:{port}"
    _podman("run", "-d", "--name", name, *_runtime_options(), "--network", "host",
            "-e", f"HEALTHCHECK_PORT={port}", image,
            "serve", "--host", "127.0.0.1", "--port", str(port), "--simulate", "prefill=1,decode=1",
            "--shutdown-grace", "0")
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if _get(base + "/ready") == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                logs = _podman("logs", name, check=False)
                raise AssertionError(f"the container never became ready:\n{logs.stdout}{logs.stderr}")
            time.sleep(0.2)
        body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200
            answer = json.loads(r.read())
        assert answer["object"] == "chat.completion"
        assert answer["choices"][0]["message"]["content"]
        assert answer["usage"]["completion_tokens"] == 4
        # The image's HEALTHCHECK (python's urllib against /health).
        assert _podman("healthcheck", "run", name, check=False).returncode == 0
        # SIGTERM: the proxy ends itself well within the stop timeout.
        t0 = time.monotonic()
        _podman("stop", "-t", "20", name)
        assert time.monotonic() - t0 < 15
        state = json.loads(_podman("inspect", name).stdout)[0]["State"]
        assert state["ExitCode"] == 0, state
    finally:
        _podman("rm", "-f", "-t", "0", name, check=False)
