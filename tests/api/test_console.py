"""The console's routes (console.py) over real sockets: the page, the state JSON in front of a
simulated cluster, an instance made to fail, a request found by its id, the roster's access
rule, and --workers answering for the whole proxy."""

import asyncio
import logging

import msgspec
from cdp import CHROMIUM, Page, in_thread
from helpers import JSON, chat_body, stack, wait_for
from procs import child_proxy, fresh_request
from redis_server import redis_server  # noqa: F401  (the fixture)

from epd_proxy.api.gateway import READ_EVERY
from epd_proxy.sim import SimCluster, SimConfig, expected_text


async def test_the_page_is_served_from_the_package_and_holds_no_data():
    async with stack() as (_, proxy, client):
        page = await client.request("GET", "/console")
        assert page.status == 200 and page.headers[b"content-type"].startswith(b"text/html")
        assert b"/console/console.js" in page.body and proxy.url.encode() not in page.body
        assert b"default-src 'self'" in page.headers[b"content-security-policy"]
        for asset, kind in (("/console/console.js", b"text/javascript"), ("/console/console.css", b"text/css")):
            reply = await client.request("GET", asset)
            assert reply.status == 200 and reply.headers[b"content-type"].startswith(kind) and reply.body
        assert (await client.request("POST", "/console/api/state")).status == 405  # read-only


async def test_nothing_is_recorded_until_a_console_looks():
    async with stack() as (_, proxy, client):
        assert (await client.chat(chat_body(), headers=[(b"x-request-id", b"unseen")])).status == 200
        assert not proxy.app.pipeline.recent.on
        state = (await client.request("GET", "/console/api/state")).json()
        assert state["recent"] == [] and state["traffic"]["models"]["*"]["requests"] == 0
        assert (await client.chat(chat_body(), headers=[(b"x-request-id", b"seen")])).status == 200
        assert [s["id"] for s in (await client.request("GET", "/console/api/state")).json()["recent"]] == ["seen"]


async def test_state_shows_every_instance_the_traffic_and_a_failed_instance():
    async with stack(encode=1, prefill=1, decode=2) as (cluster, _, client):
        first = (await client.request("GET", "/console/api/state")).json()
        assert first["read_only"] and first["proxy"]["topology"] == "E+P+D"
        assert first["recent"] == []  # nothing recorded before a console looked
        assert {(i["role"], i["state"]) for i in first["instances"]} == {
            ("encode", "healthy"), ("prefill", "healthy"), ("decode", "healthy")}
        broken = cluster.instances("decode")[1]
        await broken.crash()
        replies = await asyncio.gather(*(
            client.chat(chat_body(stream=True, images=["https://example.com/cat.png"]),
                        headers=[(b"x-request-id", b"console-%d" % i)]) for i in range(6)))
        assert [r.status for r in replies] == [200] * 6
        state = (await client.request("GET", "/console/api/state")).json()
        by_url = {i["url"]: i for i in state["instances"]}
        assert by_url[broken.url]["state"] == "ejected" and by_url[broken.url]["state_text"] == "out: ejected"
        assert "cannot connect" in by_url[broken.url]["reason"]
        assert all(i["state"] == "healthy" for url, i in by_url.items() if url != broken.url)
        encoder = by_url[cluster.urls("encode")[0]]
        assert encoder["media"] == {"items": 6, "repeats_home": 5}  # one image, six times, one encoder
        every = state["traffic"]["models"]["*"]
        assert every["requests"] == 6 and every["rps"] > 0 and every["ttft_ms"]["n"] == 6
        assert every["encoder_items_per_s"] > 0 and every["kv_transfers_per_s"] > 0
        assert every["retried_per_s"] > 0  # the requests the crashed decode failed, answered elsewhere
        assert state["traffic"]["models"]["sim-model"]["requests"] == 6
        assert {s["id"] for s in state["recent"]} == {f"console-{i}" for i in range(6)}

        found = (await client.request("GET", "/console/api/request?id=console-3")).json()
        [one] = found["requests"]
        assert [leg[0] for leg in one["legs"] if not leg[2]] == ["encode", "prefill", "decode"]
        assert [w["stage"] for w in one["waterfall"]][:3] == ["encode", "prefill", "decode"]
        assert (await client.request("GET", "/console/api/request?id=nobody")).json()["requests"] == []


