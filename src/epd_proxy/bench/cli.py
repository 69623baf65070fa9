"""``epd-proxy bench``: load generator, side-by-side comparison and scenarios.

Without ``--url`` the benchmark starts what it measures: a simulated cluster
(its own process) and the targets (each its own process), pinned apart. With
``--url`` it only sends load to that OpenAI-compatible endpoint (``--pid``
to also measure that server's CPU).

See docs/benchmarks.md for the recorded results and the exact commands.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import platform
import subprocess
import sys

from epd_proxy.bench.scenarios import SCENARIOS, by_name
from epd_proxy.bench.scenarios.base import csv_list, int_list
from epd_proxy.http import event_loop

DEFAULT_TARGETS = ("direct", "direct-pd", "epd-proxy", "vllm-router", "nginx")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Benchmark an OpenAI-compatible endpoint, or (default) epd-proxy side by side with the "
                          "simulated decode directly and other proxies, on a simulated cluster.")
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    m = parser.add_argument_group("what to run")
    m.add_argument("--url", default=None, help="only send load to this endpoint (no simulator, no comparison)")
    m.add_argument("--pid", type=int, default=None, help="with --url: measure this process tree's CPU")
    m.add_argument("--compare", action="store_true",
                   help="side by side: direct to decode, epd-proxy and the other proxies (scenario 'compare')")
    m.add_argument("--scenario", default=None,
                   help="comma-separated: " + ", ".join(by_name()) + ", or 'all' (default: compare,latency)")
    m.add_argument("--targets", type=csv_list, default=list(DEFAULT_TARGETS),
                   help="compare: which of direct, direct-pd, epd-proxy, vllm-router, nginx")
    m.add_argument("--other", action="append", default=[], metavar="NAME=COMMAND",
                   help="another proxy to compare; COMMAND may use {port} {host} {encode} {prefill} {decode} "
                        "{prefill0} {decode0} {python}")
    w = parser.add_argument_group("workload")
    w.add_argument("--workload", dest="workloads", type=csv_list, default=None,
                   help="stream, nonstream, mm, mixed, messages, responses (comma-separated; default: "
                        "stream,nonstream,mm)")
    w.add_argument("--concurrency", "-c", type=int, default=96, help="closed loop: requests in flight")
    w.add_argument("--start", choices=["staggered", "together"], default="staggered",
                   help="closed loop: spread the workers' first requests over the warm-up (staggered), or send "
                        "them at once (together: a deterministic simulator then keeps all C in lock-step, so the "
                        "backends and the proxy see bursts of C requests and req/s moves in steps of C/window)")
    w.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals per second")
    w.add_argument("--requests", "-n", type=int, default=1000, help="stop measuring after this many requests")
    w.add_argument("--duration", type=float, default=3.0, help="... or after this many seconds")
    w.add_argument("--warmup", type=float, default=1.0, help="seconds of unmeasured load first")
    w.add_argument("--repeat", type=int, default=3, help="compare: interleaved repeats (median, min-max)")
    w.add_argument("--images", type=int, default=1, help="mm: images per request")
    w.add_argument("--image-kb", type=float, default=150.0, help="mm: KiB per image (before base64)")
    w.add_argument("--prompt-bytes", type=int, default=600)
    w.add_argument("--max-tokens", type=int, default=64)
    w.add_argument("--variants", type=int, default=16, help="distinct request bodies per workload")
    w.add_argument("--model", default="sim-model")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--verify", choices=["auto", "on", "off"], default="auto",
                   help="byte-exact check against the simulator's text (auto: on unless --url)")
    s = parser.add_argument_group("simulated cluster")
    s.add_argument("--itl-ms", type=float, default=5.0, help="inter-token latency (engine step)")
    s.add_argument("--ttft-ms", type=float, default=2.0, help="prefill time (base)")
    s.add_argument("--encode-ms", type=float, default=1.0, help="encoder time per item")
    s.add_argument("--encoders", type=int, default=1)
    s.add_argument("--prefills", type=int, default=1)
    s.add_argument("--decoders", type=int, default=1)
    p = parser.add_argument_group("placement")
    p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                   help="pin the proxy and the load (simulator + load generator) to different cores")
    p.add_argument("--proxy-cpus", default=None, help="cores for the proxy under test (default: first core)")
    p.add_argument("--load-cpus", default=None, help="cores for simulator + load generator (default: the rest)")
    p.add_argument("--quiet-wait", type=float, default=0.0, metavar="S",
                   help="shared machine: before each phase wait up to S s for other processes to go quiet")
    p.add_argument("--retries", type=int, default=0,
                   help="shared machine: re-run a phase during which other processes used more than --max-foreign")
    p.add_argument("--max-foreign", type=float, default=0.15, metavar="CORES",
                   help="CPU other processes may use during a phase before it counts as disturbed")
    o = parser.add_argument_group("output")
    o.add_argument("--out", default="bench-results", help="report directory (a timestamped subdirectory)")
    o.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True)
    o.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    o.add_argument("--profile", action="store_true",
                   help="compare: one more (unmeasured) phase per workload with py-spy recording epd-proxy; "
                        "top functions in the report")
    o.add_argument("--profile-native", action="store_true", help="py-spy --native (C frames too)")
    o.add_argument("--sweep", type=int_list, default=[8, 32, 96, 192],
                   help="compare: concurrencies for req/s vs concurrency (empty string: none)")
    o.add_argument("--sweep-duration", type=float, default=2.5)
    shared = parser.add_argument_group("scenarios")
    for scenario in SCENARIOS.values():
        scenario.add_arguments(parser.add_argument_group(scenario.group) if scenario.group else shared)


def _scenarios(args) -> list[str]:
    if args.url:
        return ["url"]
    if args.scenario:
        known = by_name()
        names = csv_list(args.scenario)
        if names == ["all"]:
            return known
        bad = [n for n in names if n not in known]
        if bad:
            raise SystemExit(f"epd-proxy bench: unknown scenario(s) {', '.join(bad)} (known: {', '.join(known)})")
        return names
    return ["compare", "latency"]


def machine_info() -> dict:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            mem = f.readline().split(":", 1)[1].strip()
    except OSError:
        pass
    commit = ""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=5, cwd=os.path.dirname(__file__)).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        import uvloop

        uv = uvloop.__version__
    except ImportError:  # pragma: no cover
        uv = None
    return {"cpu": model, "cpus": os.cpu_count(), "memory": mem, "kernel": platform.release(),
            "python": platform.python_version(), "uvloop": uv, "git": commit}


def _keep_partial(result: dict, name: str, partial: dict) -> None:
    """An interrupted scenario: keep the phases it finished (compare-like ones)."""
    from epd_proxy.bench.lab import summarize_runs

    r = partial.get("result")
    if not isinstance(r, dict):
        return
    for w in r.get("workloads", {}).values():
        if w.get("runs"):
            w["summary"] = summarize_runs(w["runs"])
    r["interrupted"] = True
    result["scenarios"][name] = r


def _background_load(seconds: float = 1.0) -> float:
    """Cores kept busy by other processes right now (before the benchmark starts anything)."""
    import time

    from epd_proxy.bench.procs import machine_busy_seconds, self_cpu_seconds

    b0, s0, t0 = machine_busy_seconds(), self_cpu_seconds(), time.monotonic()
    time.sleep(seconds)
    b1, s1, t1 = machine_busy_seconds(), self_cpu_seconds(), time.monotonic()
    return max(0.0, ((b1 - b0) - (s1 - s0)) / (t1 - t0))


def run(args: argparse.Namespace) -> int:
    """``epd-proxy bench``."""
    from epd_proxy.bench import report
    from epd_proxy.bench.procs import nofile_limits, raise_nofile

    if args.workloads is None:
        args.workloads = ["stream"] if args.url else ["stream", "nonstream", "mm"]
    names = _scenarios(args)
    if args.compare and "compare" not in names:
        names.insert(0, "compare")
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    outdir = os.path.abspath(os.path.join(args.out, stamp))
    os.makedirs(outdir, exist_ok=True)
    args.log_dir = os.path.join(outdir, "logs")
    os.makedirs(args.log_dir, exist_ok=True)
    raise_nofile(1 << 20)
    result: dict = {"meta": {"command": "epd-proxy bench " + " ".join(sys.argv[2:] if len(sys.argv) > 2 else []),
                             "argv": sys.argv, "started": _dt.datetime.now().isoformat(timespec="seconds"),
                             "machine": machine_info(), "nofile": list(nofile_limits()), "scenarios": names},
                    "scenarios": {}}
    result["meta"]["background_cpu_cores"] = _background_load()
    if result["meta"]["background_cpu_cores"] > 0.15:
        print(f"bench: warning: {result['meta']['background_cpu_cores']:.2f} cores are busy with other work on this "
              "machine; the figures will be disturbed", file=sys.stderr)
    import signal

    def on_term(signum, frame):
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, on_term)
    try:
        for name in names:
            print(f"bench: scenario {name}", file=sys.stderr, flush=True)
            args.partial = {}
            try:
                result["scenarios"][name] = event_loop.run(SCENARIOS[name].run(args))
            except KeyboardInterrupt:
                _keep_partial(result, name, args.partial)
                raise
            except Exception as exc:  # keep what ran; say what did not
                import traceback

                traceback.print_exc()
                result["scenarios"][name] = {"error": f"{type(exc).__name__}: {exc}"}
    except KeyboardInterrupt:
        print("bench: interrupted; writing what was measured", file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, old_term)
    result["meta"]["finished"] = _dt.datetime.now().isoformat(timespec="seconds")
    result["checks"] = report.checks(result)
    paths = report.write(result, outdir, plots=args.plots)
    latest = os.path.join(os.path.abspath(args.out), "latest")
    try:
        if os.path.islink(latest):
            os.unlink(latest)
        os.symlink(outdir, latest)
    except OSError:
        pass
    print(report.console_summary(result), flush=True)
    print(f"report: {paths['markdown']}\n        {paths['json']}", flush=True)
    bad = sum(int(c.get("verify_errors") or 0) for c in result["checks"] if isinstance(c, dict))
    failed = [n for n, r in result["scenarios"].items() if isinstance(r, dict) and "error" in r]
    return 1 if bad or failed else 0


def _json_default(o):
    if isinstance(o, float) and math.isnan(o):
        return None
    return str(o)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: epd-proxy bench ...")
