"""What a client may put in a request, end to end over loopback against the simulator.

Each test is the attack (or the gap) as a client would send it; the assertions are on
what the simulated instances received, since that is what a real engine would act on.
"""

import asyncio
import base64

import msgspec
import pytest
from blake3 import blake3
from helpers import Client, chat_body, stack, wait_for

from epd_proxy.encode.multimodal import client_key
from epd_proxy.sim import SimConfig, expected_text


def digest(text: str) -> str:
    """The proxy's content key of a URL."""
    return blake3(text.encode()).hexdigest()


def _img(url: str, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url}, **extra}


def _media_body(*parts, **extra) -> dict:
    return {"model": "sim-model", "max_tokens": 6, "stream": False,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, *parts]}],
            **extra}


def _consumer_keys(rec) -> set:
    """Every encoder-cache key a consumer's body references (part uuids and ec_items)."""
    keys = {p.get("uuid") for m in rec.json["messages"] if isinstance(m.get("content"), list)
            for p in m["content"] if p.get("type") != "text"}
    ec = rec.json.get("ec_transfer_params") or {}
    keys |= {i["mm_hash"] for i in ec.get("ec_items", [])}
    keys |= {k for k in ec if k != "ec_items"}
    keys.discard(None)
    return keys


def _error(reply) -> dict:
    err = reply.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


# -- 1. encoder-cache poisoning -------------------------------------------------------------------

VICTIM = "https://victim.example/secret-scan.png"
ATTACKER = "https://attacker.example/evil.png"


@pytest.mark.parametrize("topology, ec", [("E+P+D", "nixl"), ("E+PD", "nixl"), ("E+P+D", "example")])
async def test_a_client_uuid_cannot_claim_another_images_cache_key(topology, ec):
    """The attacker's image carries uuid = the key the proxy derives for the victim's image;
    the victim's consumer must still reference only what its own image was stored under."""
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, ec_connector=ec)
    layout = dict(encode=1, prefill=0, decode=0, pd=1) if topology == "E+PD" else dict(encode=1)
    consumer_role = "pd" if topology == "E+PD" else "prefill"
    async with stack(sim=sim, **layout) as (cluster, proxy, client):
        victim_key = digest(VICTIM)
        attack = await client.chat(_media_body(_img(ATTACKER, uuid=victim_key)))
        assert attack.status == 200, attack.body
        stored_by_attacker = {p["uuid"] for p in cluster.records("encode")[-1].json["messages"][0]["content"]}
        assert stored_by_attacker == {client_key(victim_key)}

        victim = await client.chat(_media_body(_img(VICTIM)))
        assert victim.status == 200, victim.body
        keys = _consumer_keys(cluster.records(consumer_role)[-1])
        assert keys and not keys & stored_by_attacker
        assert not {k.removesuffix("-processed") for k in keys} & stored_by_attacker
        assert victim.text() == expected_text(_media_body(_img(VICTIM)))


@pytest.mark.parametrize("rewrite", [True, False])
async def test_client_uuids_are_namespaced_the_same_for_encoder_and_consumer(rewrite):
    async with stack(encode=1, rewrite=rewrite) as (cluster, proxy, client):
        body = _media_body(_img("https://x/a.png", uuid="my-stable-id"))
        reply = await client.chat(body)
        assert reply.status == 200, reply.body
        sent = cluster.records("encode")[-1].json["messages"][0]["content"][0]
        assert sent["uuid"] == client_key("my-stable-id")
        consumer = cluster.records("prefill")[-1].json["messages"][0]["content"][1]
        assert consumer["uuid"] == client_key("my-stable-id")
        assert cluster.instances("prefill")[0].stats.local_encodes == 0


async def test_client_uuids_are_namespaced_without_an_encoder_too():
    async with stack(prefill=0, decode=0, pd=1) as (cluster, proxy, client):
        reply = await client.chat(_media_body(_img("https://x/a.png", uuid=digest("https://x/b.png"))))
        assert reply.status == 200, reply.body
        part = cluster.records("pd")[-1].json["messages"][0]["content"][1]
        assert part["uuid"] == client_key(digest("https://x/b.png"))


