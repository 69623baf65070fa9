"""A decode SIGKILLed under 64 concurrent long streams, on the simulator (docs/benchmarks.md,
"Stream migration: a decode killed under 64 streams"); or a decode, or a prefill, SIGSTOPped
(wedged: connections open and silent) for 15 s.

    PYTHONPATH=src python scripts/migration_under_kill.py [--streams 64] [--tokens 256]
    PYTHONPATH=src python scripts/migration_under_kill.py --stop decode [--stop-seconds 15]
    PYTHONPATH=src python scripts/migration_under_kill.py --stop prefill [--stop-seconds 15]

A prefill and two decodes, each an ``epd-proxy sim`` process of its own (``--itl-ms 15``), and
the proxy in this process (round-robin: half the streams on each decode). When every stream is
under way, the decode serving the first is SIGKILLed, and a second wave of streams starts just
after the kill. Reported: the streams that failed (an error event, a missing terminator, a wrong
token count, more than one id), the moves, and time to first token and inter-token gaps (p50,
p99, max) before the kill, across it (the gap holding the kill on a moved stream), after it, and
the second wave's time to first token. Bounded: about 15 s, and at most 120 s. Figures on a
shared machine move with its load: compare within one run.

``--stop decode``: the decode serving the first stream is SIGSTOPped for ``--stop-seconds``
(then SIGCONT), and a new stream starts every 100 ms for 3 s after the stop. Reported: each
stream's longest silence (the issue's bound: a stream on the wedged decode resumes within 2 s
of its last event, none stalls past 3 s), the moves, when the last new request was placed on
the wedged decode, and TTFT and ITL before, around (the stop's first 3 s) and after.
``--stop prefill``: two prefills; after a warm-up of ``--warmup`` (40) short requests (the
hedge delay's samples; the hedge budget is a share of the requests), one prefill is
SIGSTOPped, and a new stream starts every 50 ms for 3 s. Reported: the TTFT of the warm-up and
of the streams sent into the stop (the bound: at most the hedge delay added), the hedges, and
the longest silence per stream.
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


@contextlib.asynccontextmanager
async def one_prefill_two_decodes():
    """The proxy (round-robin) in front of a prefill and two decodes, each a process of its own;
    yields the proxy and each decode's process by its URL."""
    async with sim_process("prefill") as (_, p_url), sim_process("decode") as (d0, d0_url), \
            sim_process("decode") as (d1, d1_url):
        config = ProxyConfig(prefill=[InstanceSpec(p_url, "prefill")],
                             decode=[InstanceSpec(d0_url, "decode"), InstanceSpec(d1_url, "decode")],
                             probe_interval=1, scrape_interval=0, routing="round-robin")
        async with await start_proxy(config) as proxy:
            yield proxy, {d0_url: d0, d1_url: d1}


async def under_way(proxy, streams: int, tokens: int):
    """``streams`` streams started and a third of the way through; returns their tasks, the
    decode serving the most of them and how many that is."""
    first = [asyncio.ensure_future(stream(proxy.url, i, tokens)) for i in range(streams)]
    end = time.monotonic() + 30
    pool = proxy.app.pools["decode"].instances
    while sum(i.inflight for i in pool) < streams:
        if time.monotonic() > end:
            raise SystemExit("the streams did not start")
        await asyncio.sleep(0.02)
    await asyncio.sleep(tokens * ITL_MS / 1000 / 3)  # a third of the way
    victim = max(pool, key=lambda i: i.inflight)
    return first, victim, victim.inflight


async def run(streams: int, tokens: int) -> int:
    async with one_prefill_two_decodes() as (proxy, decodes):
        first, victim, on_victim = await under_way(proxy, streams, tokens)
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


def longest_gap(sent: float, times: list[float]) -> float:
    """A stream's longest silence: from its request to its first event, or between two events."""
    return max((b - a for a, b in zip([sent] + times, times)), default=float("nan"))


@contextlib.asynccontextmanager
async def stopped_for(victim, pid: int, seconds: float):
    """``victim``'s process SIGSTOPped for ``seconds`` from entry, the new requests placed on it
    meanwhile recorded: yields (when it stopped, their times after it); SIGCONT on the way out."""
    stopped = time.monotonic()
    os.killpg(pid, signal.SIGSTOP)
    placed: list[float] = []
    watch = asyncio.ensure_future(placements_on(victim, stopped, placed))
    try:
        yield stopped, placed
        await asyncio.sleep(max(0.0, stopped + seconds - time.monotonic()))
    finally:
        os.killpg(pid, signal.SIGCONT)
        watch.cancel()


async def placements_on(inst, since: float, out: list[float]) -> None:
    """Appends the time (from ``since``) of each new request placed on ``inst`` (its counter
    sampled every 10 ms), until cancelled."""
    seen = inst.requests
    while True:
        await asyncio.sleep(0.01)
        if inst.requests != seen:
            seen = inst.requests
            out.append(time.monotonic() - since)


async def stagger(url: str, first: int, n: int, every: float, tokens: int) -> list:
    """``n`` streams, one every ``every`` seconds."""
    tasks = []
    for i in range(n):
        tasks.append(asyncio.ensure_future(stream(url, first + i, tokens)))
        await asyncio.sleep(every)
    return await asyncio.wait_for(asyncio.gather(*tasks), 120)


