"""Pure: the gateway's summaries read as replicas side by side (api/gateway_view.py)."""

from epd_proxy.api.gateway_view import STALE_AFTER, bucket_quantile, gateway, totals, traffic

BOUNDS = (0.01, 0.1, 1.0)


def test_a_histogram_s_quantile_is_interpolated_in_its_bucket_as_prometheus_does():
    assert bucket_quantile(BOUNDS, [0, 0, 0, 0], 0.5) is None
    assert bucket_quantile(BOUNDS, [0, 10, 0, 0], 0.5) == 0.01 + (0.1 - 0.01) * 0.5
    assert bucket_quantile(BOUNDS, [10, 0, 0, 0], 1.0) == 0.01
    assert bucket_quantile(BOUNDS, [0, 0, 0, 3], 0.5) == 1.0  # above every bound: the largest


def test_traffic_between_two_summaries_is_rates_and_the_latest_latencies():
    before = totals({("/v1/chat/completions", 200): 10}, 0, [[0, 10, 0, 0]], [10, 0, 0, 0], 100)
    now = totals({("/v1/chat/completions", 200): 30, ("/v1/chat/completions", 503): 4,
                  ("/v1/completions", 200): 6}, 1, [[0, 10, 0, 0], [0, 0, 20, 0]], [30, 0, 0, 0], 500)
    assert (now["requests"], now["errors"], now["ttft"]) == (40, 5, [0, 10, 20, 0])
    t = traffic(now, before, 2.0, 7, BOUNDS)
    assert (t["rps"], t["errors_per_s"], t["tokens_out_per_s"], t["inflight"]) == (15.0, 2.5, 200.0, 7)
    assert t["ttft_p50_ms"] == 550.0  # only the new observations: all in (0.1, 1]
    assert traffic(now, None, 4.0, 0, BOUNDS)["rps"] == 10.0


def _summary(rid, host, port, published, requests, *, worker=None, out=(), interval=5.0, stopping=False):
    instances = [{"url": u, "role": "decode", "state": "ejected" if u in out else "healthy",
                  "in_rotation": u not in out, "reason": "boom" if u in out else None, "inflight": 0}
                 for u in ("http://d1", "http://d2")]
    t = {"rps": requests / 10, "errors_per_s": 0.0, "tokens_out_per_s": 1.0, "inflight": 1, "requests_total": requests,
         "errors_total": 0, "ttft_p50_ms": 10.0 * rid, "ttft_p99_ms": 20.0, "itl_p50_ms": None}
    return {"id": rid, "published": published, "interval": interval, "stopping": stopping, "traffic": t,
            "instances": instances,
            "identity": {"host": host, "listen": f"0.0.0.0:{port}", "pid": 100 + rid, "proxy_pid": port,
                         "worker": worker, "workers": 2 if worker is not None else 1, "version": "1",
                         "started": 0.0}}


def test_replicas_side_by_side_their_workers_together_a_silent_one_marked_and_left_out_of_the_sum():
    now = 1000.0
    summaries = [
        _summary(1, "pod-a", 8000, now - 1, 10, worker=0),
        _summary(2, "pod-a", 8000, now - 2, 20, worker=1, out=("http://d2",)),
        _summary(3, "pod-b", 8000, now - 3, 5),
        _summary(4, "pod-c", 8000, now - 5.0 * STALE_AFTER - 1, 99),  # stopped publishing
        _summary(5, "pod-d", 8000, now - 1, 7, stopping=True),
    ]
    gw = gateway(summaries, now, me=3, store={"kind": "redis", "up": True, "down_since": None}, failures={})
    rows = {r["host"]: r for r in gw["replicas"]}
    assert gw["replicas"][0]["host"] == "pod-b" and rows["pod-b"]["this"]  # this replica first
    a = rows["pod-a"]
    assert (a["workers_publishing"], a["traffic"]["requests_total"], a["traffic"]["rps"]) == (2, 30, 3.0)
    assert (a["instances"], a["instances_in_rotation"]) == (2, 1)  # out in one worker: out for the replica
    assert a["out"] == [{"url": "http://d2", "role": "decode", "state": "ejected", "reason": "boom"}]
    assert a["traffic"]["ttft_p50_ms"] == 20.0  # percentiles do not add: the worst part's
    assert rows["pod-c"]["state"] == "stale" and "no summary for 16 s" in rows["pod-c"]["state_text"]
    assert (rows["pod-d"]["state"], rows["pod-d"]["state_text"]) == ("stopped", "shut down")
    assert (gw["live"], gw["stopped"]) == (2, 2)
    assert gw["sum"]["requests_total"] == 35 and gw["sum"]["inflight"] == 3
    # d2 is out in pod-a, in rotation in pod-b: the replicas disagree about it.
    assert [d["url"] for d in gw["disagree"]] == ["http://d2"]
    assert gw["scope"] == "gateway"
