"""The soak of docs/benchmarks.md, "A ten-minute soak with every feature on" (docs/operations.md,
"A decode starved by kept KV"): every feature on, at a decode TTL of your choice.

    PYTHONPATH=src python scripts/kv_starvation_soak.py [--seconds 600] [--concurrency 32] [--ttl 480]

Starts a redis-server of its own (a free port, a temporary directory) and ``epd-proxy serve
--workers 2 --state-store redis://…`` with two client keys (classes ``critical`` and
``sheddable``), KV events, and a simulated E+P+D cluster in a process of its own (``--simulate``:
one encoder, one prefill, two decodes, bidirectional transfer with the decodes'
``decoder_kv_blocks_ttl`` at ``--ttl``, 5 ms between tokens, the simulator behaving as vLLM
towards plain requests). ``--concurrency`` clients for ``--seconds``, each running three-turn
chat conversations (half of them streamed, a quarter opening with an image), and every fifth
request a Messages one, every fifth a Responses one. A client gives up after 60 s.

Reported (one JSON object on stdout, a line per sample on stderr): requests, errors (by kind; the
first five wrong answers whole, with their request id and ``Server-Timing``),
the longest wait and the share over 5 s, the requests a prefill answered alone and those refused
(``epd_proxy_wedged_routing_total``), and from a sample every 2 s of each decode's own gauges
(requests waiting and running, KV usage) and of its state in the proxy, when each decode stood
still (wedged) and when it ran again.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from epd_proxy.http.client import ConnectionPool
from epd_proxy.http.transport import TransportTimeouts, UpstreamError
from epd_proxy.sim import expected_text

SRC = str(Path(__file__).resolve().parent.parent / "src")
SYSTEM = " ".join(f"s{i}" for i in range(160))
IMAGE = "https://example.com/cat.png"
GIVE_UP = 60.0  # a client's patience
KEYS = {"gold": "sk-soak-critical-0123456789", "bulk": "sk-soak-sheddable-0123456789"}
ADMIN = "sk-soak-admin-0123456789"  # /status shows backend addresses: the admin key
CLUSTER = """
[tenants.classes]
critical = {rank = 2}
sheddable = {rank = 0, sheddable = true}

[[tenants.keys]]
name = "gold"
class = "critical"