async def test_the_json_is_the_roster_s_the_page_is_open():
    async with stack(admin_api_key="adm") as (_, _proxy, client):
        assert (await client.request("GET", "/console")).status == 200
        refused = await client.request("GET", "/console/api/state")
        assert refused.status == 401 and b"admin API key" in refused.body
        assert (await client.request("GET", "/console/api/request?id=x")).status == 401
        wrong = await client.request("GET", "/console/api/state", headers=[(b"x-api-key", b"nope")])
        assert wrong.status == 403
        ok = await client.request("GET", "/console/api/state", headers=[(b"x-api-key", b"adm")])
        assert ok.status == 200 and ok.json()["proxy"]["admin_key"] is True
    async with stack(api_keys=("client",)) as (_, _proxy, client):  # client keys, no admin key
        assert (await client.request("GET", "/console/api/state",
                                     headers=[(b"authorization", b"Bearer client")])).status == 403


async def test_with_workers_the_state_answers_for_the_whole_proxy():
    async with SimCluster(prefill=1, decode=1, config=SimConfig(itl_ms=0, ttft_ms=0.5, kv_events=True)) as cluster:
        async with child_proxy(cluster, "--workers", "2") as (_, url):
            loop = asyncio.get_running_loop()
            end = loop.time() + 10
            while (await fresh_request(url, "GET", "/console/api/state")).json()["workers"] != 2:
                assert loop.time() < end, "the workers never all answered"
                await asyncio.sleep(0.05)
            for _ in range(4):  # fresh connections: each worker is asked, and each starts recording
                await fresh_request(url, "GET", "/console/api/state")

            def publishing(state: dict) -> int:
                return sum(r["workers_publishing"] for r in state["gateway"]["replicas"])

            # Each worker publishes its summary on its own period and reads the board at most
            # every so often (a view it keeps a moment): until both workers' views show both.
            while publishing((await fresh_request(url, "GET", "/console/api/state")).json()) != 2:
                assert loop.time() < end, "the workers never both published"
                await asyncio.sleep(0.05)
            await asyncio.sleep(READ_EVERY)  # the other worker's kept view, read before, expires
            body = msgspec.json.encode(chat_body(max_tokens=2))
            n = 12
            replies = await asyncio.gather(*(fresh_request(url, "POST", "/v1/chat/completions", body,
                                                           JSON + [(b"x-request-id", b"w-%d" % i)])
                                             for i in range(n)))
            assert [r.status for r in replies] == [200] * n
            for _ in range(4):
                state = (await fresh_request(url, "GET", "/console/api/state")).json()
                assert state["workers"] == 2 and state["traffic"]["models"]["*"]["requests"] == n
                assert {s["id"] for s in state["recent"]} == {f"w-{i}" for i in range(n)}
                decode = [i for i in state["instances"] if i["role"] == "decode"][0]
                assert decode["workers"] == 2 and decode["requests"] == n
                kv = decode["kv_events"]  # each worker subscribes itself: connected in both
                assert (kv["state"], kv["workers"], kv["workers_connected"]) == ("connected", 2, 2), kv
                assert decode["kv_reuse"] == {"keeps_blocks": False, "held_tokens": 0, "held_conversations": 0,
                                                "kv_budget": None}
                found = (await fresh_request(url, "GET", "/console/api/request?id=w-7")).json()
                assert len(found["requests"]) == 1
                # Both workers publish their summary to the parent's table: one proxy, two workers.
                gw = state["gateway"]
                assert gw["shared"] and gw["scope"] == "proxy" and gw["scope_text"].startswith("one proxy")
                [replica] = gw["replicas"]
                assert (replica["workers"], replica["workers_publishing"], replica["state"]) == (2, 2, "live"), gw


