"""How the load generator sends one request: to one URL, or as a client-side E→P→D.

``UrlClient`` is the normal case. ``StagesClient`` runs the disaggregated flow
itself — the encoder call, the prefill call, then the decode call — against
the instances directly, with the bodies the proxy would send (built with the
proxy's own pure functions). It is the "no proxy, same backend work" baseline:
the difference between it and a proxy is the proxy, the difference between it
and the decode alone is the disaggregation.
"""

from __future__ import annotations

import math
import time

import msgspec

from epd_proxy.bench.exchange import Outcome, send
from epd_proxy.bench.workloads import Prepared
from epd_proxy.http.client import ConnectionPool
from epd_proxy.http.transport import TransportTimeouts, UpstreamError

perf = time.perf_counter
_HEADERS = [(b"content-type", b"application/json")]


class UrlClient:
    def __init__(self, url: str, *, max_idle: int = 256) -> None:
        self.url = url
        self.max_idle = max_idle
        self.pool: ConnectionPool | None = None

    async def start(self) -> None:
        self.pool = ConnectionPool(self.url, idle_timeout=2.0, max_idle=self.max_idle)

    async def send(self, prep: Prepared, timeouts: TransportTimeouts, verify: bool = True) -> Outcome:
        assert self.pool is not None, "not started"
        return await send(self.pool, prep, timeouts, verify=verify)

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()


class StageError(Exception):
    pass


async def _post_json(pool: ConnectionPool, path: str, body: dict, timeouts: TransportTimeouts) -> dict:
    resp = await pool.request("POST", path, body=msgspec.json.encode(body), headers=_HEADERS, timeouts=timeouts)
    try:
        data = await resp.read()
    finally:
        resp.close()
    if resp.status != 200:
        raise StageError(f"HTTP {resp.status}: {data[:160].decode('utf-8', 'replace')}")
    return msgspec.json.decode(data)


async def run_stages(pools: dict, prep: Prepared, timeouts: TransportTimeouts, *, verify: bool = True,
                     keep_text: bool = False) -> tuple[dict, Outcome]:
    """E (if the body has media and there is an encoder), P, then D. Returns the stage
    times (seconds; ``decode_ttft`` from D's send) and D's outcome."""
    from epd_proxy.encode.ec_match import consumer_ec_params, match_encoder_output, rewrite_media
    from epd_proxy.encode.encoder_plan import encoder_body, new_transfer_id, plan_sub_requests
    from epd_proxy.encode.multimodal import collect_media
    from epd_proxy.request.apis import GENERATION_APIS
    from epd_proxy.request.legs.stage_bodies import decode_body, nixl_prefill_request_params, prefill_body

    body = prep.obj
    times = {"encode": 0.0, "prefill": 0.0, "decode_ttft": math.nan}
    consumer = body
    # The workloads' other APIs carry text only (workloads.py).
    items = collect_media(body) if pools.get("encode") is not None and prep.path not in GENERATION_APIS else []
    if items:
        t0 = perf()
        subs = plan_sub_requests(items, [0] * len(items), 0)
        results: list = [None] * len(items)
        handles: dict = {}
        for sub in subs:
            tids = [new_transfer_id() for _ in sub.items]
            eb = encoder_body(body, sub, rewrite=True, transfer_ids=tids, consumer_zmq=None)
            reply = await _post_json(pools["encode"], prep.path, eb, timeouts)
            res, h = match_encoder_output(sub, tids, reply.get("ec_transfer_params"))
            for item, r in zip(sub.items, res):
                results[item.index] = r
            handles.update(h)
        times["encode"] = perf() - t0
        consumer = rewrite_media(body, items, results)
        ec = consumer_ec_params(items, results, handles)
        if ec is not None:
            consumer["ec_transfer_params"] = ec
    kv = None
    if pools.get("prefill") is not None:
        t0 = perf()
        reply = await _post_json(pools["prefill"], prep.path, prefill_body(consumer, nixl_prefill_request_params(),
                                                                       GENERATION_APIS.get(prep.path)),
                                 timeouts)
        times["prefill"] = perf() - t0
        kv = reply.get("kv_transfer_params")
        consumer = decode_body(consumer, kv=kv)
    d = Prepared(prep.kind, prep.path, msgspec.json.encode(consumer), prep.stream, prep.expected, {})
    o = await send(pools["decode"], d, timeouts, verify=verify, keep_text=keep_text)
    if o.ttft is not None:
        times["decode_ttft"] = o.ttft
    return times, o


async def send_stages(pools: dict, prep: Prepared, timeouts: TransportTimeouts, *, verify: bool = True,
                      keep_text: bool = False) -> Outcome:
    """:func:`run_stages` as one request: its outcome timed from the first stage's send;
    never raises except on cancellation."""
    t0 = perf()
    try:
        _, o = await run_stages(pools, prep, timeouts, verify=verify, keep_text=keep_text)
    except (StageError, UpstreamError, msgspec.DecodeError) as exc:
        o = Outcome(prep.kind, t0)
        o.t_end = perf()
        o.error = f"stage: {exc}"[:200]
        return o
    # The whole flow is the request: time from the first stage's send.
    if o.ttft is not None:
        o.ttft += o.t_send - t0
    o.t_send = t0
    return o


class StagesClient:
    """Client-side E→P→D against the instances (no proxy)."""

    def __init__(self, encode: str | None, prefill: str | None, decode: str, *, max_idle: int = 256) -> None:
        self.urls = {"encode": encode, "prefill": prefill, "decode": decode}
        self.max_idle = max_idle
        self.pools: dict = {}

    async def start(self) -> None:
        self.pools = {k: ConnectionPool(u, idle_timeout=2.0, max_idle=self.max_idle) if u else None
                      for k, u in self.urls.items()}

    async def send(self, prep: Prepared, timeouts: TransportTimeouts, verify: bool = True) -> Outcome:
        return await send_stages(self.pools, prep, timeouts, verify=verify)

    async def close(self) -> None:
        for p in self.pools.values():
            if p is not None:
                await p.close()