[[tenants.keys]]
name = "bulk"
class = "sheddable"
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gauges(text: str, name: str) -> dict[str, float]:
    """A metric's samples by their label text (Prometheus text)."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name):len(name) + 1] in ("{", " ")):
            head, _, value = line.rpartition(" ")
            out[head[len(name):]] = float(value)
    return out


def user(conv: int, turn: int, image: bool) -> object:
    text = f"conversation {conv} turn {turn}: " + " ".join(f"w{conv}x{turn}x{i}" for i in range(30))
    if not image:
        return text
    return [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": IMAGE}}]


class Soak:
    def __init__(self, url: str, seconds: float, concurrency: int) -> None:
        self.url = url
        self.seconds = seconds
        self.concurrency = concurrency
        self.waits: list[float] = []
        self.errors: dict[str, int] = {}
        self.wrong: list[dict] = []  # the first few wrong answers, with what the proxy said of them
        self.last_head: dict[str, str] = {}
        self.counter = 0

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1

    async def timed(self, pool: ConnectionPool, key: str, path: str, body: dict) -> str | None:
        raw = msgspec.json.encode(body)
        headers = [(b"content-type", b"application/json"), (b"authorization", b"Bearer " + key.encode())]
        t = TransportTimeouts(connect=GIVE_UP, headers=GIVE_UP, idle=GIVE_UP)
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(GIVE_UP):
                resp = await pool.request("POST", path, body=raw, headers=headers, timeouts=t)
                try:
                    data = await resp.read()
                finally:
                    resp.close()
        except TimeoutError:
            self.waits.append(GIVE_UP)
            self.error(f"gave up after {GIVE_UP:g} s")
            return None
        except (UpstreamError, OSError) as exc:
            self.waits.append(time.monotonic() - t0)
            self.error(f"transport: {type(exc).__name__}")
            return None
        self.waits.append(time.monotonic() - t0)
        self.last_head = {k.decode(): v.decode("latin-1") for k, v in resp.headers.items()
                          if k in (b"x-request-id", b"server-timing", b"x-epd-migrated")}
        if resp.status != 200:
            self.error(f"{path} {resp.status}")
            return None
        if path != "/v1/chat/completions":
            return ""
        if body.get("stream"):
            if b"data: [DONE]" not in data or b'"error"' in data:
                self.error("stream without its terminator, or in-band error")
                return None
            out = []
            for event in data.split(b"\n\n"):
                payload = event[len(b"data: "):]
                if not payload or payload == b"[DONE]":
                    continue
                for choice in msgspec.json.decode(payload).get("choices") or []:
                    out.append((choice.get("delta") or {}).get("content") or "")
            return "".join(out)
        return msgspec.json.decode(data)["choices"][0]["message"]["content"]

    async def conversation(self, pool: ConnectionPool, key: str, conv: int) -> None:
        body = {"model": "sim-model", "max_tokens": 24, "stream": conv % 2 == 1,
                "messages": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": user(conv, 0, conv % 4 == 0)}]}
        for turn in range(3):
            text = await self.timed(pool, key, "/v1/chat/completions", body)
            if text is None:
                return
            expected = expected_text(body)
            if text != expected:
                self.error("wrong answer")
                if len(self.wrong) < 5:  # enough to tell a cause: the stream, the texts, the moves
                    self.wrong.append({"stream": bool(body.get("stream")), "turn": turn, "got": text,
                                       "expected": expected, **self.last_head})
            body = dict(body, messages=body["messages"] + [{"role": "assistant", "content": text},
                                                           {"role": "user", "content": user(conv, turn + 1, False)}])
            await asyncio.sleep(0.05)

    async def client(self, n: int, stop: float) -> None:
        key = KEYS["gold"] if n % 2 == 0 else KEYS["bulk"]
        pool = ConnectionPool(self.url)
        try:
            while time.monotonic() < stop:
                i = self.counter
                self.counter += 1
                if i % 5 == 3:
                    await self.timed(pool, key, "/v1/messages", {
                        "model": "sim-model", "max_tokens": 24,
                        "messages": [{"role": "user", "content": user(i, 0, False)}]})
                elif i % 5 == 4:
                    await self.timed(pool, key, "/v1/responses", {
                        "model": "sim-model", "max_output_tokens": 24, "input": user(i, 0, False), "store": False})
                else:
                    await self.conversation(pool, key, i)
        finally:
            await pool.close()

    async def run(self) -> None:
        stop = time.monotonic() + self.seconds
        await asyncio.gather(*(self.client(n, stop) for n in range(self.concurrency)))


async def get(url: str, path: str) -> tuple[int, bytes]:
    pool = ConnectionPool(url)
    try:
        t = TransportTimeouts(connect=5, headers=5, idle=5)
        resp = await pool.request("GET", path, headers=[(b"authorization", b"Bearer " + ADMIN.encode())], timeouts=t)
        try:
            return resp.status, await resp.read()
        finally:
            resp.close()
    finally:
        await pool.close()


async def sample(proxy: str, start: float, timeline: list[dict], stop: asyncio.Event) -> None:
    """Every 2 s: each decode's own gauges and its state in the proxy (the worker answering)."""
    decodes: list[str] = []
    while not stop.is_set():
        with contextlib.suppress(Exception):
            if not decodes:
                _, data = await get(proxy, "/status")
                decodes = [p["url"] for p in json.loads(data)["pools"]["decode"]]
            _, status = await get(proxy, "/status")
            states = {p["url"]: p["state"] for p in json.loads(status)["pools"]["decode"]}
            _, metrics = await get(proxy, "/metrics")
            text = metrics.decode()
            row = {"t": round(time.monotonic() - start, 1),
                   "alone": sum(v for k, v in gauges(text, "epd_proxy_wedged_routing_total").items()
                                if "prefill_alone" in k),
                   "refused": sum(v for k, v in gauges(text, "epd_proxy_wedged_routing_total").items()
                                  if "refused" in k),
                   "decodes": []}
            for url in decodes:
                _, own = await get(url, "/metrics")
                m = own.decode()
                waiting = sum(gauges(m, "vllm:num_requests_waiting").values())
                running = sum(gauges(m, "vllm:num_requests_running").values())
                usage = max(gauges(m, "vllm:kv_cache_usage_perc").values() or [0.0])
                row["decodes"].append({"url": url, "waiting": waiting, "running": running,
                                       "kv": round(usage, 4), "state": states.get(url)})
            timeline.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 2.0)


