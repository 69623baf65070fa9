"""The fair queue in front of admission, over real sockets and deterministic: the test holds
the only admission slot itself while requests queue, then lets go; with one slot, requests
reach the instance one at a time, in the order the queue hands the slot over."""

import asyncio
from contextlib import asynccontextmanager

from helpers import Client, chat_body, stack, wait_for

from epd_proxy.sim import SimConfig

SIM = SimConfig(itl_ms=0, ttft_ms=0.5)


def bearer(secret: str) -> list:
    return [(b"authorization", f"Bearer {secret}".encode())]


@asynccontextmanager
async def clients_of(url: str):
    """A new client per request (each its own connection, so one can leave alone); all closed after."""
    clients: list[Client] = []

    def client_for() -> Client:
        clients.append(Client(url))
        return clients[-1]
    try:
        yield client_for
    finally:
        for c in clients:
            await c.close()


def keys(tmp_path) -> str:
    path = tmp_path / "keys"
    path.write_text("flood:s-flood\nagent:s-agent\nbatch:s-batch\nheavy:s-heavy\n")
    return str(path)


TENANTS = {"keys": [{"name": "flood", "class": "standard"}, {"name": "agent", "class": "critical"},
                    {"name": "batch", "class": "sheddable"}, {"name": "heavy", "class": "standard", "weight": 3}]}


def order(cluster) -> list[str]:
    """Who each served request was from (the prompt names its key), in arrival order."""
    import msgspec
    return [msgspec.json.decode(r.body)["messages"][0]["content"].split()[0]
            for r in cluster.instances("pd")[0].generation_records()]


async def _queued(proxy, client_for, n: int, secret: str, text: str) -> list[asyncio.Future]:
    adm = proxy.app.pipeline.admission
    start = adm.waiting
    futs = []
    for i in range(n):
        futs.append(asyncio.ensure_future(client_for().chat(chat_body(f"{text} {i}", max_tokens=2), bearer(secret))))
        await wait_for(lambda want=start + i + 1: adm.waiting == want)  # queued in this order
    return futs


async def test_a_critical_key_goes_ahead_of_a_flood_and_a_sheddable_one_is_refused(tmp_path):
    async with stack(sim=SIM, pd=1, prefill=0, decode=0, api_key_file=keys(tmp_path), tenants=TENANTS,
                     max_inflight=1, queue_size=64, queue_timeout=30) as (cluster, proxy, _), \
            clients_of(proxy.url) as client_for:
        adm = proxy.app.pipeline.admission
        assert adm.try_enter() == 0  # the test holds the only slot
        flood = await _queued(proxy, client_for, 10, "s-flood", "flood")
        agent = await _queued(proxy, client_for, 1, "s-agent", "agent")
        # A sheddable request finds no free slot: refused at once, not queued.
        shed = await client_for().chat(chat_body("batch", max_tokens=2), bearer("s-batch"))
        assert shed.status == 429 and adm.shed_by_class == {"sheddable": 1}
        # A client that leaves while queued gives its key's place back.
        gone = client_for()
        left = await _queued(proxy, lambda: gone, 1, "s-heavy", "gone")
        assert proxy.app.pipeline.tenants.concurrent["heavy"] == 1
        left[0].cancel()  # its connection is closed
        await wait_for(lambda: "heavy" not in proxy.app.pipeline.tenants.concurrent)
        assert adm.waiting == 11
        adm.leave()  # the slot goes to the queue
        replies = await asyncio.gather(*flood, *agent)
        assert all(r.status == 200 for r in replies)
        assert order(cluster)[0] == "agent"  # not behind the flood's ten
        await wait_for(lambda: proxy.app.pipeline.tenants.concurrent == {})


async def test_keys_of_a_class_share_by_weight_and_a_full_queue_gives_up_the_lowest_class(tmp_path):
    async with stack(sim=SIM, pd=1, prefill=0, decode=0, api_key_file=keys(tmp_path), tenants=TENANTS,
                     max_inflight=1, queue_size=16, queue_timeout=30) as (cluster, proxy, _), \
            clients_of(proxy.url) as client_for:
        adm = proxy.app.pipeline.admission
        assert adm.try_enter() == 0
        futs = await _queued(proxy, client_for, 8, "s-flood", "flood")
        futs += await _queued(proxy, client_for, 8, "s-heavy", "heavy")
        # The queue is full (16): a critical newcomer takes the place of the newest waiter of
        # the lowest class's most backlogged key (both standard, 8 each: flood's last, the
        # first most backlogged found), which gets 429.
        agent = asyncio.ensure_future(client_for().chat(chat_body("agent", max_tokens=2), bearer("s-agent")))
        await wait_for(lambda: adm.displaced == 1)
        adm.leave()
        replies = await asyncio.gather(*futs, agent)
        assert sorted(r.status for r in replies) == [200] * 16 + [429]
        served = order(cluster)
        assert served[0] == "agent"
        # Within the standard class, heavy (weight 3) and flood (1) share 3 : 1 while both wait.
        first8 = served[1:9]
        assert first8.count("heavy") == 6 and first8.count("flood") == 2, served
