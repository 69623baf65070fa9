"""E+PD and E+P+D through epd-proxy, against real vLLM with a tiny BLIP-2 (images as data: URLs).

Instances (see vllm_e2e.epd_cluster): E = EC producer (ECExampleConnector, shared directory);
P = EC consumer + NIXL KV producer; D = NIXL KV consumer. One set serves both topologies:
- E+P+D: `--encode E --prefill P --decode D`;
- E+PD:  `--encode E --decode P` (P is an ordinary instance when no kv_transfer_params come).

Evidence checked per request: a new entry `<mm_hash>/encoder_cache.safetensors` in the EC
directory (the encoder ran); P's log line `Success load encoder cache for hash <mm_hash>` (the
consumer used it; vLLM logs it at DEBUG only, so P runs with VLLM_LOGGING_LEVEL=DEBUG); for
E+P+D, one more NIXL transfer into D; and the text equals the single-instance answer, which is
the same request sent straight to D (no EC role, no kv params: it encodes the image itself).

The `image_embeds` rewrite: vLLM 0.32.0 accepts metadata-only `*_embeds` parts only for models
that declare `embedding_fields` (Qwen2-VL family, MiniCPM-V, Keye, Ultravox, Qwen2-Audio, ...).
BLIP-2 does not; its encoder publishes `"metadata": {}`, so the proxy must keep the raw item
(docs/protocol.md §4.5), and the test below pins what vLLM answers if a rewrite is sent anyway.
"""

from __future__ import annotations

import copy
import hashlib
import os
import random

import pytest
import vllm_e2e as E

CLUSTER = "epd"
ORDER = 10
pytestmark = pytest.mark.vllm

STREAMS = [False, True]
PULL_REQUEST = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}
EC_LOADED = "Success load encoder cache for hash "


@pytest.fixture(scope="module")
def proxies(epd, start_proxy):
    return {
        "E+P+D": start_proxy("epd-e-p-d", encode=[epd.encode.url], prefill=[epd.prefill.url],
                             decode=[epd.decode.url]),
        "E+PD": start_proxy("epd-e-pd", encode=[epd.encode.url], decode=[epd.prefill.url]),
    }


@pytest.fixture(scope="module")
def no_rewrite_proxy(epd, start_proxy):
    return start_proxy("epd-e-pd-no-rewrite", encode=[epd.encode.url], decode=[epd.prefill.url],
                       extra=["--no-rewrite"])


def ec_entries(epd) -> set[str]:
    """mm hashes with a stored encoder output. (ECExampleConnector's lookup on the consumer
    creates an empty `<mm_hash>/` folder for every hash it checks, found or not.)"""
    return {h for h in os.listdir(epd.ec_dir)
            if os.path.exists(os.path.join(epd.ec_dir, h, "encoder_cache.safetensors"))}


def ec_lookups_missed(epd) -> set[str]:
    """Hashes the consumer looked up and did not find (the empty folders)."""
    return {h for h in os.listdir(epd.ec_dir)
            if not os.path.exists(os.path.join(epd.ec_dir, h, "encoder_cache.safetensors"))}


def new_entry(epd, before: set[str]) -> str:
    new = ec_entries(epd) - before
    assert len(new) == 1, f"expected one new encoder-cache entry, got {sorted(new)}"
    return new.pop()


def consumer_loaded(epd, mm_hash: str, timeout: float = 5) -> bool:
    return bool(E.wait_for(lambda: (EC_LOADED + mm_hash) in epd.prefill.log(), timeout))


def assert_consumer_loaded(epd, mm_hash: str, missed_before: set[str]) -> None:
    if consumer_loaded(epd, mm_hash):
        return
    missed = sorted(ec_lookups_missed(epd) - missed_before)
    pytest.fail(f"the encoder stored {mm_hash}, but P never logged '{EC_LOADED}{mm_hash}'; "
                f"P looked up and missed {missed} (so it encoded the image itself: the hash "
                f"the consumer computed differs from the encoder's)", pytrace=False)


def single_instance(epd, body: dict) -> str:
    return E.text_of(E.reference(epd, "chat", body), "chat")


# --- the environment itself, without the proxy -------------------------------------------------


