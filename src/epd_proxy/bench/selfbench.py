"""How many streamed requests per second one simulator process sustains (the
simulator's own cost, so that a benchmark knows when the simulator is the limit).

    python -m epd_proxy.bench.selfbench [--concurrency 512] [--tokens 64] [--itl-ms 5] [--duration 10]

Starts ``python -m epd_proxy.sim --pd 1`` in a child process pinned to one
CPU (records off, ``max_num_seqs`` large), drives it from this process
(pinned to another CPU when there is one) with ``--concurrency`` clients in a
closed loop, each sending a streamed chat request for ``--tokens`` tokens, and
reports completed requests/s, SSE events/s and the simulator's CPU use
(user+system time of the child over the measurement window). When the
simulator's CPU is below 100 %, the load generator is the limit and
``requests/s / cpu`` estimates what one simulator core would sustain.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time

import msgspec

from epd_proxy.http import event_loop


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


class _LoadConnection(asyncio.Protocol):
    """A minimal keep-alive client: sends a request, waits for the end of the chunked body,
    sends the next one. No parsing beyond looking for the terminating chunk, so the load
    generator costs far less per SSE event than the simulator it measures."""

    END = b"data: [DONE]\n\n\r\n0\r\n\r\n"

    def __init__(self, request: bytes, counts: dict, state: dict) -> None:
        self.request = request
        self.counts = counts
        self.state = state
        self.tail = b""
        self.nbytes = 0
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # until connection_made
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.nbytes += len(data)
        tail = (self.tail + data)[-64:]
        if tail.endswith(self.END):
            if self.state["measuring"]:
                self.counts["ok"] += 1
                self.counts["bytes"] += self.nbytes
            self.nbytes = 0
            self.tail = b""
            if self.state["stop"]:
                self.transport.close()
            else:
                self.transport.write(self.request)
        else:
            self.tail = tail

    def connection_lost(self, exc) -> None:
        if self.state["measuring"] and not self.state["stop"]:
            self.counts["bad"] += 1
        if not self.closed.done():
            self.closed.set_result(None)


async def _drive(port: int, concurrency: int, tokens: int, duration: float, warmup: float) -> dict:
    body = msgspec.json.encode({"model": "sim-model", "stream": True, "max_tokens": tokens,
                                "messages": [{"role": "user", "content": "benchmark the simulator please"}]})
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
               b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)) + body
    counts: dict[str, float] = {"ok": 0, "bad": 0, "bytes": 0}
    state = {"measuring": False, "stop": False}
    loop = asyncio.get_running_loop()
    conns = []
    for _ in range(concurrency):
        _, proto = await loop.create_connection(lambda: _LoadConnection(request, counts, state), "127.0.0.1", port)
        conns.append(proto)
    await asyncio.sleep(warmup)
    state["measuring"] = True
    t0 = time.monotonic()
    await asyncio.sleep(duration)
    state["measuring"] = False
    counts["elapsed"] = time.monotonic() - t0
    state["stop"] = True
    await asyncio.wait([c.closed for c in conns], timeout=10)
    for c in conns:
        c.transport.abort()
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m epd_proxy.bench.selfbench", description=__doc__, allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--itl-ms", type=float, default=5.0)
    ap.add_argument("--ttft-ms", type=float, default=2.0)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--no-split", action="store_true", help="turn off split UTF-8 writes")
    args = ap.parse_args(argv)

    port = _free_port()
    cmd = [sys.executable, "-m", "epd_proxy.sim", "--pd", "1", "--base-port", str(port),
           "--itl-ms", str(args.itl_ms), "--ttft-ms", str(args.ttft_ms), "--max-num-seqs", "1000000",
           "--no-records"]
    if args.no_split:
        cmd += ["--set", "split_utf8=false"]
    ncpu = os.cpu_count() or 1
    sim_core, client_core = 0, (1 if ncpu > 1 else 0)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            preexec_fn=lambda: os.sched_setaffinity(0, {sim_core}))
    try:
        assert proc.stdout is not None
        proc.stdout.readline()  # the URL line: the cluster is up
        os.sched_setaffinity(0, {client_core})

        async def go() -> tuple[dict, float, float]:
            drive = asyncio.create_task(_drive(port, args.concurrency, args.tokens, args.duration, args.warmup))
            await asyncio.sleep(args.warmup)
            c0 = _cpu_seconds(proc.pid)
            p0 = time.process_time()
            t0 = time.monotonic()
            await asyncio.sleep(args.duration)
            dt = time.monotonic() - t0
            cpu = (_cpu_seconds(proc.pid) - c0) / dt
            client = (time.process_time() - p0) / dt
            return await drive, cpu, client

        counts, cpu, client_cpu = event_loop.run(go())
    finally:
        proc.terminate()
        proc.wait(10)
    rps = counts["ok"] / counts["elapsed"]
    events = rps * (args.tokens + 2)
    print(f"simulator: 1 process on CPU {sim_core}; client on CPU {client_core}; "
          f"{args.concurrency} concurrent streams x {args.tokens} tokens, ITL {args.itl_ms:g} ms")
    print(f"completed {counts['ok']} requests ({counts['bad']} failed) in {counts['elapsed']:.1f} s: "
          f"{rps:,.0f} req/s, {events:,.0f} SSE events/s, {counts['bytes'] / counts['elapsed'] / 1e6:.1f} MB/s")
    print(f"load generator CPU: {client_cpu * 100:.0f} % of one core")
    print(f"simulator CPU: {cpu * 100:.0f} % of one core"
          + (f"  -> about {rps / cpu:,.0f} req/s per simulator core" if cpu > 0.05 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