async def test_requests_shed_at_admission_count_as_errors_by_kind():
    sim = SimConfig(itl_ms=0, ttft_ms=200)
    async with stack(sim=sim, max_inflight=1, queue_size=0) as (_, _proxy, client):
        await client.request("GET", "/console/api/state")
        replies = await asyncio.gather(*(client.chat(chat_body(), headers=[(b"x-request-id", b"shed-%d" % i)])
                                         for i in range(3)))
        assert sorted(r.status for r in replies) == [200, 429, 429]
        state = (await client.request("GET", "/console/api/state")).json()
        assert set(state["traffic"]["models"]["*"]["errors_per_s"]) == {"http_429"}
        shed = [s for s in state["recent"] if s["status"] == 429]
        assert len(shed) == 2 and all(s["legs"] == [] and s["id"].startswith("shed-") for s in shed)


LONG_SYSTEM = " ".join(f"w{i}" for i in range(300))  # a prompt long enough to keep decode's blocks


def _turns(n: int) -> list[dict]:
    """A conversation's first ``n`` turns, each extending the last with the simulator's answer."""
    body = {"model": "sim-model", "max_tokens": 120,
            "messages": [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "first question"}]}
    out = [body]
    for i in range(n - 1):
        body = dict(body, messages=body["messages"] + [{"role": "assistant", "content": expected_text(body)},
                                                       {"role": "user", "content": f"next question {i}"}])
        out.append(body)
    return out


async def test_kv_events_held_kv_and_each_turn_s_reuse_outcome():
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, bidirectional=True, kv_events=True)
    async with stack(sim=sim, local_prefill_max_tokens=0) as (cluster, proxy, client):
        await client.request("GET", "/console/api/state")  # a console looks: requests are recorded
        await wait_for(lambda: len(proxy.app.kv_events.live()) == 2)
        first, second = _turns(2)
        for rid, body in ((b"turn-1", first), (b"turn-2", second)):
            assert (await client.chat(body, headers=[(b"x-request-id", rid)])).status == 200
        state = (await client.request("GET", "/console/api/state")).json()
        by_role = {i["role"]: i for i in state["instances"]}
        for role in ("prefill", "decode"):
            kv = by_role[role]["kv_events"]
            assert kv["state"] == "connected" and kv["state_text"].startswith("connected"), kv
        assert by_role["decode"]["kv_events"]["blocks"] > 0  # decode's blocks, from its own events
        held = by_role["decode"]["kv_reuse"]
        assert held["keeps_blocks"] is True and held["held_tokens"] > 0 and held["held_conversations"] == 1
        assert by_role["prefill"]["kv_reuse"] is None
        outcomes = {s["id"]: s["kv_outcome"] for s in state["recent"]}
        # (the first request of the proxy's life: no decode had answered with parameters yet)
        assert outcomes == {"turn-1": None, "turn-2": "reused"}
        turn = next(s for s in state["recent"] if s["id"] == "turn-2")
        assert turn["waterfall"][0]["stage"] == "kv_reuse" and turn["waterfall"][0]["instances"] == [
            by_role["decode"]["url"]]
        every = state["traffic"]["models"]["*"]
        assert (every["kv_turns"], every["reused_turns"]) == (1, 1)
        assert state["panel"] == {"state_store": None, "tenants": None, "tenants_store": None,
                                  "tenants_store_up": None}


