"""The limiter's shell on its own: the concurrent place taken before the store is asked, given
back when the store refuses; settling without usage gives the estimate back."""

import asyncio

import pytest

from epd_proxy.tenants.counters import LocalCounters
from epd_proxy.tenants.limiter import Tenants
from epd_proxy.tenants.table import read_tenants
from epd_proxy.wire.errors import ProxyError


class GatedCounters(LocalCounters):
    """In-process counters that answer only when the test opens the gate (a slow store)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def take(self, hits):
        await self.gate.wait()
        return self.take_now(hits)


async def test_the_last_concurrent_place_is_taken_before_the_store_answers():
    store = GatedCounters()
    tenants = Tenants(read_tenants({"keys": [{"name": "a", "concurrent": 1, "requests_per_minute": 1}]}), None,
                      store)
    tenants.local = None  # ask it as a shared store is asked
    first = asyncio.ensure_future(tenants.enter("a", False, 100, {}))
    await asyncio.sleep(0)
    with pytest.raises(ProxyError) as err:
        await asyncio.wait_for(tenants.enter("a", False, 100, {}), 2)  # while the first waits for the store
    assert err.value.status == 429 and "concurrent" in err.value.message
    store.gate.set()
    ticket = await first
    tenants.leave(ticket, 200, (None, None, None))
    with pytest.raises(ProxyError) as err:  # the minute's one request is used: refused, place given back
        await tenants.enter("a", False, 100, {})
    assert "requests per minute" in err.value.message and tenants.concurrent == {}


async def test_a_failed_answer_without_usage_gives_its_estimate_back():
    tenants = Tenants(read_tenants({"keys": [{"name": "a", "input_tokens_per_minute": 1000}]}))
    ticket = await tenants.enter("a", False, 2000, {})  # 500 tokens estimated
    assert ticket.values == [500]
    tenants.leave(ticket, 502, (None, None, None))
    assert (await tenants.status())["keys"]["a"]["limits"]["input_tokens_per_minute"]["used"] == 0
    ticket = await tenants.enter("a", False, 2000, {})
    tenants.leave(ticket, 200, (None, None, None))  # answered, usage unknown: the estimate stands
    assert (await tenants.status())["keys"]["a"]["limits"]["input_tokens_per_minute"]["used"] == 500