def report_streams(name: str, results: list, stopped: float, tokens: int) -> list:
    """The failures, each stream's longest silence, TTFT and ITL before, around (the stop's
    first 3 s) and after; returns the failures."""
    bad = [(i, why) for i, (_, events, _) in enumerate(results) if (why := failed(events, tokens))]
    longest = [longest_gap(sent, times) for sent, _, times in results if times]
    print(f"{name}: failed streams {len(bad)} of {len(results)} {bad[:5]}; "
          f"longest silence > 2 s: {sum(g > 2 for g in longest)}, > 3 s: {sum(g > 3 for g in longest)}")
    print(line("  longest silence per stream", longest))
    print(line("  TTFT", [times[0] - sent for sent, _, times in results if times]))
    before, around, after = [], [], []
    for _, _, times in results:
        for a, b in zip(times, times[1:]):
            (before if b < stopped else around if a < stopped + 3 else after).append(b - a)
    print(line("  ITL before the stop", before))
    print(line("  ITL around it (its first 3 s)", around))
    print(line("  ITL after", after))
    return bad


async def run_stop_decode(streams: int, tokens: int, seconds: float) -> int:
    async with one_prefill_two_decodes() as (proxy, decodes):
        first, victim, on_victim = await under_way(proxy, streams, tokens)
        async with stopped_for(victim, decodes[victim.url].pid, seconds) as (stopped, placed):
            second = await stagger(proxy.url, streams, 30, 0.1, tokens)
            results = await asyncio.wait_for(asyncio.gather(*first), 120)
        moves = dict(proxy.app.metrics.migrations)
        health = victim.health.state
    print(f"{streams} streams of {tokens} tokens (itl {ITL_MS} ms) on 2 decodes; decode {victim.url} SIGSTOPped "
          f"for {seconds:g} s with {on_victim} streams on it; a new stream every 100 ms for 3 s after the stop")
    print(f"moves: {moves}; the wedged decode's state at the end of the stop: {health}")
    print(f"new requests placed on the wedged decode after the stop: {len(placed)}, the last "
          f"{placed[-1] if placed else float('nan'):.2f} s after it (at {[round(t, 2) for t in placed]})")
    bad = report_streams("first wave (under way at the stop)", results, stopped, tokens)
    moved = sorted(longest_gap(sent, times) for sent, _, times in results if times)[-on_victim:]
    print(line("  of which the streams that were on the wedged decode", moved))
    bad += report_streams("second wave (sent into the stop)", second, stopped, tokens)
    return 1 if bad else 0


async def run_stop_prefill(tokens: int, seconds: float, warmup: int) -> int:
    async with sim_process("prefill") as (p0, p0_url), sim_process("prefill") as (p1, p1_url), \
            sim_process("decode") as (_, d0_url), sim_process("decode") as (_, d1_url):
        prefills = {p0_url: p0, p1_url: p1}
        config = ProxyConfig(prefill=[InstanceSpec(p0_url, "prefill"), InstanceSpec(p1_url, "prefill")],
                             decode=[InstanceSpec(d0_url, "decode"), InstanceSpec(d1_url, "decode")],
                             probe_interval=1, scrape_interval=0, routing="round-robin")
        async with await start_proxy(config) as proxy:
            warm = await stagger(proxy.url, 100, warmup, 0.02, 16)
            victim = proxy.app.pools["prefill"].instances[0]
            async with stopped_for(victim, prefills[victim.url].pid, seconds) as (stopped, placed):
                during = await stagger(proxy.url, 0, 60, 0.05, tokens)
            hedges = dict(proxy.app.metrics.hedges)
            health = victim.health.state
    print(f"2 prefills, 2 decodes (itl {ITL_MS} ms); {warmup} warm-up requests of 16 tokens, then prefill {victim.url} "
          f"SIGSTOPped for {seconds:g} s and a stream of {tokens} tokens sent every 50 ms for 3 s")
    print(f"hedges: {hedges}; the wedged prefill's state at the end of the stop: {health}")
    print(f"new requests placed on the wedged prefill after the stop: {len(placed)}, the last "
          f"{placed[-1] if placed else float('nan'):.2f} s after it")
    bad = [(i, why) for i, (_, events, _) in enumerate(warm) if (why := failed(events, 16))]
    print(line("warm-up TTFT (before the stop)", [times[0] - sent for sent, _, times in warm if times]))
    bad += report_streams("streams sent into the stop", during, stopped, tokens)
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--stop", choices=("decode", "prefill"), default=None,
                        help="SIGSTOP this role's instance instead of SIGKILLing a decode")
    parser.add_argument("--stop-seconds", type=float, default=15.0)
    parser.add_argument("--warmup", type=int, default=40,
                        help="--stop prefill: requests before the stop (the hedge budget is a share of them)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the kill's warnings (a refused connection, the ejection) are expected
    if args.stop == "decode":
        return asyncio.run(run_stop_decode(args.streams, args.tokens, args.stop_seconds))
    if args.stop == "prefill":
        return asyncio.run(run_stop_prefill(args.tokens, args.stop_seconds, args.warmup))
    return asyncio.run(run(args.streams, args.tokens))


if __name__ == "__main__":
    sys.exit(main())
