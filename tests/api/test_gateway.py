"""The whole gateway in one console (api/gateway.py): two proxy replicas in front of one
simulated cluster share a real redis-server; each publishes its summary from a timer and each
console shows both replicas and their sum, a replica that stopped marked so, and a store that
fails costing the summary only."""

import asyncio
import contextlib

import pytest
from cdp import CHROMIUM, Page, in_thread
from helpers import Client, chat_body
from procs import child_proxy, fresh_request
from redis_server import redis_server  # noqa: F401  (the fixture)

from epd_proxy import ProxyConfig, start_proxy
from epd_proxy.runtime.serve import config_for_cluster
from epd_proxy.sim import SimCluster, SimConfig
from epd_proxy.state.store import StoreError


@contextlib.asynccontextmanager
async def replicas(cluster, store_url: str, n: int = 2):
    async with contextlib.AsyncExitStack() as stack:
        out = []
        for _ in range(n):
            config = config_for_cluster(cluster, ProxyConfig(probe_interval=0, state_store=store_url,
                                                             state_store_timeout=0.5))
            proxy = await stack.enter_async_context(await start_proxy(config))
            proxy.app.console.board.read_every = 0  # every console read asks the store
            client = Client(proxy.url)
            stack.push_async_callback(client.close)
            out.append((proxy, client))
        yield out


class Refusing:
    """A store that refuses every call (as one past its budget would be counted)."""

    kind = "redis"

    async def put(self, *args, **kwargs):
        raise StoreError("refused")

    async def ping(self):
        raise StoreError("refused")


async def _gateway(client) -> dict:
    reply = await client.request("GET", "/console/api/state")
    assert reply.status == 200
    return reply.json()["gateway"]


async def test_each_replica_s_console_shows_every_replica_and_their_sum(redis_server):  # noqa: F811
    async with SimCluster(prefill=1, decode=1, config=SimConfig(itl_ms=1, ttft_ms=1)) as cluster:
        async with replicas(cluster, redis_server.url) as ((a, client_a), (b, client_b)):
            for client, n in ((client_a, 3), (client_b, 5)):
                replies = await asyncio.gather(*(client.chat(chat_body(f"q{i}", stream=True)) for i in range(n)))
                assert [r.status for r in replies] == [200] * n
            for proxy in (a, b):  # the timer's next round, now
                assert await proxy.app.console.board.publish()
            for proxy, client in ((a, client_a), (b, client_b)):
                gw = await _gateway(client)
                assert gw["shared"] and gw["scope"] == "gateway" and gw["store"]["up"] and gw["live"] == 2
                rows = {r["listen"]: r for r in gw["replicas"]}
                assert set(rows) == {f"{p.server.host}:{p.server.port}" for p in (a, b)}
                mine = rows[f"{proxy.server.host}:{proxy.server.port}"]
                assert mine["this"] and gw["replicas"][0] is not None and gw["replicas"][0]["this"]
                assert {r["traffic"]["requests_total"] for r in gw["replicas"]} == {3, 5}
                assert gw["sum"]["requests_total"] == 8 and gw["sum"]["rps"] > 0
                assert all(r["state"] == "live" and r["instances"] == 2 and r["instances_in_rotation"] == 2
                           for r in gw["replicas"])
                assert all(r["traffic"]["ttft_p50_ms"] is not None for r in gw["replicas"])
                assert redis_server.url not in repr(gw)  # the store's address is not shown

            # B's timer dies (as with a replica cut off): its summary ages and is marked, not summed.
            board_b = b.app.console.board
            board_b.interval = 0.1
            assert await board_b.publish()
            board_b._task.cancel()
            await asyncio.sleep(0.5)
            gw = await _gateway(client_a)
            states = {r["this"]: r for r in gw["replicas"]}
            assert states[True]["state"] == "live"
            assert states[False]["state"] == "stale" and states[False]["state_text"].startswith("no summary for")
            assert (gw["live"], gw["stopped"], gw["sum"]["requests_total"]) == (1, 1, 3)

        # A replica shut down: its last summary says so (not lost, not summed).
        async with replicas(cluster, redis_server.url) as ((a, client_a), (b, client_b)):
            listen = f"{b.server.host}:{b.server.port}"
            await b.close()
            gw = await _gateway(client_a)
            [gone] = [r for r in gw["replicas"] if r["listen"] == listen]
            assert (gone["state"], gone["state_text"]) == ("stopped", "shut down")
            assert gw["sum"]["requests_total"] == 0


async def test_a_store_that_fails_costs_the_summary_never_a_request(redis_server):  # noqa: F811
    async with SimCluster(prefill=1, decode=1, config=SimConfig(itl_ms=0, ttft_ms=0.5)) as cluster:
        async with replicas(cluster, redis_server.url, n=1) as [(a, client)]:
            board = a.app.console.board
            assert await board.publish()
            # A call of the board's that fails: its own breaker opens, the request path's does not.
            real = board.store.store
            board.store.store = Refusing()
            try:
                assert not await board.publish() and not board.store.up
                assert a.app.state.up and board.failures["publish"] == 1
            finally:  # the real one back, failed or not: the replica's close closes it
                board.store.store = real
            redis_server.stop()
            assert (await client.chat(chat_body())).status == 200
            assert not await board.publish() and board.failures["publish"] >= 1
            assert (await client.chat(chat_body())).status == 200
            gw = await _gateway(client)
            assert gw["store"]["up"] is False and gw["store_answered"] is False
            [me] = gw["replicas"]  # this replica, from what it knows itself
            assert me["this"] and me["traffic"]["requests_total"] == 2
            assert gw["failures"]["publish"] >= 1