async def test_without_kv_events_an_instance_says_not_configured_and_tenants_show_their_use(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("team-a:secret-a\n")
    tenants = {"keys": [{"name": "team-a", "requests_per_minute": 10}]}
    async with stack(encode=1, api_key_file=str(keys), tenants=tenants, admin_api_key="admin") as (_, _p, client):
        auth = [(b"authorization", b"Bearer secret-a")]
        assert (await client.chat(chat_body(), auth)).status == 200
        state = (await client.request("GET", "/console/api/state", headers=[(b"x-api-key", b"admin")])).json()
        for inst in state["instances"]:
            if inst["role"] == "encode":
                assert inst["kv_events"] is None  # encoders hold no KV blocks
            else:
                assert inst["kv_events"]["state"] == "off" and inst["kv_events"]["state_text"].startswith(
                    "not configured")
        [key] = [k for k in state["panel"]["tenants"] if k["key"] == "team-a"]
        [rpm] = [lim for lim in key["limits"] if lim["limit_name"] == "requests_per_minute"]
        assert (rpm["used"], rpm["limit"]) == (1, 10)
        assert "secret-a" not in repr(state)


async def test_the_proxy_panel_shows_the_shared_store_up_then_down(redis_server):  # noqa: F811
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, bidirectional=True)
    async with stack(sim=sim, state_store=redis_server.url, local_prefill_max_tokens=0) as (_, _p, client):
        panel = (await client.request("GET", "/console/api/state")).json()["panel"]
        store = panel["state_store"]
        assert (store["kind"], store["up"], store["down_since"], store["state_text"]) == ("redis", True, None, "up")
        assert redis_server.url not in repr(panel)  # the store's address is not shown
        redis_server.stop()
        first, second = _turns(2)
        for body in (first, second):  # keeping and looking up the turn: the store does not answer
            assert (await client.chat(body)).status == 200
        store = (await client.request("GET", "/console/api/state")).json()["panel"]["state_store"]
        assert store["up"] is False and store["down_since"] > 0 and store["state_text"].startswith("down")


async def test_a_requests_path_says_where_its_legs_were_placed_and_why(caplog):
    caplog.set_level(logging.DEBUG, logger="epd_proxy.pipeline")  # before the pipeline is built: read once
    async with stack(prefill=1, decode=2) as (cluster, proxy, client):
        await client.request("GET", "/console/api/state")  # a console looks: requests are recorded
        assert (await client.chat(chat_body(), headers=[(b"x-request-id", b"placed")])).status == 200
        one = (await client.request("GET", "/console/api/request?id=placed")).json()["requests"][0]
        placed = one["placement"]
        decode = [leg[1] for leg in one["legs"] if leg[0] == "decode"]
        assert placed["decode"]["instance"] == decode[0] and placed["decode"]["why"]
        assert placed["prefill"]["instance"] == cluster.urls("prefill")[0] and placed["connector"] == "nixl"
        stages = {w["stage"]: w for w in one["waterfall"]}
        assert stages["decode"]["why"] == placed["decode"]["why"] and stages["prefill"]["why"]
        logged = [r.getMessage() for r in caplog.records if "placed" in r.getMessage()]
        assert any("request placed:" in m and decode[0] in m for m in logged)


async def test_shared_tenant_counters_are_not_called_shared_while_their_store_is_down(tmp_path, redis_server):  # noqa: F811
    keys = tmp_path / "keys"
    keys.write_text("team-a:secret-a\n")
    tenants = {"keys": [{"name": "team-a", "requests_per_minute": 100}]}
    async with stack(api_key_file=str(keys), tenants=tenants, admin_api_key="admin",
                     state_store=redis_server.url) as (_, _p, client):
        admin = [(b"x-api-key", b"admin")]
        assert (await client.chat(chat_body(), [(b"authorization", b"Bearer secret-a")])).status == 200
        panel = (await client.request("GET", "/console/api/state", headers=admin)).json()["panel"]
        assert (panel["tenants_store"], panel["tenants_store_up"]) == ("shared", True)
        redis_server.stop()
        panel = (await client.request("GET", "/console/api/state", headers=admin)).json()["panel"]
        assert (panel["tenants_store"], panel["tenants_store_up"]) == ("shared", False)
        if CHROMIUM is not None:  # the page's heading says so too
            heading = await in_thread(_tenants_heading, f"{_p.url}/console", str(tmp_path / "profile"))
            assert heading["store"] == "down" and "does not answer" in heading["text"], heading
            assert "(counters shared)" not in heading["text"]


def _tenants_heading(url: str, profile: str) -> dict:
    with Page(profile, 1200, 900) as page:
        page.open(url)
        page.wait_for("!document.getElementById('auth').hidden")
        page.evaluate("document.getElementById('auth-key').value = 'admin';"
                      "document.getElementById('auth-form').requestSubmit()")
        page.wait_for("document.getElementById('tenants-store').textContent")
        return page.evaluate("({text: document.getElementById('tenants-store').textContent,"
                             " store: document.getElementById('tenants-store').dataset.store})")
