"""The proxy process as a user meets it: client keys reloaded on SIGHUP, TLS, --version,
a port already in use, an IPv6 listener's URL (real child processes and sockets)."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import chat_body, stack

from epd_proxy.config import ProxyConfig
from epd_proxy.runtime.serve import listen_url, start_proxy

SRC = str(Path(__file__).resolve().parents[2] / "src")
ENV = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "epd_proxy", "serve", "--shutdown-grace", "0", *args],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _post(port: int, key: str | None) -> int:
    """POST a chat request with ``key`` as the Bearer token; the status."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(chat_body()), headers)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, proc.stderr.read().decode(errors="replace")
        try:
            if predicate():
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_key_file_is_read_again_on_sighup(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("key-before\n")
    port = _free_port()
    proc = _serve("--simulate", "prefill=1,decode=1", "--port", str(port), "--api-key-file", str(keys),
                  "--api-key", "flag-key", "--admin-api-key", "adm")
    try:
        _wait_for(lambda: _post(port, "key-before") == 200, proc)
        assert _post(port, "key-after") == 401
        assert _post(port, None) == 401
        keys.write_text("# rotated\nkey-after\n")
        os.kill(proc.pid, signal.SIGHUP)
        _wait_for(lambda: _post(port, "key-after") == 200, proc)
        assert _post(port, "key-before") == 401
        assert _post(port, "flag-key") == 200  # the flag's keys stay
        keys.unlink()  # an unreadable file keeps the keys in force
        os.kill(proc.pid, signal.SIGHUP)
        _wait_for(lambda: b"cannot read it" in _peek_stderr(proc), proc)
        assert _post(port, "key-after") == 200
        assert b'epd_proxy_reloads_total{result="failed"} 1.0' in _get(port, "/metrics", {"X-API-Key": "adm"})
    finally:
        _stop(proc)


def test_sighup_reaches_every_worker(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("key-before\n")
    port = _free_port()
    # Two workers behind one port (SO_REUSEPORT); instances that are never called: a 401
    # is answered before any routing, and /health is the proxy's own.
    proc = _serve("--decode", "http://127.0.0.1:9", "--probe-interval", "0", "--port", str(port),
                  "--workers", "2", "--api-key-file", str(keys))
    try:
        _wait_for(lambda: _post(port, "nobody") == 401, proc)
        keys.write_text("key-after\n")
        os.kill(proc.pid, signal.SIGHUP)
        # Each new connection reaches either worker: once both have reloaded, the old key
        # is refused on every one of them.
        _wait_for(lambda: all(_post(port, "key-before") == 401 for _ in range(8)), proc)
        _wait_for(lambda: all(_post(port, "key-after") != 401 for _ in range(8)), proc)  # 502: no instance
    finally:
        _stop(proc)


def _get(port: int, path: str, headers: dict | None = None) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        return conn.getresponse().read()
    finally:
        conn.close()


_stderr_seen = b""


def _peek_stderr(proc: subprocess.Popen) -> bytes:
    """What the child has logged so far (non-blocking)."""
    global _stderr_seen
    os.set_blocking(proc.stderr.fileno(), False)
    chunk = proc.stderr.read() or b""
    _stderr_seen += chunk
    return _stderr_seen


def test_version():
    out = subprocess.run([sys.executable, "-m", "epd_proxy", "--version"], env=ENV, capture_output=True,
                         timeout=30)
    from epd_proxy import __version__

    assert out.returncode == 0
    assert out.stdout.decode().strip() == f"epd-proxy {__version__}"


def test_a_port_in_use_is_one_clear_line_and_a_failed_exit():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _serve("--simulate", "prefill=1,decode=1", "--port", str(port))
        try:
            out, err = proc.communicate(timeout=30)
        finally:
            _stop(proc)
    assert proc.returncode != 0
    text = err.decode()
    assert "Traceback" not in text and "Traceback" not in out.decode()
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines == [f"epd-proxy: cannot listen on http://127.0.0.1:{port}: address already in use "
                     f"(another process listens there; choose another --port)"], text


def test_listen_url_brackets_ipv6():
    assert listen_url("::", 8000) == "http://[::]:8000"
    assert listen_url("::1", 8443, tls=True) == "https://[::1]:8443"
    assert listen_url("0.0.0.0", 8000) == "http://0.0.0.0:8000"


def _has_ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6(), reason="no IPv6 loopback on this machine")
async def test_an_ipv6_listener_announces_a_url_that_works():
    async with stack() as (cluster, _proxy, _client):
        config = ProxyConfig(decode=_proxy.app.config.decode, prefill=_proxy.app.config.prefill,
                             probe_interval=0)
        async with await start_proxy(config, host="::1") as proxy:
            assert proxy.url == f"http://[::1]:{proxy.server.port}"
            from helpers import Client

            client = Client(proxy.url)
            try:
                assert (await client.request("GET", "/health")).status == 200
            finally:
                await client.close()


def _certificate(tmp_path: Path) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1, made by the openssl command."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed: cannot make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext",
                    "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
    return str(cert), str(key)


def _https(port: int, cafile: str, method: str, path: str, body: bytes | None = None,
           headers: dict | None = None) -> tuple[int, bytes]:
    ctx = ssl.create_default_context(cafile=cafile)  # verifies the chain and the address
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=10)
    try:
        conn.request(method, path, body, headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


async def test_tls_serves_with_a_generated_certificate(tmp_path):
    cert, key = _certificate(tmp_path)
    async with stack(ssl_certfile=cert, ssl_keyfile=key, api_keys=("k",)) as (cluster, proxy, _):
        assert proxy.url.startswith("https://127.0.0.1:")
        port = proxy.server.port
        status, body = await asyncio.to_thread(_https, port, cert, "GET", "/health")
        assert (status, body) == (200, b'{"status":"ok"}')
        for stream in (False, True):
            status, body = await asyncio.to_thread(
                _https, port, cert, "POST", "/v1/chat/completions", json.dumps(chat_body(stream=stream)).encode(),
                {"Content-Type": "application/json", "Authorization": "Bearer k"})
            assert status == 200, body
            assert body.endswith(b"data: [DONE]\n\n") if stream else b'"choices"' in body
        # Plain HTTP on the TLS port gets no answer in HTTP.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        data = await asyncio.wait_for(reader.read(100), 5)
        assert not data.startswith(b"HTTP/1.1 200")
        writer.close()


def test_a_bad_certificate_is_refused_at_start(tmp_path):
    bad = tmp_path / "cert.pem"
    bad.write_text("not a certificate\n")
    out = subprocess.run([sys.executable, "-m", "epd_proxy", "serve", "--decode", "http://127.0.0.1:9",
                          "--ssl-certfile", str(bad)], env=ENV, capture_output=True, timeout=30)
    assert out.returncode == 2
    assert b"--ssl-certfile" in out.stderr and b"Traceback" not in out.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_run_honours_port_and_sim(tmp_path):
    repo = Path(__file__).resolve().parents[2]
    # -n: print the commands only; VENV points at an empty directory, so nothing is installed.
    out = subprocess.run(["make", "-n", "-C", str(repo), "run", "PORT=9123", "SIM=prefill=1,decode=1",
                          f"VENV={tmp_path}/venv"], capture_output=True, timeout=30, text=True)
    assert out.returncode == 0, out.stderr
    assert f"{tmp_path}/venv/bin/python -m epd_proxy serve --port 9123 --simulate 'prefill=1,decode=1'" \
        in out.stdout


def test_a_port_in_use_with_workers_is_one_line_too():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _serve("--decode", "http://127.0.0.1:9", "--probe-interval", "0", "--port", str(port),
                      "--workers", "2")
        try:
            _, err = proc.communicate(timeout=30)
        finally:
            _stop(proc)
    assert proc.returncode != 0
    text = err.decode()
    assert "Traceback" not in text
    assert text.count(f"epd-proxy: cannot listen on http://127.0.0.1:{port}: address already in use") == 1, text


def test_the_start_up_lines_say_where_the_console_is():
    """What `make run` prints: the console's address, the page there."""
    port = _free_port()
    proc = _serve("--simulate", "prefill=1,decode=1", "--port", str(port))
    try:
        lines = []
        while not any("console:" in line for line in lines):
            line = proc.stdout.readline().decode()
            assert line, "the proxy ended before announcing itself"
            lines.append(line)
        [console] = [line for line in lines if "console:" in line]
        assert f"http://127.0.0.1:{port}/console" in console
        page = _get(port, "/console", {})
        assert b"<title>epd-proxy console</title>" in page
    finally:
        _stop(proc)


def _make_run_sim() -> str:
    """The Makefile's default `make run` cluster (SIM ?= ...)."""
    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    return re.search(r"^SIM \?= (\S+)$", makefile, re.M).group(1)


def _chat(port: int, messages: list) -> tuple[str, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.request("POST", "/v1/chat/completions",
                     json.dumps({"model": "sim-model", "max_tokens": 32, "messages": messages}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        doc = json.loads(resp.read())
        return resp.getheader("Server-Timing"), doc["choices"][0]["message"]["content"]
    finally:
        conn.close()


def test_make_runs_cluster_shows_a_reused_turn_in_the_console():
    """`make run`'s simulated cluster, driven as the README's two turns: the second reuses the KV
    decode kept of the first, and the console's reuse numbers count it (not "none yet")."""
    port = _free_port()
    proc = _serve("--simulate", _make_run_sim(), "--port", str(port), "--probe-interval", "0")
    try:
        while b"console:" not in proc.stdout.readline():
            assert proc.poll() is None, proc.stderr.read().decode()
        _get(port, "/console/api/state")  # a console looks: the ring of recent requests fills
        first = [{"role": "user", "content": "Tell me about disaggregated serving. " * 20}]
        _, answer = _chat(port, first)
        timing, _ = _chat(port, first + [{"role": "assistant", "content": answer},
                                         {"role": "user", "content": "And then?"}])
        assert re.search(r'kv;desc="(reused|local_prefill)"', timing), timing
        state = json.loads(_get(port, "/console/api/state"))
        assert state["traffic"]["models"]["*"]["reused_turns"] == 1, state["traffic"]
    finally:
        _stop(proc)