@pytest.mark.parametrize("rewrite", [True, False])
async def test_ignore_client_uuids_keys_media_by_content(rewrite):
    async with stack(encode=1, rewrite=rewrite, ignore_client_uuids=True) as (cluster, proxy, client):
        reply = await client.chat(_media_body(_img("https://x/a.png", uuid=digest(VICTIM))))
        assert reply.status == 200, reply.body
        enc = cluster.records("encode")[-1].json["messages"][0]["content"][0]
        consumer = cluster.records("prefill")[-1].json["messages"][0]["content"][1]
        if rewrite:
            assert enc["uuid"] == consumer["uuid"] == digest("https://x/a.png")
        else:
            assert "uuid" not in enc and "uuid" not in consumer
        assert cluster.instances("prefill")[0].stats.local_encodes == 0


# -- 2. client-steered transfers ------------------------------------------------------------------

EVIL_KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "evil-engine",
           "remote_host": "10.9.9.9", "remote_port": 5999, "remote_block_ids": [1, 2, 3]}
EVIL_EC = {"consumer_zmq": "tcp://10.9.9.9:19019",
           "ec_items": [{"mm_hash": "evil-hash", "transfer_id": "evil-transfer"}],
           "evil-hash": {"peer_host": "10.9.9.9", "peer_port": 1}}

TOPOLOGIES = {
    "P/D nixl": (dict(), SimConfig(itl_ms=0, ttft_ms=0.5)),
    "P/D nixl-push": (dict(), SimConfig(itl_ms=0, ttft_ms=0.5, kv_connector="nixl-push")),
    "P/D mooncake": (dict(), SimConfig(itl_ms=0, ttft_ms=0.5, kv_connector="mooncake")),
    "E+PD": (dict(encode=1, prefill=0, decode=0, pd=1), None),
    "E+P+D": (dict(encode=1), None),
    "PD": (dict(prefill=0, decode=0, pd=1), None),
}


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
@pytest.mark.parametrize("media", [False, True], ids=["text", "media"])
@pytest.mark.parametrize("topology", list(TOPOLOGIES))
async def test_client_transfer_params_never_reach_an_instance(topology, media, stream):
    layout, sim = TOPOLOGIES[topology]
    async with stack(sim=sim, **layout) as (cluster, proxy, client):
        body = chat_body(images=["https://x/cat.png"] if media else (), stream=stream,
                         kv_transfer_params=EVIL_KV, ec_transfer_params=EVIL_EC)
        reply = await client.chat(body)
        assert reply.status == 200, reply.body
        clean = {k: v for k, v in body.items() if k not in ("kv_transfer_params", "ec_transfer_params")}
        assert reply.text() == expected_text(clean)
        records = cluster.records()
        assert records
        for rec in records:
            assert b"10.9.9.9" not in rec.body and b"evil" not in rec.body, (rec.instance, rec.body)


async def test_completions_client_transfer_params_are_dropped():
    async with stack() as (cluster, proxy, client):
        body = {"model": "sim-model", "prompt": "Hello", "max_tokens": 4, "kv_transfer_params": EVIL_KV,
                "ec_transfer_params": EVIL_EC}
        reply = await client.post("/v1/completions", body)
        assert reply.status == 200, reply.body
        assert all(b"10.9.9.9" not in rec.body for rec in cluster.records())


# -- 3. fan-out amplification -------------------------------------------------------------------------

async def test_more_media_items_than_the_limit_is_a_400_naming_it():
    async with stack(encode=1, max_media_items=4) as (cluster, proxy, client):
        reply = await client.chat(chat_body(images=[f"https://x/{i}.png" for i in range(5)]))
        assert reply.status == 400
        err = _error(reply)
        assert "--max-media-items" in err["message"] and "4" in err["message"]
        assert cluster.records() == []
        ok = await client.chat(chat_body(images=[f"https://x/{i}.png" for i in range(4)]))
        assert ok.status == 200, ok.body


