"""overload: a burst of slow streams past the admission limit, with slowloris connections and
normal traffic alongside: what is shed, what it costs, how fast the proxy recovers."""

from __future__ import annotations

import asyncio
import os
import time

from epd_proxy.bench.exchange import send
from epd_proxy.bench.lab import Lab, lab_settings, workload_requests
from epd_proxy.bench.markdown import fmt, table
from epd_proxy.bench.procs import tree_pids
from epd_proxy.bench.scenarios.base import Scenario
from epd_proxy.bench.stats import summarize
from epd_proxy.http.client import ConnectionPool
from epd_proxy.http.transport import TransportTimeouts, UpstreamError

perf = time.perf_counter


def add_arguments(group) -> None:
    group.add_argument("--overload-streams", type=int, default=2000, help="overload: slow streams opened at once")
    group.add_argument("--overload-tokens", type=int, default=20, help="overload: tokens per slow stream")
    group.add_argument("--overload-itl-ms", type=float, default=250.0, help="overload: token delay of the slow streams")
    group.add_argument("--overload-max-inflight", type=int, default=500, help="overload: the proxy's --max-inflight")
    group.add_argument("--overload-queue-size", type=int, default=200, help="overload: the proxy's --queue-size")
    group.add_argument("--overload-queue-timeout", type=float, default=2.0,
                       help="overload: the proxy's --queue-timeout")
    group.add_argument("--overload-slowloris", type=int, default=200,
                       help="overload: connections trickling a request head, one byte per interval")
    group.add_argument("--overload-slowloris-interval", type=float, default=1.0)
    group.add_argument("--overload-normal-concurrency", type=int, default=4,
                       help="overload: closed-loop normal (non-stream) requests alongside")
    group.add_argument("--overload-baseline", type=float, default=3.0, help="overload: seconds of normal traffic first")
    group.add_argument("--overload-after", type=float, default=5.0,
                       help="overload: seconds of normal traffic after the burst (recovery is measured in them)")
    group.add_argument("--overload-sample", type=float, default=0.5, help="overload: RSS/descriptor sampling period")


def _fd_count(pid: int) -> int:
    """Open descriptors of a process tree (the proxy and its workers)."""
    n = 0
    for p in tree_pids(pid):
        try:
            n += len(os.listdir(f"/proc/{p}/fd"))
        except OSError:
            pass
    return n


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


async def _slowloris(url: str, n: int, interval: float, stop: asyncio.Event, state: dict) -> None:
    """``n`` connections that send a request head one byte every ``interval`` seconds."""
    host, port = url.removeprefix("http://").split(":")
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nx-slow: " + b"a" * 4096

    async def one() -> None:
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
        except OSError:
            state["slowloris_refused"] += 1
            return
        state["slowloris_open"] += 1
        try:
            for b in head:
                if stop.is_set():
                    return
                writer.write(bytes([b]))
                await writer.drain()
                try:  # the proxy may close it (a header read timeout): that is what it should do
                    if await asyncio.wait_for(reader.read(1 << 16), interval) == b"":
                        state["slowloris_closed_by_proxy"] += 1
                        return
                    state["slowloris_answered"] += 1
                    return
                except TimeoutError:
                    pass
        except (ConnectionError, OSError):
            state["slowloris_closed_by_proxy"] += 1
        finally:
            state["slowloris_open"] -= 1
            writer.transport.abort()

    await asyncio.gather(*(one() for _ in range(n)))


