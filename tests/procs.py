"""A proxy as a real child process (``epd-proxy serve``) in front of a simulated cluster."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import sys

from helpers import Client

SRC = os.path.join(os.path.dirname(__file__), "..", "src")


def free_port() -> int:
    """A free port below the ephemeral range (SO_REUSEPORT would let --workers share a port
    bind(0) handed to someone else)."""
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(20_000, 32_000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


async def fresh_request(url: str, method: str, path: str, body: bytes = b"", headers=None):
    """One request on a new connection (with --workers, any worker may take it)."""
    client = Client(url)
    try:
        return await client.request(method, path, body, headers, timeout=10)
    finally:
        await client.close()


def _with_kv_events(inst) -> str:
    """An instance's address, with its KV event sockets when the simulator publishes them."""
    events = getattr(inst, "kv_events", None)
    if events is None:
        return inst.url
    return f"{inst.url};kv_events={events.endpoint};kv_events_replay={events.replay_endpoint}"


@contextlib.asynccontextmanager
async def child_proxy(cluster, *extra: str, stderr=asyncio.subprocess.DEVNULL):
    """Yields (process, url) once ``/health`` answers; the process group is killed after."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [SRC, os.environ.get("PYTHONPATH", "")] if p))
    args = ["--prefill", _with_kv_events(cluster.instances("prefill")[0]),
            "--decode", _with_kv_events(cluster.instances("decode")[0])]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "epd_proxy", "serve", "--port", str(port), "--probe-interval", "0",
        "--shutdown-grace", "0", *args, *extra, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=stderr,
        start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        loop = asyncio.get_running_loop()
        end = loop.time() + 20
        while True:
            try:
                if (await fresh_request(url, "GET", "/health")).status == 200:
                    break
            except Exception:
                pass
            assert proc.returncode is None and loop.time() < end, "the proxy did not start"
            await asyncio.sleep(0.05)
        yield proc, url
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
