"""DNS discovery: the pure rules, and lookups against a real DNS server (dnsmasq)."""

import asyncio

import pytest
from dnsmasq import dnsmasq  # noqa: F401  (fixture)
from helpers import Client, chat_body, wait_for

from epd_proxy import ProxyConfig, start_proxy
from epd_proxy.config import InstanceSpec
from epd_proxy.instances.discovery import (
    MIN_INTERVAL,
    DnsDiscovery,
    Resolver,
    instances_for,
    next_delay,
    parse_server,
    source_of,
)
from epd_proxy.sim import SimCluster, SimConfig

TEMPLATE = InstanceSpec("http://decode.svc.test:8200", "decode", tp=2)


def test_each_address_is_an_instance_with_the_templates_port_and_attributes():
    specs = instances_for(TEMPLATE, ["127.0.0.3", "127.0.0.2", "127.0.0.3", "::1"])
    assert [s.url for s in specs] == ["http://127.0.0.2:8200", "http://127.0.0.3:8200", "http://[::1]:8200"]
    assert all(s.role == "decode" and s.tp == 2 for s in specs)
    assert instances_for(TEMPLATE, []) == []


def test_the_next_lookup_honours_a_shorter_ttl_within_bounds():
    assert next_delay(None, 10) == 10
    assert next_delay(30, 10) == 10
    assert next_delay(3, 10) == 3
    assert next_delay(0, 10) == MIN_INTERVAL
    assert next_delay(0, 0.5) == 0.5  # the interval is the longest wait, whatever the TTL


@pytest.mark.parametrize("text, want", [("127.0.0.1:5353", ("127.0.0.1", 5353)), ("10.96.0.10", ("10.96.0.10", 53)),
                                        ("[::1]:53", ("::1", 53))])
def test_dns_server_parses(text, want):
    assert parse_server(text) == want


@pytest.mark.parametrize("text", ["dns.local:53", "127.0.0.1:0", "127.0.0.1:x"])
def test_bad_dns_server_is_explained(text):
    with pytest.raises(ValueError, match="--dns-server"):
        parse_server(text)


async def test_discovery_follows_the_record(dnsmasq):  # noqa: F811
    dnsmasq.set("decode.svc.test", ["127.0.0.2", "127.0.0.3"])
    applied = []
    discovery = DnsDiscovery(lambda specs, source: applied.append((source, [s.url for s in specs])),
                             interval=0.05, server=dnsmasq.server)
    discovery.set_targets([TEMPLATE])
    try:
        await wait_for(lambda: applied, timeout=5)
        assert applied[0] == (source_of(TEMPLATE), ["http://127.0.0.2:8200", "http://127.0.0.3:8200"])
        lookups = discovery.lookups
        await wait_for(lambda: discovery.lookups >= lookups + 2, timeout=5)
        assert len(applied) == 1  # the same answer is no change
        dnsmasq.set("decode.svc.test", ["127.0.0.3", "127.0.0.4"])
        await wait_for(lambda: len(applied) == 2, timeout=5)
        assert applied[1][1] == ["http://127.0.0.3:8200", "http://127.0.0.4:8200"]
        dnsmasq.set("decode.svc.test", [])
        await wait_for(lambda: len(applied) == 3, timeout=5)
        assert applied[2][1] == []
        # No longer followed: its instances leave.
        dnsmasq.set("decode.svc.test", ["127.0.0.2"])
        await wait_for(lambda: len(applied) == 4, timeout=5)
        discovery.set_targets([])
        assert applied[-1] == (source_of(TEMPLATE), [])
    finally:
        await discovery.close()


async def test_a_failed_lookup_keeps_the_known_instances(dnsmasq):  # noqa: F811
    dnsmasq.set("decode.svc.test", ["127.0.0.2"])
    applied = []
    discovery = DnsDiscovery(lambda specs, source: applied.append([s.url for s in specs]), interval=0.05,
                             server=dnsmasq.server)
    discovery.resolver = Resolver(dnsmasq.server, timeout=0.2)
    assert await discovery.refresh(TEMPLATE) <= 1.0
    dnsmasq.close()  # the server is gone: lookups time out
    await discovery.refresh(TEMPLATE)
    assert discovery.failures == 1 and applied == [["http://127.0.0.2:8200"]]


async def test_the_proxy_follows_a_dns_record_change(dnsmasq):  # noqa: F811
    """Decode instances on 127.0.0.2 and 127.0.0.3 (the same port) behind one name: a new
    address gets traffic, a vanished one is drained and leaves once its stream is done."""
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, roles={"decode": {"itl_ms": 5}})
    async with SimCluster(decode=1, config=sim, host="127.0.0.2") as first:
        port = int(first.urls("decode")[0].rsplit(":", 1)[1])
        async with SimCluster(decode=1, config=sim, host="127.0.0.3", base_port=port) as second:
            (one,), (two,) = first.instances("decode"), second.instances("decode")
            dnsmasq.set("decode.svc.test", ["127.0.0.2"])
            template = InstanceSpec(f"http://decode.svc.test:{port}", "decode")
            # least-loaded: the same prompt each time, and the new address must get some of it
            config = ProxyConfig(probe_interval=0, discover=[template], dns_interval=0.05,
                                 dns_server=dnsmasq.server, routing="least-loaded")
            async with await start_proxy(config) as proxy:
                client = Client(proxy.url)
                try:
                    roster = proxy.app.pools["decode"]
                    await wait_for(lambda: [i.url for i in roster.instances] == [one.url])
                    assert (await client.chat(chat_body())).status == 200 and len(one.generation_records()) == 1
                    # A second address: it gets traffic.
                    dnsmasq.set("decode.svc.test", ["127.0.0.2", "127.0.0.3"])
                    await wait_for(lambda: len(roster.instances) == 2)
                    for _ in range(4):
                        assert (await client.chat(chat_body())).status == 200
                    assert len(two.generation_records()) >= 1
                    # The first one vanishes with a stream in flight: drained, the stream ends whole.
                    stream = asyncio.ensure_future(client.chat(chat_body(stream=True, max_tokens=200), timeout=30))
                    await wait_for(lambda: one._in_flight == 1 or two._in_flight == 1)
                    busy = one if one._in_flight else two
                    dnsmasq.set("decode.svc.test", ["127.0.0.3" if busy is one else "127.0.0.2"])
                    await wait_for(lambda: roster.find(busy.url) is None or roster.find(busy.url).state == "draining")
                    before = len(busy.generation_records())
                    for _ in range(3):
                        assert (await client.chat(chat_body())).status == 200
                    assert len(busy.generation_records()) == before  # no new request for it
                    reply = await stream
                    assert reply.status == 200 and reply.events[-1] == b"data: [DONE]" and len(reply.events) > 200
                    await wait_for(lambda: roster.find(busy.url) is None)
                    assert proxy.app.membership.snapshot()["decode"]["live"] == [
                        (two if busy is one else one).url]
                    metrics = (await client.request("GET", "/metrics")).body
                    assert b'epd_proxy_dns_lookups_total{result="ok"}' in metrics
                    assert b'epd_proxy_dns_lookups_total{result="failed"} 0.0' in metrics
                finally:
                    await client.close()
