"""Routing over real sockets, in front of a simulated cluster with prefix and encoder caches:
conversations stay where their prefix is cached, replicas agree, hot prefixes spill, images go
where they were encoded."""

import asyncio

from helpers import Client, chat_body, stack

from epd_proxy import ProxyConfig, start_proxy
from epd_proxy.instances.load_signals import gauge_samples
from epd_proxy.runtime.serve import config_for_cluster
from epd_proxy.sim import SimCluster, SimConfig

SYSTEM = ("You are a careful assistant for a travel agency. Answer in short sentences, name places "
          "precisely, give distances in kilometres and never invent prices or opening hours.")


def turn_text(conv: int, turn: int) -> str:
    return f"Conversation {conv} turn {turn}: " + " ".join(f"w{conv}x{turn}x{k}" for k in range(24))


class Conversation:
    """A chat whose every next prompt holds the previous answers."""

    def __init__(self, conv: int, images=()) -> None:
        self.conv = conv
        self.images = list(images)
        self.messages = [{"role": "system", "content": SYSTEM}]
        self.turns = 0

    def next_body(self) -> dict:
        text = turn_text(self.conv, self.turns)
        if self.images and self.turns == 0:
            content = [{"type": "text", "text": text}] + [
                {"type": "image_url", "image_url": {"url": u}} for u in self.images]
        else:
            content = text
        return {"model": "sim-model", "messages": self.messages + [{"role": "user", "content": content}],
                "max_tokens": 8}

    async def say(self, client: Client) -> None:
        body = self.next_body()
        reply = await client.chat(body)
        assert reply.status == 200, reply.body
        self.messages = body["messages"] + [{"role": "assistant", "content": reply.text()}]
        self.turns += 1


async def metric(url: str, name: bytes) -> float:
    client = Client(url)
    try:
        return sum(gauge_samples((await client.request("GET", "/metrics")).body, name))
    finally:
        await client.close()


def served_by(cluster, role: str, conv: int, since: int = 0) -> set[str]:
    """The instances of ``role`` that computed turn ``since`` or a later one of conversation
    ``conv`` (``since=1``: all but the opening, which cache-aware may place by load and counts)."""
    out = set()
    for inst in cluster.instances(role):
        for r in inst.generation_records():
            messages = r.json.get("messages") or [{}]
            last = messages[-1].get("content")
            text = last if isinstance(last, str) else str(last)
            for t in range(since, 16):
                if f"Conversation {conv} turn {t}:" in text:
                    out.add(inst.name)
    return out


async def test_a_conversations_turns_stay_on_one_prefill_whose_prefix_cache_hits_grow():
    async with stack(prefill=3, decode=2) as (cluster, proxy, client):
        hits = []
        conv = Conversation(1)
        for _ in range(4):
            await conv.say(client)
            hits.append(sum([await metric(i.url, b"vllm:prefix_cache_hits_total")
                             for i in cluster.instances("prefill")]))
        assert len(served_by(cluster, "prefill", 1)) == 1
        assert hits[0] == 0 and hits[1] < hits[2] < hits[3]  # each turn reuses the conversation so far
        others = [Conversation(c) for c in range(2, 14)]
        for c in others:
            await c.say(client)
        # distinct conversations spread (12 conversations over 3 instances)
        assert len(set().union(*(served_by(cluster, "prefill", c.conv) for c in others))) >= 2


async def test_two_proxies_send_one_conversation_to_the_same_instance():
    sim = SimConfig(itl_ms=0, ttft_ms=0.5)
    async with SimCluster(prefill=3, decode=2, config=sim) as cluster:
        cfg = config_for_cluster(cluster, ProxyConfig(probe_interval=0, scrape_interval=0))
        async with await start_proxy(cfg) as a, await start_proxy(cfg) as b:
            clients = [Client(a.url), Client(b.url)]
            try:
                convs = [Conversation(c) for c in range(1, 6)]
                for turn in range(4):
                    for k, conv in enumerate(convs):
                        await conv.say(clients[(turn + k) % 2])  # turns alternate between the proxies
            finally:
                for c in clients:
                    await c.close()
        for conv in convs:
            assert len(served_by(cluster, "prefill", conv.conv)) == 1, conv.conv


async def test_a_hot_prefix_spills_over_once_the_load_bound_is_passed():
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, roles={"prefill": {"ttft_ms": 150}})
    async with stack(prefill=3, decode=1, sim=sim, balance_abs=1, balance_rel=1.0) as (cluster, proxy, client):
        hot = Conversation(7)
        await hot.say(client)
        home = served_by(cluster, "prefill", 7)
        assert len(home) == 1
        clients = [Client(proxy.url) for _ in range(6)]
        try:
            body = hot.next_body()
            replies = await asyncio.gather(*(c.chat(body) for c in clients))
        finally:
            for c in clients:
                await c.close()
        assert all(r.status == 200 for r in replies)
        spread = served_by(cluster, "prefill", 7)
        assert home < spread and len(spread) == 3  # beyond the bound: the next in rendezvous order
        home_inst = next(i for i in cluster.instances("prefill") if i.name in home)
        assert len(home_inst.generation_records()) >= 3  # ... while the home keeps its share
        text = (await client.request("GET", "/metrics")).body
        assert sum(gauge_samples(text, b"epd_proxy_routing_spills_total")) >= 2