def test_vllm_direct_e_p_d_flow(epd):
    """E (image only, content uuid) -> P (raw image + same uuid, do_remote_decode) -> D."""
    url = E.png_data_url(E.unique_color())
    uid = hashlib.sha256(url.encode()).hexdigest()
    body = E.image_chat_body(url)
    expected = single_instance(epd, body)
    before = ec_entries(epd)
    enc = {"model": E.MODEL_NAME, "stream": False, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}, "uuid": uid}]}]}
    r = E.post(epd.encode.url, "/v1/chat/completions", enc)
    assert r.status == 200, E.describe(r)
    doc = r.json()
    assert doc["usage"]["completion_tokens"] == 0 and doc["choices"][0]["message"]["content"] == ""
    assert doc["ec_transfer_params"] == {uid: {"item_indices": [0], "metadata": {}}}, doc
    assert new_entry(epd, before) == uid
    p_body = copy.deepcopy(body)
    p_body["messages"][0]["content"][0]["uuid"] = uid
    p_body.update(max_tokens=1, kv_transfer_params=PULL_REQUEST,
                  ec_transfer_params=doc["ec_transfer_params"])
    r = E.post(epd.prefill.url, "/v1/chat/completions", p_body)
    assert r.status == 200, E.describe(r)
    assert consumer_loaded(epd, uid)
    d0 = epd.decode.metrics()
    d_body = copy.deepcopy(body)
    d_body["messages"][0]["content"][0]["uuid"] = uid
    d_body["kv_transfer_params"] = r.json()["kv_transfer_params"]
    r = E.post(epd.decode.url, "/v1/chat/completions", d_body)
    assert r.status == 200, E.describe(r)
    assert E.text_of(r, "chat") == expected
    assert E.delta(epd.decode, E.NIXL_XFERS, d0, 1) == 1


def test_vllm_image_embeds_reference_needs_embedding_fields(epd):
    """Documents vLLM 0.32.0: an EC/KV consumer turns on --enable-mm-embeds by itself and accepts
    metadata-only `image_embeds`, but only for models with `embedding_fields`. BLIP-2 has none,
    so the rewrite of a BLIP-2 image (metadata {}) is a 400, whatever the consumer's flags."""
    url = E.png_data_url(E.unique_color())
    uid = hashlib.sha256(url.encode()).hexdigest()
    enc = {"model": E.MODEL_NAME, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}, "uuid": uid}]}]}
    r = E.post(epd.encode.url, "/v1/chat/completions", enc)
    assert r.status == 200, E.describe(r)
    body = E.image_chat_body(url)
    body["messages"][0]["content"][0] = {"type": "image_embeds", "image_embeds": {}, "uuid": uid}
    body["ec_transfer_params"] = r.json()["ec_transfer_params"]
    r = E.post(epd.prefill.url, "/v1/chat/completions", body)
    assert r.status == 400, E.describe(r)
    assert "multi_modal_uuids" in r.json()["error"]["message"], E.describe(r)


# --- through the proxy ----------------------------------------------------------------------


@pytest.mark.parametrize("stream", STREAMS, ids=["nonstream", "stream"])
@pytest.mark.parametrize("topology", ["E+PD", "E+P+D"])
def test_epd_image_chat(epd, proxies, topology, stream):
    body = E.image_chat_body(E.png_data_url(E.unique_color()), max_tokens=8, stream=stream)
    expected = single_instance(epd, body)
    before, missed = ec_entries(epd), ec_lookups_missed(epd)
    d0, p0 = epd.decode.metrics(), epd.prefill.metrics()

    resp = E.post(proxies[topology].url, "/v1/chat/completions", body)

    E.assert_ok(resp, stream)
    assert E.text_of(resp, "chat") == expected
    mm_hash = new_entry(epd, before)                  # the encoder ran and stored its output
    assert_consumer_loaded(epd, mm_hash, missed)      # ... and P used it instead of encoding
    if topology == "E+P+D":
        assert E.delta(epd.decode, E.NIXL_XFERS, d0, 1) == 1, "no NIXL transfer into D"
        assert E.delta(epd.prefill, "vllm:generation_tokens_total", p0, 1) == 1
    else:  # PD did the whole generation, nothing was transferred
        assert E.delta(epd.prefill, "vllm:generation_tokens_total", p0, 8) == 8
        assert epd.decode.metrics().get(E.NIXL_XFERS) == d0.get(E.NIXL_XFERS)


@pytest.mark.parametrize("mode", ["E+P+D", "no-rewrite"])
def test_epd_large_image(epd, proxies, no_rewrite_proxy, mode):
    """A ~60 KB data: URL, which the proxy never decodes (epd_proxy.blobs): the encoder,
    the consumer and the engine's hashing see exactly the client's bytes."""
    url = E.png_data_url((0, 0, 0), (128, 112), noise=random.randrange(1 << 30))
    assert len(url) > 40_000
    body = E.image_chat_body(url, max_tokens=8, stream=mode == "E+P+D")
    expected = single_instance(epd, body)
    before, missed = ec_entries(epd), ec_lookups_missed(epd)

    proxy = proxies["E+P+D"] if mode == "E+P+D" else no_rewrite_proxy
    resp = E.post(proxy.url, "/v1/chat/completions", body)

    E.assert_ok(resp, mode == "E+P+D")
    assert E.text_of(resp, "chat") == expected
    mm_hash = new_entry(epd, before)
    assert_consumer_loaded(epd, mm_hash, missed)