async def run(args) -> dict:
    """A burst of slow streams far beyond the proxy's admission limit, with slowloris
    connections and normal traffic alongside: what is shed, what it costs, how fast it recovers."""
    n, tokens = args.overload_streams, args.overload_tokens
    limit, queue, qtimeout = args.overload_max_inflight, args.overload_queue_size, args.overload_queue_timeout
    settings = lab_settings(args, sim={"itl_ms": args.overload_itl_ms, "max_num_seqs": n + 1000},
                            nofile=4 * n + 1024)
    extra = ["--max-inflight", str(limit), "--queue-size", str(queue), "--queue-timeout", str(qtimeout)]
    out: dict = {"streams": n, "tokens_per_stream": tokens, "itl_ms": args.overload_itl_ms, "max_inflight": limit,
                 "queue_size": queue, "queue_timeout_s": qtimeout, "slowloris": args.overload_slowloris}
    with Lab(settings) as lab:
        lab.pin_self()
        lab.start_sim()
        proxy = lab.start_proxy(extra=extra)
        svc, url = proxy.service, proxy.url
        assert svc is not None  # epd-proxy runs as a process of its own
        slow = workload_requests(args, "stream", max_tokens=tokens)
        normal = workload_requests(args, "nonstream", max_tokens=4)
        burst_pool = ConnectionPool(url, idle_timeout=30.0, max_idle=n + 100)
        normal_pool = ConnectionPool(url, idle_timeout=30.0)
        timeouts = TransportTimeouts(connect=30, headers=120, idle=120)
        loop = asyncio.get_running_loop()
        t_start = perf()
        # Normal traffic alone first: the latency to recover to.
        base: list[float] = []
        while perf() - t_start < args.overload_baseline or len(base) < 5:
            o = await send(normal_pool, normal[len(base) % len(normal)], timeouts)
            if o.ok:
                base.append(o.t_end - o.t_send)
        base_p50 = sorted(base)[len(base) // 2]
        out["normal_baseline_ms"] = summarize(base, 1000)
        out["rss_idle_mb"] = svc.rss_bytes() / 2**20
        out["fds_idle"] = _fd_count(svc.pid)
        stop = asyncio.Event()
        state = {"slowloris_open": 0, "slowloris_refused": 0, "slowloris_closed_by_proxy": 0,
                 "slowloris_answered": 0}
        normal_log: list[tuple[float, float, int | None, bool]] = []  # (t_end, seconds, status, ok)
        peaks = {"rss_mb": 0.0, "fds": 0}
        samples: list[dict] = []

        async def normal_loop(k: int) -> None:
            while not stop.is_set():
                o = await send(normal_pool, normal[k % len(normal)], timeouts)
                normal_log.append((o.t_end, o.t_end - o.t_send, o.status, o.ok))
                k += args.overload_normal_concurrency

        async def sampler() -> None:
            while not stop.is_set():
                s = {"t": perf() - t_start, "rss_mb": svc.rss_bytes() / 2**20, "fds": _fd_count(svc.pid)}
                samples.append(s)
                peaks["rss_mb"] = max(peaks["rss_mb"], s["rss_mb"])
                peaks["fds"] = max(peaks["fds"], s["fds"])
                await asyncio.sleep(args.overload_sample)

        helpers: list[asyncio.Task] = [loop.create_task(sampler()),
                   loop.create_task(_slowloris(url, args.overload_slowloris, args.overload_slowloris_interval,
                                               stop, state))]
        helpers += [loop.create_task(normal_loop(i)) for i in range(args.overload_normal_concurrency)]
        t_burst = perf()
        burst = [loop.create_task(send(burst_pool, slow[i % len(slow)], timeouts)) for i in range(n)]
        done, pending = await asyncio.wait(burst, timeout=tokens * args.overload_itl_ms / 1000.0 + 120)
        t_burst_end = perf()
        for t in pending:
            t.cancel()
        await asyncio.sleep(args.overload_after)
        stop.set()
        await asyncio.wait(helpers, timeout=30)
        for t in helpers:
            t.cancel()
        metrics = ""
        try:
            resp = await normal_pool.request("GET", "/metrics", timeouts=timeouts)
            try:
                metrics = (await resp.read()).decode()
            finally:
                resp.close()
        except UpstreamError:
            pass
        await burst_pool.close()
        await normal_pool.close()
        outcomes = [t.result() for t in done]
        statuses: dict[str, int] = {}
        for o in outcomes:
            key = str(o.status) if o.status is not None else "no-response"
            statuses[key] = statuses.get(key, 0) + 1
        # Recovered: from the end of the burst, every normal request succeeded at most twice as
        # slowly as before it (plus 5 ms).
        good = 2 * base_p50 + 0.005
        bad_after = [t for t, secs, _, ok in normal_log if t >= t_burst_end and (not ok or secs > good)]
        during = [(secs, status, ok) for t, secs, status, ok in normal_log if t_burst <= t < t_burst_end]
        out.update({
            "burst_s": t_burst_end - t_burst,
            "burst_statuses": statuses,
            "burst_ok": sum(1 for o in outcomes if o.ok),
            "burst_shed_429": statuses.get("429", 0),
            "burst_verify_errors": sum(1 for o in outcomes if o.verify_error),
            "burst_unfinished": len(pending),
            "proxy_shed_total": _metric(metrics, "epd_proxy_shed_requests_total"),
            "rss_peak_mb": peaks["rss_mb"],
            "rss_after_mb": svc.rss_bytes() / 2**20,
            "fds_peak": peaks["fds"],
            "fds_after": _fd_count(svc.pid),
            "normal_during_burst": {"requests": len(during), "ok": sum(1 for d in during if d[2]),
                                    "shed_429": sum(1 for d in during if d[1] == 429),
                                    "latency_ms": summarize([d[0] for d in during if d[2]], 1000)},
            "recovery_s": (max(bad_after) - t_burst_end) if bad_after else 0.0,
            "recovered": not bad_after or max(bad_after) < t_burst_end + args.overload_after - 0.5,
            "samples": samples,
            **state,
        })
    return out


def section(r: dict, plots: dict) -> list[str]:
    out = ["## Overload: a burst past the admission limit", "",
           f"{r['streams']} slow streams opened at once ({r['tokens_per_stream']} tokens, {fmt(r['itl_ms'], 0)} ms "
           f"apart) against `--max-inflight {r['max_inflight']} --queue-size {r['queue_size']} --queue-timeout "
           f"{r['queue_timeout_s']:g}`, with {r['slowloris']} slowloris connections and closed-loop non-stream "
           "requests alongside.", ""]
    nd = r.get("normal_during_burst", {})
    rows = [["burst", f"{r['burst_ok']} ok, {r['burst_shed_429']} shed (429), statuses {r['burst_statuses']}, "
                      f"{r['burst_verify_errors']} mismatches, {r['burst_unfinished']} unfinished"],
            ["shed (proxy's counter)", fmt(r.get("proxy_shed_total"), 0)],
            ["RSS idle / peak / after, MiB", f"{fmt(r['rss_idle_mb'], 1)} / {fmt(r['rss_peak_mb'], 1)} / "
                                             f"{fmt(r['rss_after_mb'], 1)}"],
            ["descriptors idle / peak / after", f"{r['fds_idle']} / {r['fds_peak']} / {r['fds_after']}"],
            ["normal requests during the burst", f"{nd.get('ok')} ok of {nd.get('requests')}, "
                                                 f"{nd.get('shed_429')} shed; p50/p99 "
                                                 f"{fmt(nd.get('latency_ms', {}).get('p50'))} / "
                                                 f"{fmt(nd.get('latency_ms', {}).get('p99'))} ms (before: p50 "
                                                 f"{fmt(r['normal_baseline_ms'].get('p50'))} ms)"],
            ["slowloris", f"{r['slowloris_closed_by_proxy']} closed by the proxy, {r['slowloris_answered']} "
                          f"answered, {r['slowloris_refused']} refused"],
            ["time to recover after the burst", f"{fmt(r['recovery_s'], 2)} s"
                                                + ("" if r.get("recovered") else " (not recovered)")]]
    return out + [table(["", ""], rows), ""]


SCENARIO = Scenario("overload", run=run, section=section, add_arguments=add_arguments)