async def test_without_a_store_the_console_says_it_shows_one_replica():
    async with SimCluster(prefill=1, decode=1) as cluster:
        config = config_for_cluster(cluster, ProxyConfig(probe_interval=0))
        async with await start_proxy(config) as proxy:
            client = Client(proxy.url)
            try:
                gw = await _gateway(client)
            finally:
                await client.close()
    assert proxy.app.console.board is None
    assert gw == {"shared": False, "scope": "replica",
                  "scope_text": "one replica: this proxy only. Replicas see each other with --state-store redis://…"}


def _gateway_look(url: str, profile: str, shot: str, width: int) -> dict:
    with Page(profile, width, 1600) as page:
        page.open(url)
        page.wait_for("document.querySelectorAll('#replicas tbody tr[data-replica-state=stale]').length === 1")
        page.screenshot(shot)
        return page.evaluate("""(() => ({
          scope: document.getElementById('gateway-scope').textContent,
          summary: document.getElementById('summary').textContent,
          rows: [...document.querySelectorAll('#replicas tbody tr')].map((tr) => ({
            state: tr.dataset.replicaState, self: tr.dataset.this, text: tr.textContent,
            right: Math.max(...[...tr.children].map((c) => c.getBoundingClientRect().right))})),
          sum: document.querySelector('#replicas tfoot tr').textContent,
          width: document.documentElement.clientWidth}))()""")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")
async def test_the_page_shows_the_replicas_side_by_side_their_sum_and_one_that_went_silent(tmp_path, redis_server):  # noqa: F811
    async with SimCluster(prefill=1, decode=1, config=SimConfig(itl_ms=1, ttft_ms=1)) as cluster:
        async with replicas(cluster, redis_server.url, n=3) as ((a, client_a), (b, client_b), (c, _)):
            for client, n in ((client_a, 4), (client_b, 6)):
                replies = await asyncio.gather(*(client.chat(chat_body(f"q{i}", stream=True)) for i in range(n)))
                assert [r.status for r in replies] == [200] * n
            silent = c.app.console.board
            silent.interval = 0.1
            for proxy in (a, b, c):
                assert await proxy.app.console.board.publish()
            silent._task.cancel()  # C's timer stops: its summary ages
            looks = {}
            for width in (1400, 400):
                shot = tmp_path / f"gateway-{width}.png"
                looks[width] = await in_thread(_gateway_look, f"{a.url}/console", str(tmp_path / "profile"),
                                               str(shot), width)
                print(f"\ngateway screenshot at {width} px: {shot}")
            listens = {p: f"{p.server.host}:{p.server.port}" for p in (a, b, c)}
    for width, look in looks.items():
        assert "the gateway" in look["scope"] and "2 replicas live" in look["summary"]
        rows = {r["state"] + (" this" if r["self"] else ""): r for r in look["rows"]}
        assert set(rows) == {"live this", "live", "stale"}, rows
        assert listens[a] in rows["live this"]["text"] and "(this one)" in rows["live this"]["text"]
        assert listens[b] in rows["live"]["text"] and listens[c] in rows["stale"]["text"]
        assert "no summary for" in rows["stale"]["text"]
        assert "All 2 live replicas (1 not publishing, left out)" in look["sum"]
        for row in look["rows"]:  # nothing cut off, at 400 px too
            assert row["right"] <= look["width"] + 0.5, (width, row)


async def test_two_serve_processes_with_workers_one_row_each_their_workers_together(redis_server):  # noqa: F811
    """Two ``epd-proxy serve --workers 2 --state-store`` processes (replicas as deployed): every
    worker publishes, and either replica's console shows two replicas of two workers each."""
    async with SimCluster(prefill=1, decode=1, config=SimConfig(itl_ms=0, ttft_ms=0.5)) as cluster:
        async with child_proxy(cluster, "--workers", "2", "--state-store", redis_server.url) as (_, url_a), \
                child_proxy(cluster, "--workers", "2", "--state-store", redis_server.url) as (_, url_b):
            loop = asyncio.get_running_loop()
            end = loop.time() + 20
            while True:
                gw = (await fresh_request(url_a, "GET", "/console/api/state")).json()["gateway"]
                rows = gw["replicas"]
                if len(rows) == 2 and all(r["workers_publishing"] == 2 for r in rows):
                    break
                assert loop.time() < end, gw
                await asyncio.sleep(0.2)
            assert gw["scope"] == "gateway" and gw["live"] == 2
            ports = {r["listen"].rsplit(":", 1)[1] for r in rows}
            assert ports == {url_a.rsplit(":", 1)[1], url_b.rsplit(":", 1)[1]}
            assert [r["this"] for r in rows] == [True, False]
            assert all(r["workers"] == 2 and r["instances"] == 2 for r in rows)
