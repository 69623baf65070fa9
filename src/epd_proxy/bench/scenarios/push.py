"""push: TTFT in NIXL push mode (``nixl-push``) against pull mode (``nixl``)."""

from __future__ import annotations

import sys

import msgspec

from epd_proxy.bench.exchange import send
from epd_proxy.bench.lab import ForeignMeter, Lab, lab_settings
from epd_proxy.bench.markdown import fmt, table
from epd_proxy.bench.scenarios.base import Scenario, float_list
from epd_proxy.bench.stats import summarize
from epd_proxy.bench.workloads import Prepared, chat_body, make_workload, simulator_expected
from epd_proxy.http.client import ConnectionPool
from epd_proxy.http.transport import TransportTimeouts


def add_arguments(group) -> None:
    group.add_argument("--push-tp-ms", type=float, default=40.0, help="push: prefill time T_p")
    group.add_argument("--push-td-ms", type=float_list, default=[20.0, 40.0, 60.0], help="push: decode times T_d")
    group.add_argument("--push-samples", type=int, default=60)


async def run(args) -> dict:
    """TTFT at concurrency 1 with prefill time T_p (prefill ``ttft_ms``) and a decode-side
    time T_d (``decode:delay=T_d`` on each request: decode work that does not need
    the KV), in pull (nixl) and push (nixl-push) mode."""
    tp = args.push_tp_ms
    out: dict = {"tp_ms": tp, "td_ms": list(args.push_td_ms), "modes": {}}
    expected = simulator_expected() if args.verify != "off" else None
    for mode in ("nixl", "nixl-push"):
        settings = lab_settings(args, sim={"kv_connector": mode, "itl_ms": 5.0},
                                roles={"prefill": {"ttft_ms": tp, "ttft_per_token_ms": 0.0}},
                                counts={"encode": 0, "prefill": 1, "decode": 1})
        rows = []
        with Lab(settings) as lab:
            lab.pin_self()
            lab.start_sim()
            proxy = lab.start_proxy(what=f"epd-proxy ({mode})", kv_connector=mode)
            pool = ConnectionPool(proxy.url)
            timeouts = TransportTimeouts(connect=10, headers=60, idle=60)
            try:
                for td in args.push_td_ms:
                    w = make_workload("stream", max_tokens=4, prompt_bytes=args.prompt_bytes, model=args.model)[0]
                    reqs = []
                    for i in range(8):
                        body = chat_body(w, i, args.seed)
                        body["sim_fault"] = f"decode:delay={td / 1000.0:g}"
                        reqs.append(Prepared("stream", "/v1/chat/completions", msgspec.json.encode(body), True,
                                             expected(body) if expected else None, body))
                    for prep in reqs[:2]:
                        await send(pool, prep, timeouts)
                    tries = 0
                    while True:
                        if lab.s.quiet_wait > 0:
                            await lab.wait_quiet()
                        meter = ForeignMeter(lab).start()
                        ttft, errors = [], 0
                        for i in range(args.push_samples):
                            o = await send(pool, reqs[i % len(reqs)], timeouts)
                            if o.ok and o.ttft is not None:
                                ttft.append(o.ttft)
                            else:
                                errors += 1
                        foreign = meter.stop()
                        if foreign <= lab.s.max_foreign or tries >= lab.s.retries:
                            break
                        tries += 1
                    model = max(tp, td) if mode == "nixl-push" else tp + td
                    s = summarize(ttft, 1000)
                    rows.append({"td_ms": td, "model_ms": model, "model": "max(Tp, Td)" if mode == "nixl-push"
                                 else "Tp + Td", "ttft_ms": s, "overhead_p50_ms": s["p50"] - model,
                                 "errors": errors, "foreign_cpu_util": foreign, "retries": tries})
                    if args.progress:
                        print(f"push {mode} Td={td:g}: TTFT p50 {s['p50']:.1f} ms (model {model:g})",
                              file=sys.stderr)
            finally:
                await pool.close()
        out["modes"][mode] = rows
    return out


def section(r: dict, plots: dict) -> list[str]:
    out = ["## Push (nixl-push) against pull (nixl): TTFT", ""]
    out.append(f"Prefill time T_p = {fmt(r.get('tp_ms'), 0)} ms; decode-side time T_d set per request "
               "(`sim_fault: decode:delay=T_d`, work on decode that does not need the KV); concurrency 1.")
    out.append("")
    rows = []
    for mode, rs in r.get("modes", {}).items():
        for row in rs:
            rows.append([mode, fmt(row["td_ms"], 0), f"{row['model']} = {fmt(row['model_ms'], 0)}",
                         fmt(row["ttft_ms"]["p50"], 2), fmt(row["ttft_ms"]["p90"], 2),
                         fmt(row["overhead_p50_ms"], 2), str(row["errors"])])
    out += [table(["mode", "T_d ms", "model ms", "TTFT p50 ms", "TTFT p90 ms", "p50 − model ms", "errors"], rows), ""]
    return out


SCENARIO = Scenario("push", run=run, section=section, add_arguments=add_arguments)
