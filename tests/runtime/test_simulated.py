"""``epd-proxy serve --workers N --simulate SPEC``: one simulated cluster, in a process of its
own started before the workers fork, every worker in front of it; it outlives the workers'
drain and leaves with them, whoever signalled the process group."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import msgspec
from helpers import chat_body
from procs import fresh_request
from proxy_process import ProxyProcess

SRC = str(Path(__file__).resolve().parents[2] / "src")


def listening(url: str) -> bool:
    u = urlsplit(url)
    try:
        with socket.create_connection((u.hostname, u.port), timeout=1):
            return True
    except OSError:
        return False


async def test_workers_share_one_simulated_cluster_which_leaves_with_them():
    async with ProxyProcess(["--workers", "2", "--simulate", "prefill=1,decode=2"]) as proxy:
        body = msgspec.json.encode(chat_body(max_tokens=4))
        for _ in range(8):  # new connections: the kernel spreads them over the workers
            r = await fresh_request(proxy.url, "POST", "/v1/chat/completions", body,
                                    [(b"content-type", b"application/json")])
            assert r.status == 200, r.body
        status = (await proxy.fresh_get("/status")).json()
        assert status["workers"] == 2
        pools = status["pools"]  # merged over the workers: one cluster, not one per worker
        urls = [i["url"] for role in ("prefill", "decode") for i in pools[role]]
        assert (len(pools["prefill"]), len(pools["decode"])) == (1, 2)
        assert sum(i["requests"] for i in pools["decode"]) == 8
        assert all(listening(u) for u in urls)
        assert proxy.proc is not None
        os.killpg(proxy.proc.pid, signal.SIGTERM)  # as a service manager stops the whole group
        assert await asyncio.wait_for(proxy.proc.wait(), 20) == 0, proxy.log()
    assert not any(listening(u) for u in urls)  # the simulator left with the workers


def test_a_simulate_spec_that_cannot_start_is_said_at_once():
    env = dict(os.environ, PYTHONPATH=SRC)
    proc = subprocess.run([sys.executable, "-m", "epd_proxy", "serve", "--port", "9", "--workers", "2",
                           "--simulate", "decode=1,bogus=3"], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2  # read before anything starts, as every other setting is
    assert "epd-proxy serve: error: --simulate 'decode=1,bogus=3': unknown topology spec key 'bogus'" \
        in proc.stderr and "Traceback" not in proc.stderr
