"""The routed endpoints over real sockets: one instance answers, its answer relayed as received."""

import msgspec
from helpers import JSON, Client, stack

from epd_proxy.request.apis import speaks_anthropic
from epd_proxy.routing.endpoints import ROUTED
from epd_proxy.wire.errors import as_anthropic

_RID = [(b"x-request-id", b"fwd-1")]


async def _direct(url: str, method: str, path: str, body: bytes, headers) -> tuple:
    client = Client(url)
    try:
        reply = await client.request(method, path, body, headers)
    finally:
        await client.close()
    return reply.status, reply.headers.get(b"content-type"), reply.body


async def test_every_routed_endpoint_reaches_an_instance_and_relays_its_answer():
    body = msgspec.json.encode({"model": "sim-model", "prompt": "the cache and the model",
                                "input": "the cache", "tokens": [0, 1, 2]})
    async with stack(prefill=1, decode=1) as (cluster, proxy, client):
        decode = cluster.instances("decode")[0]
        for path, endpoint in ROUTED.items():
            headers = JSON + _RID if endpoint.method == "POST" else _RID
            payload = body if endpoint.method == "POST" else b""
            before = await _direct(decode.url, endpoint.method, path, payload, headers)
            reply = await client.request(endpoint.method, path, payload, headers)
            after = await _direct(decode.url, endpoint.method, path, payload, headers)
            # The instance's status, content type and bytes (embeddings carry the second they
            # were made: the proxied one equals a direct one made in the same second).
            got = (reply.status, reply.headers.get(b"content-type"), reply.body)
            if speaks_anthropic(path) and got[0] >= 400:
                # An error for Anthropic's clients: in their envelope (protocol.md §5.2).
                before, after = [(s, t, as_anthropic(s, b)) for s, t, b in (before, after)]
            assert got in (before, after), path
            assert reply.headers[b"x-request-id"] == b"fwd-1"
            seen = [r for inst in cluster.all_instances() for r in inst.records if r.path == path]
            assert len(seen) == 3 and seen[-1].request_id == "fwd-1", path


async def test_tokenize_round_trip_and_embeddings_through_the_proxy():
    async with stack(prefill=1, decode=2) as (cluster, proxy, client):
        tokens = (await client.post("/tokenize", {"prompt": "hello routed world"})).json()
        assert tokens["count"] == 3
        assert (await client.post("/detokenize", {"tokens": tokens["tokens"]})).json() == \
            {"prompt": "hello routed world"}
        reply = await client.post("/v1/embeddings", {"input": ["a", "b"]})
        assert reply.status == 200 and len(reply.json()["data"]) == 2


async def test_multipart_body_reaches_the_instance_unchanged():
    boundary = b"----sim"
    body = (b"--" + boundary + b'\r\ncontent-disposition: form-data; name="file"; filename="a.wav"\r\n'
            b"content-type: audio/wav\r\n\r\n" + bytes(range(256)) * 400 + b"\r\n--" + boundary + b"--\r\n")
    ctype = b"multipart/form-data; boundary=" + boundary
    async with stack(prefill=0, decode=1) as (cluster, proxy, client):
        reply = await client.request("POST", "/v1/audio/transcriptions", body, [(b"content-type", ctype)])
        assert reply.status == 404 and reply.body == b'{"detail":"Not Found"}'  # the sim has no audio model
        rec = cluster.instances("decode")[0].records[-1]
        assert rec.path == "/v1/audio/transcriptions" and rec.body == body
        assert rec.headers["content-type"] == ctype.decode()


async def test_a_refused_connection_fails_over_to_another_instance():
    async with stack(prefill=0, decode=3) as (cluster, proxy, client):
        dead = cluster.instances("decode")[:2]
        for inst in dead:
            await inst.crash()  # its port refuses connections; no probe has noticed
        for _ in range(4):
            reply = await client.post("/tokenize", {"prompt": "still answered"})
            assert reply.status == 200 and reply.json()["count"] == 2
        pool = proxy.app.pools["decode"]
        failed = {i.url for i in pool.instances if i.health.failures}
        assert failed == {inst.url for inst in dead}


async def test_no_instance_left_names_the_role_not_the_address():
    async with stack(prefill=0, decode=1) as (cluster, proxy, client):
        inst = cluster.instances("decode")[0]
        await inst.crash()
        reply = await client.post("/v1/embeddings", {"input": "x"})
        assert reply.status in (502, 503) and "decode instance" in reply.json()["error"]["message"]
        assert str(inst.port).encode() not in reply.body


async def test_an_instances_4xx_is_relayed_as_received():
    async with stack(prefill=0, decode=1) as (cluster, proxy, client):
        reply = await client.post("/tokenize", {"model": "other", "prompt": "x"})
        assert reply.status == 404 and reply.json()["error"]["type"] == "NotFoundError"


async def test_routed_requests_take_admission_slots_and_count_in_metrics():
    async with stack(prefill=0, decode=1, max_inflight=1) as (cluster, proxy, client):
        assert (await client.post("/tokenize", {"prompt": "a b"})).status == 200
        assert proxy.app.pipeline.admission.active == 0  # the slot was given back
        metrics = (await client.request("GET", "/metrics")).body.decode()
        assert 'epd_proxy_requests_total{endpoint="/tokenize",status="200"} 1' in metrics


async def test_load_is_the_clusters_view():
    async with stack(prefill=1, decode=1) as (cluster, proxy, client):
        reply = await client.request("GET", "/load")
        assert reply.json() == {"server_load": 0, "by_role": {"encode": 0, "prefill": 0, "decode": 0}}
