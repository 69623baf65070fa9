"""A decode SIGKILLed under 64 concurrent long streams, on the simulator (docs/benchmarks.md,
"Stream migration: a decode killed under 64 streams").

    PYTHONPATH=src python scripts/migration_under_kill.py [--streams 64] [--tokens 256]

A prefill and two decodes, each an ``epd-proxy sim`` process of its own (``--itl-ms 15``), and
the proxy in this process (round-robin: half the streams on each decode). When every stream is
under way, the decode serving the first is SIGKILLed, and a second wave of streams starts just
after the kill. Reported: the streams that failed (an error event, a missing terminator, a wrong
token count, more than one id), the moves, and time to first token and inter-token gaps (p50,
p99, max) before the kill, across it (the gap holding the kill on a moved stream), after it, and
the second wave's time to first token. Bounded: about 15 s, and at most 120 s. Figures on a
shared machine move with its load: compare within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

import msgspec

from epd_proxy.config import InstanceSpec, ProxyConfig
from epd_proxy.runtime.build import start_proxy

SRC = str(Path(__file__).resolve().parent.parent / "src")
ITL_MS = 15


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def health(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
    except OSError:
        return False
    try:
        writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        return (await reader.readline()).startswith(b"HTTP/1.1 200")
    finally:
        writer.close()


@contextlib.asynccontextmanager
async def sim_process(role: str):
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [SRC, os.environ.get("PYTHONPATH", "")] if p))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "epd_proxy", "sim", f"--{role}", "1", "--base-port", str(port),
        "--itl-ms", str(ITL_MS), "--ttft-ms", "1", "--no-records", env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 30
        while not await health(url):
            if proc.returncode is not None or time.monotonic() > end:
                raise SystemExit(f"the {role} simulator did not start")
            await asyncio.sleep(0.05)
        yield proc, url
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


async def stream(url: str, i: int, tokens: int) -> tuple[float, list, list[float]]:
    """One chat stream: when it was sent, its events (the terminator as the string), when each came."""
    body = {"model": "sim-model", "messages": [{"role": "user", "content": f"stream {i}: tell me a long story"}],
            "max_tokens": tokens, "stream": True, "stream_options": {"include_usage": True}}
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    raw = msgspec.json.encode(body)
    sent = time.monotonic()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\nconnection: close\r\n\r\n%b" % (len(raw), raw))
    events: list = []
    times: list[float] = []
    buf = b""
    try:
        await reader.readuntil(b"\r\n\r\n")
        while True:
            line = await reader.readline()
            if not line or not line.strip():
                break
            size = int(line.strip(), 16)
            if size == 0:
                break
            buf += (await reader.readexactly(size + 2))[:-2]
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                data = event[len(b"data: "):]
                events.append("[DONE]" if data == b"[DONE]" else msgspec.json.decode(data))
                times.append(time.monotonic())
    finally:
        writer.close()
    return sent, events, times


def failed(events: list, tokens: int) -> str | None:
    """Why a stream is not one whole answer (None: it is)."""
    if not events or events[-1] != "[DONE]" or events.count("[DONE]") != 1:
        return "no terminator"
    data = events[:-1]
    if [e for e in data if "error" in e]:
        return "error event"
    if len({e["id"] for e in data}) != 1:
        return "ids"
    texts = [c["delta"].get("content") for e in data for c in e["choices"]]
    if len([t for t in texts if t]) != tokens or data[-1].get("usage", {}).get("completion_tokens") != tokens:
        return "token count"
    return None


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000 if values else float("nan")


def line(name: str, values: list[float]) -> str:
    return (f"{name:<34} n={len(values):>6}  p50 {pct(values, 0.5):7.1f} ms  p99 {pct(values, 0.99):7.1f} ms  "
            f"max {max(values) * 1000 if values else float('nan'):7.1f} ms")


async def run(streams: int, tokens: int) -> int:
    async with sim_process("prefill") as (_, p_url), sim_process("decode") as (d0, d0_url), \
            sim_process("decode") as (d1, d1_url):
        decodes = {d0_url: d0, d1_url: d1}
        config = ProxyConfig(prefill=[InstanceSpec(p_url, "prefill")],
                             decode=[InstanceSpec(d0_url, "decode"), InstanceSpec(d1_url, "decode")],
                             probe_interval=1, scrape_interval=0, routing="round-robin")
        async with await start_proxy(config) as proxy:
            first = [asyncio.ensure_future(stream(proxy.url, i, tokens)) for i in range(streams)]
            end = time.monotonic() + 30
            pool = proxy.app.pools["decode"].instances
            while sum(i.inflight for i in pool) < streams:
                if time.monotonic() > end:
                    raise SystemExit("the streams did not start")
                await asyncio.sleep(0.02)
            await asyncio.sleep(tokens * ITL_MS / 1000 / 3)  # a third of the way
            victim = max(pool, key=lambda i: i.inflight)
            on_victim = victim.inflight
            killed = time.monotonic()
            os.killpg(decodes[victim.url].pid, signal.SIGKILL)
            await asyncio.sleep(0.05)
            second = [asyncio.ensure_future(stream(proxy.url, streams + i, tokens)) for i in range(streams // 4)]
            results = await asyncio.wait_for(asyncio.gather(*first), 120)
            later = await asyncio.wait_for(asyncio.gather(*second), 120)
            moves = dict(proxy.app.metrics.migrations)
    bad = [(i, why) for i, (_, events, _) in enumerate(results + later) if (why := failed(events, tokens))]
    ttft = [times[0] - sent for sent, _, times in results if times]
    ttft_after = [times[0] - sent for sent, _, times in later if times]
    before, across, after = [], [], []
    for _, _, times in results + later:
        for a, b in zip(times, times[1:]):
            (before if b < killed else across if a < killed else after).append(b - a)
    print(f"{streams} streams of {tokens} tokens (itl {ITL_MS} ms) on 2 decodes; decode {victim.url} SIGKILLed "
          f"with {on_victim} streams on it; {len(later)} more streams started 50 ms after the kill")
    print(f"failed streams: {len(bad)} of {len(results) + len(later)} {bad[:5]}; moves: {moves}")
    print(f"every stream's text events: {tokens} expected; complete and exact in count: "
          f"{len(results) + len(later) - len(bad)}")
    print(line("TTFT, first wave (before the kill)", ttft))
    print(line("TTFT, second wave (after the kill)", ttft_after))
    print(line("ITL before the kill", before))
    print(line("ITL across the kill (held the kill)", across))
    moved = sorted(across)[-on_victim:]  # the streams that were on the killed decode: the longest
    print(line("  of which the streams that moved", moved))
    print(line("ITL after the kill", after))
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the kill's warnings (a refused connection, the ejection) are expected
    return asyncio.run(run(args.streams, args.tokens))


if __name__ == "__main__":
    sys.exit(main())