async def test_the_same_image_goes_to_the_same_encoder_whose_cache_hits_grow():
    async with stack(encode=3, prefill=1, decode=1) as (cluster, proxy, client):
        for k in range(6):
            reply = await client.chat(chat_body(f"Question {k} about the picture",
                                                images=["https://example.com/cat.png"]))
            assert reply.status == 200, reply.body
        used = [i for i in cluster.instances("encode") if i.generation_records()]
        assert len(used) == 1
        assert await metric(used[0].url, b"sim:encoder_cache_hits_total") == 5
        for k in range(30):  # other images spread level (tests/routing/test_encoder_spread.py)
            assert (await client.chat(chat_body("What is it?", images=[f"https://example.com/{k}.png"]))).status == 200
        assert all(i.generation_records() for i in cluster.instances("encode"))


async def test_pd_without_prefill_keeps_a_conversation_on_one_instance():
    async with stack(prefill=0, decode=0, pd=3) as (cluster, proxy, client):
        conv = Conversation(3)
        for _ in range(3):
            await conv.say(client)
        assert len(served_by(cluster, "pd", 3)) == 1
        status = (await client.request("GET", "/status")).json()
        assert status["routing"]["decode"] == "cache-aware"  # PD prefills: prefix affinity


async def test_one_instance_per_role():
    async with stack(encode=1, prefill=1, decode=1) as (cluster, proxy, client):
        status = (await client.request("GET", "/status")).json()
        assert status["routing"] == {"encode": "cache-aware", "prefill": "cache-aware", "decode": "load-aware"}
        conv = Conversation(4, images=["https://example.com/dog.png"])
        for _ in range(3):
            await conv.say(client)
        (p,) = cluster.instances("prefill")
        assert await metric(p.url, b"vllm:prefix_cache_hits_total") > 0
        again = await client.chat(chat_body("Another look", images=["https://example.com/dog.png"]))
        assert again.status == 200
        # turns 2 and 3 carried the image again, then one more request: three hits
        assert await metric(cluster.instances("encode")[0].url, b"sim:encoder_cache_hits_total") == 3


async def test_a_restarted_proxy_sends_each_conversation_where_it_went_before():
    """No routing state to lose: a fresh proxy process continues every conversation on the
    instance that holds its prefix (no cache-miss storm after a failover)."""
    sim = SimConfig(itl_ms=0, ttft_ms=0.5)
    async with SimCluster(prefill=3, decode=1, config=sim) as cluster:
        cfg = config_for_cluster(cluster, ProxyConfig(probe_interval=0, scrape_interval=0))
        convs = [Conversation(c) for c in range(20, 26)]
        hits = []
        for _ in range(2):  # two turns through one proxy, two through its replacement
            async with await start_proxy(cfg) as proxy:
                client = Client(proxy.url)
                try:
                    for _ in range(2):
                        for conv in convs:
                            await conv.say(client)
                finally:
                    await client.close()
            hits.append(sum([await metric(i.url, b"vllm:prefix_cache_hits_total")
                             for i in cluster.instances("prefill")]))
        for conv in convs:  # both proxies send every later turn where the first proxy sent turn 2
            assert len(served_by(cluster, "prefill", conv.conv, since=1)) == 1, conv.conv
        # turns 3 and 4 find the whole earlier conversation: more hits than turns 1 and 2
        assert hits[1] - hits[0] > hits[0]


async def test_the_workers_of_one_proxy_agree():
    """``--workers 2``: separate processes behind one port (the kernel spreads connections),
    each with its own pools, send a conversation to one instance from its opening on: a turn
    one worker placed off the rendezvous order is found by the other (the parent's store)."""
    import os
    import signal
    import sys

    from procs import free_port as _free_port

    sim = SimConfig(itl_ms=0, ttft_ms=0.5)
    async with SimCluster(prefill=3, decode=1, config=sim) as cluster:
        port = _free_port()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in [os.path.join(os.path.dirname(__file__), "..", "..", "src"),
                                                        env.get("PYTHONPATH", "")] if p)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "epd_proxy", "serve", "--port", str(port), "--workers", "2",
            "--probe-interval", "0", "--scrape-interval", "0", "--shutdown-grace", "0", "--log-level", "warning",
            "--prefill", ",".join(cluster.urls("prefill")), "--decode", cluster.urls("decode")[0],
            env=env, stdout=asyncio.subprocess.DEVNULL, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            pids = set()
            loop = asyncio.get_running_loop()
            end = loop.time() + 20
            convs = [Conversation(c) for c in range(40, 48)]
            for _turn in range(3):
                for conv in convs:
                    client = Client(url)  # a new connection per turn: any worker may take it
                    try:
                        while True:
                            try:
                                pids.add((await client.request("GET", "/status", timeout=2)).json().get("pid"))
                                break
                            except Exception:
                                assert proc.returncode is None and loop.time() < end, "the proxy did not start"
                                await asyncio.sleep(0.05)
                        await conv.say(client)
                    finally:
                        await client.close()
        finally:
            if proc.returncode is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    await asyncio.wait_for(proc.wait(), 10)
                except TimeoutError:
                    os.killpg(proc.pid, signal.SIGKILL)
                    await proc.wait()
        for conv in convs:  # each worker counts its own openings, and shares where they went through the parent
            assert len(served_by(cluster, "prefill", conv.conv)) == 1, conv.conv
        assert len(pids) == 2  # both workers took turns (24 connections: all on one is 2^-23 likely)