class _PeakSet(set):
    """The simulator server's live-connection set, remembering its largest size."""

    peak = 0

    def add(self, item):
        super().add(item)
        self.peak = max(self.peak, len(self))


async def test_one_request_never_opens_more_than_the_cap_to_an_encoder():
    cap, n = 3, 40
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, encode_ms_per_item=5)
    async with stack(encode=1, sim=sim, encoder_max_batch_size=1, max_upstream_connections=cap) as (
            cluster, proxy, client):
        server = cluster.instances("encode")[0].server
        server.connections = peak = _PeakSet(server.connections)
        big = asyncio.ensure_future(client.chat(chat_body(images=[f"https://x/{i}.png" for i in range(n)]),
                                                timeout=30))
        await wait_for(lambda: peak.peak >= cap)
        # Other requests still complete while the big one holds the encoder's connections:
        # a text request at once, and a media request in its turn.
        others = [Client(proxy.url) for _ in range(2)]
        try:
            text, media = await asyncio.gather(
                others[0].chat(chat_body("text only")),
                others[1].chat(chat_body(images=["https://x/other.png"]), timeout=30))
            assert text.status == 200, text.body
            assert media.status == 200, media.body
        finally:
            for other in others:
                await other.close()
        reply = await big
        assert reply.status == 200, reply.body
        assert len(cluster.records("encode")) == n + 1
        assert peak.peak == cap


# -- 4. smaller gaps ------------------------------------------------------------------------------------

@pytest.mark.parametrize("depth", [990, 1200, 100_000])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_deeply_nested_json_is_a_400(depth, path):
    async with stack() as (cluster, proxy, client):
        raw = (b'{"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "prompt": "x", '
               b'"deep": ' + b"[" * depth + b"]" * depth + b"}")
        reply = await client.post(path, raw)
        assert reply.status == 400, reply.body
        assert "nested" in _error(reply)["message"]
        assert cluster.records() == []
        assert (await client.chat(chat_body())).status == 200


async def test_moderately_nested_json_still_reaches_the_engine():
    async with stack() as (cluster, proxy, client):
        nested: object = 1
        for _ in range(200):
            nested = [nested]
        reply = await client.chat(chat_body(extra_args={"deep": nested}))
        assert reply.status == 200, reply.body


@pytest.mark.parametrize("byte", [b"\x00", b"\x01", b"\x1f", b"\n"])
async def test_a_large_data_url_with_a_raw_control_byte_is_a_400(byte):
    async with stack(encode=1) as (cluster, proxy, client):
        payload = base64.b64encode(bytes(3000)).decode()
        url = ("data:image/png;base64," + payload[:1500]).encode() + byte + payload[1500:].encode()
        body = msgspec.json.encode(_media_body(_img("PLACEHOLDER")))
        raw = body.replace(b"PLACEHOLDER", url)
        reply = await client.post("/v1/chat/completions", raw)
        assert reply.status == 400, reply.body
        assert "not valid JSON" in _error(reply)["message"]
        assert cluster.records() == []


ODD_IDS = [b"has space", b"a,b", b"x" * 129, "café".encode(), "café".encode("latin-1"), b"<script>",
           b'quote"d', b"tab\tbed"]


async def test_a_safe_client_request_id_is_echoed_and_sent_byte_for_byte():
    rid = b"Req-42_a.b:c~d+e=f@g" + b"x" * 108  # 128 bytes: the longest accepted
    async with stack(encode=1) as (cluster, proxy, client):
        reply = await client.chat(chat_body(images=["https://x/a.png"]), headers=[(b"x-request-id", rid)])
        assert reply.status == 200
        assert reply.headers[b"x-request-id"] == rid
        for rec in cluster.records("prefill") + cluster.records("decode"):
            assert rec.request_id.encode() == rid
        assert cluster.records("encode")[-1].request_id.encode().startswith(rid + b":0:")


