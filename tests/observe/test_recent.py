"""The console's ring (recent.py): off until a console looks, off again after, bounded, and
holding no more of a request than the access log shows."""

from epd_proxy.config import InstanceSpec
from epd_proxy.http.client import ConnectionPool
from epd_proxy.instances.instance import Instance
from epd_proxy.observe.recent import RecentRequests, summary
from epd_proxy.observe.record import RequestRecord
from epd_proxy.request.context import RequestContext


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _instance(role: str, url: str) -> Instance:
    return Instance(InstanceSpec(url=url, role=role), ConnectionPool(url))


def _record(rid: str = "r1") -> RequestRecord:
    """(Instances hold a connection pool: built inside a running event loop, as in the proxy.)"""
    rec = RequestRecord(rid, "POST", "/v1/chat/completions", 0.0, peer=("10.0.0.9", 5555),
                        headers={b"authorization": b"Bearer secret"}, key="tenant-a")
    rec.model, rec.stream, rec.outcome = "m", True, "ok"
    rec.first_byte, rec.gap, rec.items = 0.020, 0.002, 2
    ctx = rec.ctx = RequestContext(rid, rec.path, [])
    p, d1, d2 = _instance("prefill", "http://p:1"), _instance("decode", "http://d:1"), _instance("decode", "http://d:2")
    for inst in (p, d1, d2):
        ctx.legs.append(inst)
    ctx.failed(d1)
    ctx.timing("prefill", 0.010)
    ctx.timing("decode_first", 0.005)
    return rec


async def test_a_summary_holds_what_the_access_log_shows_and_no_more():
    s = summary(_record(), 200, (30, 8, 16), 999, 0.05, 1234.5)
    assert s["legs"] == [["prefill", "http://p:1", False], ["decode", "http://d:1", True],
                         ["decode", "http://d:2", False]]
    assert s["stages_ms"] == {"prefill": 10.0, "decode_first": 5.0}
    assert (s["first_byte_ms"], s["itl_ms"], s["total_ms"]) == (20.0, 2.0, 50.0)
    assert (s["prompt_tokens"], s["completion_tokens"], s["cached_tokens"], s["items"]) == (30, 8, 16, 2)
    assert s["kv_outcome"] is None  # not looked up for multi-turn KV reuse
    rec = _record()
    rec.ctx.kv_outcome = "reused"
    assert summary(rec, 200, (30, 8, 16), 999, 0.05, 1234.5)["kv_outcome"] == "reused"
    text = repr(s)
    assert "secret" not in text and "10.0.0.9" not in text and "tenant-a" not in text


async def test_off_until_a_console_looks_and_off_again_after_the_watch():
    clock = Clock()
    ring = RecentRequests(capacity=4, watch_seconds=30, clock=clock, wall=clock)
    assert not ring.on
    ring.look()
    assert ring.on and ring.since == 100.0
    ring.add(_record("a"), 200, (1, 1, None), 1, 0.01)
    clock.t += 29
    ring.add(_record("b"), 200, (1, 1, None), 1, 0.01)
    assert [s["id"] for s in ring.records()] == ["a", "b"]
    clock.t += 2  # nobody looked for 31 s: recording stops and the ring is emptied
    ring.add(_record("c"), 200, (1, 1, None), 1, 0.01)
    assert not ring.on and ring.records() == []


async def test_bounded_and_found_by_id_newest_first():
    clock = Clock()
    ring = RecentRequests(capacity=3, clock=clock, wall=clock)
    ring.look()
    for rid in ("x", "y", "x", "z"):
        clock.t += 1
        ring.add(_record(rid), 200, (1, 1, None), 1, 0.01)
    assert ring.saturated
    assert [s["id"] for s in ring.records()] == ["y", "x", "z"]
    assert [s["end"] for s in ring.find("x")] == [103.0]
    assert ring.oldest == 102.0 and [s["id"] for s in ring.records(since=103.0)] == ["x", "z"]
    assert [s["id"] for s in ring.latest(2)] == ["x", "z"]
    ring.add_refused("q", "POST", "/v1/chat/completions", 429, 0.001)
    assert ring.find("q")[0]["status"] == 429 and ring.find("q")[0]["legs"] == []


async def test_a_summary_says_where_each_leg_was_placed_and_why():
    from epd_proxy.placement.decision import Placement
    rec = _record()
    d, p = rec.ctx.legs[2], rec.ctx.legs[0]
    rec.ctx.placement = Placement(d, "least-loaded", p, "round-robin", connector="nixl")
    s = summary(rec, 200, (30, 8, 16), 999, 0.05, 1234.5)
    assert s["placement"] == {"decode": {"instance": "http://d:2", "why": "least-loaded"},
                              "prefill": {"instance": "http://p:1", "why": "round-robin"},
                              "kv_from": None, "connector": "nixl", "rank": None}
    assert summary(_record(), 200, (30, 8, 16), 999, 0.05, 1234.5)["placement"] is None