def spells(timeline: list[dict]) -> dict[str, list[list[float]]]:
    """Per decode, the spells it stood still (waiting, none running), [from, to] in seconds."""
    out: dict[str, list[list[float]]] = {}
    for row in timeline:
        for d in row["decodes"]:
            runs = out.setdefault(d["url"], [])
            still = d["waiting"] > 0 and d["running"] == 0
            if still and (not runs or runs[-1][1] is not None):
                runs.append([row["t"], None])
            elif not still and runs and runs[-1][1] is None:
                runs[-1][1] = row["t"]
    return out


async def wait_up(url: str, proc, seconds: float) -> None:
    end = time.monotonic() + seconds
    while True:
        with contextlib.suppress(Exception):
            status, _ = await get(url, "/health")
            if status == 200:
                return
        if proc.returncode is not None or time.monotonic() > end:
            raise SystemExit(f"{url} did not start")
        await asyncio.sleep(0.25)


async def main_async(args) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [SRC, os.environ.get("PYTHONPATH", "")] if p))
    with tempfile.TemporaryDirectory(prefix="epd-soak-") as tmp:
        redis_port, port = free_port(), free_port()
        redis = await asyncio.create_subprocess_exec(
            "redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", tmp, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True)
        Path(tmp, "cluster.toml").write_text(CLUSTER)
        Path(tmp, "keys").write_text("".join(f"{name}:{key}\n" for name, key in KEYS.items()))
        spec = (f"encode=1,prefill=1,decode=2,bidirectional=1,itl_ms=5,ttft_ms=2,kv_events=1,records=0,"
                f"strict_roles=0,bidirectional_kv_ttl={args.ttl:g}")
        log = open(Path(args.log) if args.log else Path(tmp, "proxy.log"), "w")
        proxy = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "epd_proxy", "serve", "--port", str(port), "--workers", "2",
            "--simulate", spec, "--state-store", f"redis://127.0.0.1:{redis_port}", "--config",
            str(Path(tmp, "cluster.toml")), "--api-key-file", str(Path(tmp, "keys")),
            "--kv-reuse-ttl", f"{args.ttl:g}", "--admin-api-key", ADMIN, "--log-level", "warning",
            env=env, stdout=log, stderr=log, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        timeline: list[dict] = []
        try:
            await wait_up(url, proxy, 60)
            await asyncio.sleep(2)  # the workers' first probes and scrapes
            soak = Soak(url, args.seconds, args.concurrency)
            stop = asyncio.Event()
            sampler = asyncio.create_task(sample(url, time.monotonic(), timeline, stop))
            await soak.run()
            stop.set()
            await sampler
            waits = sorted(soak.waits)
            last = timeline[-1] if timeline else {"alone": 0, "refused": 0}
            return {"seconds": args.seconds, "concurrency": args.concurrency, "ttl": args.ttl,
                    "requests": len(waits), "errors": soak.errors, "errors_total": sum(soak.errors.values()),
                    "wrong_answers": soak.wrong,
                    "longest_wait_s": round(waits[-1], 2) if waits else None,
                    "p99_wait_s": round(waits[int(0.99 * (len(waits) - 1))], 3) if waits else None,
                    "over_5s": sum(1 for w in waits if w >= 5.0),
                    "prefill_alone": last["alone"], "refused": last["refused"],
                    "stood_still": spells(timeline),
                    "ejected_samples": {d["url"]: sum(1 for r in timeline for x in r["decodes"]
                                                      if x["url"] == d["url"] and x["state"] == "ejected")
                                        for d in (timeline[0]["decodes"] if timeline else [])},
                    "samples": len(timeline)}
        finally:
            for proc in (proxy, redis):
                if proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGTERM)
                    try:
                        await asyncio.wait_for(proc.wait(), 20)
                    except TimeoutError:
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(proc.pid, signal.SIGKILL)
                        await proc.wait()
            log.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--ttl", type=float, default=480, help="the decodes' decoder_kv_blocks_ttl (s)")
    parser.add_argument("--log", default=None, help="the proxy's log file (default: a temporary one)")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main_async(args)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
