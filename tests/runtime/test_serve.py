"""Start-up of the proxy process: descriptor limit, connection cap, client limits."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import chat_body, stack
from procs import free_port

from epd_proxy.runtime.serve import connection_cap, server_limits

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_connection_cap_keeps_two_descriptors_per_client_for_upstreams():
    assert connection_cap(4096) == (4096 - 64) // 3
    assert connection_cap(1024) == 320
    assert connection_cap(100) == 16  # never below a usable minimum


def test_server_limits_follow_the_config():
    from epd_proxy.config import ProxyConfig

    limits = server_limits(ProxyConfig(max_body_size=1000, max_buffered_bytes=5000, max_connections=7,
                                       header_timeout=1.5, body_timeout=9))
    assert (limits.max_body_bytes, limits.max_buffered_bytes, limits.max_connections) == (1000, 5000, 7)
    assert (limits.header_timeout, limits.body_timeout) == (1.5, 9)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert server_limits(ProxyConfig()).max_connections == connection_cap(soft)


async def test_max_body_size_is_a_clear_413_through_the_proxy():
    async with stack(max_body_size=2000) as (cluster, proxy, client):
        reply = await client.chat(chat_body("x" * 3000))
        assert reply.status == 413
        assert "2000" in reply.json()["error"]["message"]
        assert cluster.records() == []
        assert (await client.chat(chat_body("hi"))).status == 200


def _spawn(args, soft: int, hard: int) -> subprocess.Popen:
    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = [*args, "--shutdown-grace", "0"]  # terminate() at the end: no load balancer to wait for
    return subprocess.Popen([sys.executable, "-m", "epd_proxy", "serve", *args], preexec_fn=limit, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, proc.stdout.read().decode(errors="replace")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError("proxy did not start")


def _soft_nofile(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError("no limit line")


def _post(port: int) -> bytes:
    body = b'{"model":"sim-model","max_tokens":2,"messages":[{"role":"user","content":"hi"}]}'
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        out = b""
        while True:
            data = s.recv(65536)
            if not data:
                return out
            out += data


@pytest.mark.skipif(not Path("/proc/self/limits").exists(), reason="needs /proc")
def test_start_up_raises_the_descriptor_limit_and_idle_clients_cannot_exhaust_it():
    """With a 256-descriptor hard limit, 300 idle client connections used to fill the
    table (new clients reset, upstream connects failing with EMFILE). Now the soft limit
    is raised to the hard one and the connection cap closes idle clients first."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 256:
        pytest.skip("hard descriptor limit below 256")
    port = free_port()
    proc = _spawn(["--port", str(port), "--simulate", "prefill=1,decode=1", "--log-level", "error"],
                  soft=128, hard=256)
    idle: list[socket.socket] = []
    try:
        _wait_listening(port, proc)
        assert _soft_nofile(proc.pid) == 256
        for _ in range(300):
            try:
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=2))
            except OSError:
                break
        for _ in range(5):
            reply = _post(port)
            assert reply.startswith(b"HTTP/1.1 200 "), reply[:200]
        assert proc.poll() is None
    finally:
        for s in idle:
            s.close()
        proc.terminate()
        proc.wait(10)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_memory_of_large_bodies_is_returned_after_they_are_answered():
    """Freed request bodies go back to the OS: glibc keeps freed read buffers in its
    heap, so concurrent large uploads used to leave the process larger for good (by
    0 to 108 MB after 20 x 30-60 MB bodies, depending on how the reads interleaved);
    now the heap is trimmed once large bodies are released."""
    import threading

    port = free_port()
    proc = _spawn(["--port", str(port), "--decode", f"http://127.0.0.1:{free_port()}", "--probe-interval", "0",
                   "--log-level", "error"], soft=1024, hard=resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    try:
        _wait_listening(port, proc)
        time.sleep(0.3)
        before = _rss_mb(proc.pid)
        body = b'{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"' + b"a" * (8 << 20) + b'"}]}'
        statuses = []

        def upload():
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(body) + body)
                statuses.append(s.recv(100)[:12])

        threads = [threading.Thread(target=upload) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(statuses) == 8
        deadline = time.monotonic() + 5
        while _rss_mb(proc.pid) > before + 8 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _rss_mb(proc.pid) <= before + 8, (before, _rss_mb(proc.pid))
    finally:
        proc.terminate()
        proc.wait(10)


async def test_front_door_metrics():
    import asyncio

    async with stack(header_timeout=0.2) as (cluster, proxy, client):
        host, port = proxy.server.host, proxy.server.port
        for data in (b"GARBAGE\r\n\r\n", b"GET /health HTTP/1.1\r\nHost: t\r\n"):  # 400, then 408
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(data)
            await asyncio.wait_for(reader.read(), 3)
            writer.close()
        text = (await client.request("GET", "/metrics")).body.decode()
    assert 'epd_proxy_client_rejections_total{status="400"} 1.0' in text
    assert 'epd_proxy_client_rejections_total{status="408"} 1.0' in text
    assert "epd_proxy_client_connections 1.0" in text  # the scrape's own
    assert "epd_proxy_client_connections_refused_total 0.0" in text
    assert "epd_proxy_buffered_body_bytes 0.0" in text