@pytest.mark.parametrize("rid", ODD_IDS, ids=range(len(ODD_IDS)))
async def test_an_unsafe_client_request_id_is_replaced_everywhere(rid):
    async with stack() as (cluster, proxy, client):
        reply = await client.chat(chat_body(), headers=[(b"x-request-id", rid)])
        assert reply.status == 200
        echoed = reply.headers[b"x-request-id"]
        assert echoed != rid and len(echoed) >= 16 and echoed.isascii() and echoed.isalnum()
        for rec in cluster.records():
            assert rec.request_id.encode() == echoed


async def test_a_forwarded_authorization_header_is_the_only_one_upstream():
    async with stack(forward_headers=("authorization",)) as (cluster, proxy, client):
        reply = await client.chat(chat_body(), headers=[(b"authorization", b"Bearer client-key")])
        assert reply.status == 200
        for rec in cluster.records():
            assert rec.headers.get("authorization") == "Bearer client-key"


async def test_forwarding_authorization_with_an_upstream_key_refuses_to_start():
    with pytest.raises(ValueError, match="two Authorization"):
        async with stack(forward_headers=("authorization",), upstream_api_key="k"):
            pass


# -- 5. media URL schemes and hosts -------------------------------------------------------------------

REFUSED_URLS = ["file:///etc/passwd", "gopher://x/", "http://127.0.0.1:8200/v1/models", "http://localhost/a.png",
                "http://[::ffff:127.0.0.1]/", "http://0x7f000001/", "http://2130706433/", "http://127.1/",
                "http://169.254.169.254/latest/meta-data", "http://10.1.2.3/a.png", "http://[::1]/",
                "http://[fe80::1]/", "http://0.0.0.0/", "http://224.0.0.1/", "not-a-url.png"]


@pytest.mark.parametrize("url", REFUSED_URLS)
async def test_media_urls_outside_the_policy_are_a_400(url):
    async with stack(encode=1) as (cluster, proxy, client):
        body = _media_body({"type": "audio_url", "audio_url": {"url": "https://x/ok.wav"}}, _img(url))
        reply = await client.chat(body)
        assert reply.status == 400, reply.body
        err = _error(reply)
        assert err["param"] == "messages[0].content[2]"
        assert "scheme" in err["message"] or "address" in err["message"] or "loopback" in err["message"]
        assert cluster.records() == []


async def test_the_operator_can_allow_internal_media_hosts_and_schemes():
    async with stack(encode=1, allowed_media_hosts=("127.0.0.0/8", "localhost", "fd00::/8"),
                     allowed_media_schemes=("http", "https", "data", "file")) as (cluster, proxy, client):
        for url in ("http://127.0.0.1:9/a.png", "http://localhost/b.png", "http://[fd00::5]/c.png",
                    "file:///media/d.png", "http://[::ffff:127.0.0.2]/e.png"):
            reply = await client.chat(_media_body(_img(url)))
            assert reply.status == 200, (url, reply.body)
        refused = await client.chat(_media_body(_img("http://10.0.0.1/a.png")))
        assert refused.status == 400


async def test_data_urls_can_be_refused_by_scheme():
    async with stack(encode=1, allowed_media_schemes=("https",)) as (cluster, proxy, client):
        big = "data:image/png;base64," + base64.b64encode(bytes(3000)).decode()
        for url in (big, "data:image/png;base64,AAAA"):
            reply = await client.chat(_media_body(_img(url)))
            assert reply.status == 400 and "'data'" in _error(reply)["message"]


async def test_a_shed_request_echoes_only_a_safe_client_request_id():
    async with stack(max_inflight=1) as (cluster, proxy, client):
        cluster.instances("prefill")[0].inject("hang")
        held = asyncio.ensure_future(client.chat(chat_body(stream=True)))
        await wait_for(lambda: len(cluster.records("prefill")) == 1)
        safe = await client.chat(chat_body(), headers=[(b"x-request-id", b"shed-1")])
        unsafe = await client.chat(chat_body(), headers=[(b"x-request-id", "café id".encode())])
        assert safe.status == unsafe.status == 429
        assert safe.headers[b"x-request-id"] == b"shed-1"
        assert b"x-request-id" not in unsafe.headers
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
        cluster.instances("prefill")[0].clear_faults()
