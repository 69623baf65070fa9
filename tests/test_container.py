"""The Dockerfile builds an image that serves: podman builds it from this checkout and runs
it on a loopback port, once in front of the proxy's embedded simulated cluster and once as
the Kubernetes manifests run it (read-only root, --workers) in front of simulated vLLM
servers on the host; a chat request goes through each, and each stops cleanly on SIGTERM.

Marked ``container`` (not part of ``make test``: the build takes about a minute); run by
``e2e/container.sh`` (``make e2e``), which installs the tools and makes a base image from
Debian packages. Skipped with the reason when podman, runc or the base image is missing,
unless EPD_CONTAINER_REQUIRE=1 (the script), where that is a failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
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


def _wait_ready(url: str, alive, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if _get(url) == 200:
                return
        except OSError:
            pass
        problem = alive()
        if problem or time.monotonic() > deadline:
            raise AssertionError(f"{what} never became ready: {problem or 'timeout'}")
        time.sleep(0.2)


def _chat(base: str) -> dict:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
        answer = json.loads(r.read())
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"]["content"]
    assert answer["usage"]["completion_tokens"] == 4
    return answer


@contextlib.contextmanager
def _container(image: str, port: int, *args: str, options: tuple[str, ...] = ()):
    """The image started on the host's network with `args`, serving on 127.0.0.1:port; stopped
    with SIGTERM at the end, which the proxy must answer by exiting 0 within the stop timeout."""
    name = f"epd-proxy-test-{uuid.uuid4().hex[:8]}"
    _podman("run", "-d", "--name", name, *_runtime_options(), "--network", "host", *options,
            "-e", f"HEALTHCHECK_PORT={port}", image,
            "serve", "--host", "127.0.0.1", "--port", str(port), "--shutdown-grace", "0", *args)

    def exited() -> str | None:
        state = json.loads(_podman("inspect", name).stdout)[0]["State"]
        if state["Running"]:
            return None
        logs = _podman("logs", name, check=False)
        return f"the container exited ({state['ExitCode']}):\n{logs.stdout}{logs.stderr}"

    try:
        _wait_ready(f"http://127.0.0.1:{port}/ready", exited, "the container")
        yield name
        # The image's HEALTHCHECK (python's urllib against /health).
        assert _podman("healthcheck", "run", name, check=False).returncode == 0
        t0 = time.monotonic()
        _podman("stop", "-t", "20", name)
        assert time.monotonic() - t0 < 15
        state = json.loads(_podman("inspect", name).stdout)[0]["State"]
        assert state["ExitCode"] == 0, state
    finally:
        _podman("rm", "-f", "-t", "0", name, check=False)


def test_the_container_serves_a_chat_request_from_its_embedded_simulator(image):
    port = free_port()
    with _container(image, port, "--simulate", "prefill=1,decode=1"):
        _chat(f"http://127.0.0.1:{port}")


def _free_run(n: int) -> int:
    """The first of n consecutive free loopback ports."""
    for _ in range(50):
        first = free_port()
        socks = []
        try:
            for p in range(first, first + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def test_the_container_runs_read_only_with_workers_in_front_of_instances_on_the_host(image):
    # As the Kubernetes manifests run it: a read-only root file system (podman mounts a tmpfs on
    # /tmp, as the manifests' emptyDir), --workers (their channels live below /tmp), E/P/D
    # instances elsewhere: simulated vLLM servers in a process on the host.
    base_port = _free_run(3)
    sim = subprocess.Popen([sys.executable, "-m", "epd_proxy", "sim", "--encode", "1", "--prefill", "1",
                            "--decode", "1", "--host", "127.0.0.1", "--base-port", str(base_port)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        urls = [f"http://127.0.0.1:{base_port + i}" for i in range(3)]
        for url in urls:
            _wait_ready(url + "/health", lambda: None if sim.poll() is None else sim.stderr.read().decode(),
                        f"the simulator at {url}")
        port = free_port()
        with _container(image, port, "--encode", urls[0], "--prefill", urls[1], "--decode", urls[2],
                        "--kv-connector", "nixl", "--workers", "2", options=("--read-only",)):
            _chat(f"http://127.0.0.1:{port}")
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                metrics = r.read().decode()
            assert "epd_proxy_workers 2.0" in metrics
            assert 'epd_proxy_instance_requests_total{role="decode",url="%s"} 1.0' % urls[2] in metrics
    finally:
        sim.terminate()
        try:
            sim.wait(timeout=10)
        except subprocess.TimeoutExpired:
            sim.kill()
            sim.wait()