@pytest.mark.parametrize("stream", STREAMS, ids=["nonstream", "stream"])
def test_epd_no_rewrite(epd, no_rewrite_proxy, stream):
    """--no-rewrite: raw media and no uuid to either side; both hash the content the same way."""
    body = E.image_chat_body(E.png_data_url(E.unique_color()), max_tokens=8, stream=stream)
    expected = single_instance(epd, body)
    before, missed = ec_entries(epd), ec_lookups_missed(epd)

    resp = E.post(no_rewrite_proxy.url, "/v1/chat/completions", body)

    E.assert_ok(resp, stream)
    assert E.text_of(resp, "chat") == expected
    mm_hash = new_entry(epd, before)
    assert_consumer_loaded(epd, mm_hash, missed)


@pytest.mark.parametrize("stream", STREAMS, ids=["nonstream", "stream"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_epd_text_only_skips_encoder(epd, proxies, endpoint, stream):
    """No media: the encoder is not called; E+P+D is then plain P/D over NIXL."""
    body = E.text_body(endpoint, E.unique_prompt(), max_tokens=8, stream=stream)
    ref = E.post(epd.decode.url, E.endpoint_path(endpoint), dict(body, stream=False))
    assert ref.status == 200, E.describe(ref)
    e0, d0 = epd.encode.metrics(), epd.decode.metrics()
    before = ec_entries(epd)

    resp = E.post(proxies["E+P+D"].url, E.endpoint_path(endpoint), body)

    E.assert_ok(resp, stream)
    assert E.text_of(resp, endpoint) == E.text_of(ref, endpoint)
    assert ec_entries(epd) == before
    assert E.delta(epd.decode, E.NIXL_XFERS, d0, 1) == 1
    assert epd.encode.metrics().get("vllm:prompt_tokens_total") == e0.get("vllm:prompt_tokens_total")


@pytest.mark.parametrize("stream", STREAMS, ids=["nonstream", "stream"])
def test_epd_encoder_400_is_relayed(epd, proxies, stream):
    """An image vLLM cannot decode: the encoder's 400 body reaches the client unchanged."""
    body = E.image_chat_body("data:image/png;base64,AAAA", stream=stream)
    direct = E.post(epd.encode.url, "/v1/chat/completions", dict(body, stream=False))
    assert direct.status == 400, E.describe(direct)

    resp = E.post(proxies["E+P+D"].url, "/v1/chat/completions", body, timeout=60)

    assert resp.status == 400, E.describe(resp)
    assert resp.body == direct.body, (f"\nproxy:  {resp.body[:500]!r}"
                                      f"\nvLLM:   {direct.body[:500]!r}")


def test_epd_image_url_that_never_answers(epd, start_proxy):
    """An image URL whose server accepts and never answers: vLLM's encoder keeps fetching it
    (VLLM_IMAGE_FETCH_TIMEOUT 5 s, then retries at 20 s and 80 s: about 110 s), an item that
    hangs every encoder. The proxy, with the one vLLM encoder under two addresses (two
    instances to it), answers 504 once both encode attempts have timed out (10 s each by
    default; the second is the hedge started after 2 s, so about 12 s), counts the item, and
    blames neither instance (docs/architecture.md, "The encode stage")."""
    import socket
    import time

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)  # connections wait in its backlog: accepted by the kernel, never answered
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/never.png"
        body = E.image_chat_body(url)
        with pytest.raises(TimeoutError):  # vLLM is still retrying its fetch
            E.post(epd.encode.url, "/v1/chat/completions", body, timeout=12)

        port = epd.encode.url.rsplit(":", 1)[1]
        proxy = start_proxy("epd-never-answers", encode=[epd.encode.url, f"http://localhost:{port}"],
                            prefill=[epd.prefill.url], decode=[epd.decode.url],
                            extra=["--allowed-media-hosts", "127.0.0.1"])
        t0 = time.monotonic()
        resp = E.post(proxy.url, "/v1/chat/completions", body, timeout=60)
        elapsed = time.monotonic() - t0
        print(f"\n[e2e] through the proxy: HTTP {resp.status} after {elapsed:.2f} s: {resp.body[:200]!r}")
        assert resp.status == 504 and "media item 0" in resp.body.decode(), E.describe(resp)
        assert 10 < elapsed < 30, elapsed  # two overlapping encode timeouts of 10 s, not vLLM's 110 s
        metrics = E.request(proxy.url, "GET", "/metrics").body.decode()
        assert 'epd_proxy_encode_item_failures_total{reason="item_timeout"} 1' in metrics
        timeouts = [line for line in metrics.splitlines()
                    if line.startswith("epd_proxy_instance_failures_total") and 'kind="timeout"' in line
                    and 'role="encode"' in line]
        assert len(timeouts) == 2 and all(line.rsplit(" ", 1)[1] in ("0", "0.0") for line in timeouts), timeouts
    finally:
        listener.close()
