"""What routing on the KV block index costs a request at low load: sequential chat requests
(non-stream, 1 output token, about 90 words) through `epd-proxy serve --simulate` with the
simulator's KV events on and off. The proxy and the simulated instances share one process,
so the CPU per request includes the simulator's side (its /tokenize answer, its events).

    python scripts/kv_lookup_cost.py [N]
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import time

SPEC = "prefill=2,decode=2,ttft_ms=0,itl_ms=0,records=0,kv_events={}"


def _port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def run(events: int, n: int) -> tuple[float, float, float]:
    port = _port()
    proc = subprocess.Popen([sys.executable, "-m", "epd_proxy", "serve", "--port", str(port), "--log-level", "warning",
                             "--simulate", SPEC.format(events)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                c.request("GET", "/ready")
                if c.getresponse().status == 200:
                    break
            except OSError:
                time.sleep(0.1)
        time.sleep(1.0)  # the event streams connect
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        words = ("the quick brown fox jumps over lazy dog while cluster serves prefill decode " * 8).split()
        lat = []
        cpu0 = _cpu(proc.pid)
        for i in range(n + 50):
            text = f"conversation {i} " + " ".join(words[i % 7:][:90])
            body = json.dumps({"model": "sim-model", "max_tokens": 1,
                               "messages": [{"role": "user", "content": text}]})
            t = time.perf_counter()
            conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
            r = conn.getresponse()
            r.read()
            assert r.status == 200
            if i == 49:
                cpu0 = _cpu(proc.pid)
            if i >= 50:
                lat.append(time.perf_counter() - t)
        cpu = (_cpu(proc.pid) - cpu0) / n
        return statistics.median(lat) * 1e3, statistics.quantiles(lat, n=100)[98] * 1e3, cpu * 1e6
    finally:
        proc.terminate()
        proc.wait()


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 500
    for events in (0, 1, 0, 1):
        p50, p99, cpu = run(events, n)
        print(f"kv_events={events}: latency p50 {p50:.2f} ms, p99 {p99:.2f} ms, CPU {cpu:.0f} us per request")


if __name__ == "__main__":
    main()
