"""Encoders (EC producers) and EC consumers."""

from __future__ import annotations

import hashlib

from blake3 import blake3
from simhelpers import GENERIC_EVENT, failure, fast_config, metric, prefill_body, stream_text

from epd_proxy.sim import SimCluster, expected_text, media_metadata
from epd_proxy.sim.tokens import prompt_tokens

URL_A = "https://example.com/a.jpg"
URL_B = "https://example.com/b.jpg"


def digest(s: str) -> str:
    """The content hash, as the simulator and the proxy take it: BLAKE3 in hex."""
    return blake3(s.encode()).hexdigest()


def image(url: str, uuid: str | None = "auto") -> dict:
    part = {"type": "image_url", "image_url": {"url": url}}
    if uuid == "auto":
        part["uuid"] = digest(url)
    elif uuid is not None:
        part["uuid"] = uuid
    return part


def flat(meta: dict) -> dict:
    out = {}
    for k, v in meta.items():
        out[k] = [x for sub in v for x in (sub if isinstance(sub, list) else [sub])]
    return out


def embeds(url: str, meta: dict) -> dict:
    return {"type": "image_embeds", "image_embeds": flat(meta), "uuid": digest(url)}


def client_body(*parts, **kw) -> dict:
    body = {"model": "sim-model", "messages": [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": [*parts, {"type": "text", "text": "What is in these images?"}]}]}
    body.update(kw)
    return body


async def encode(http, cluster, parts, i=0, **extra) -> dict:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": list(parts)}], "stream": False}
    body.update(extra)
    r = await http.chat(cluster.urls("encode")[i], body, rid="r1:0:abcdef")
    assert r.status == 200, r.data
    j = r.json
    assert j["choices"][0]["message"]["content"] == "" and j["usage"]["completion_tokens"] == 0
    assert j["kv_transfer_params"] is None
    return j["ec_transfer_params"]


async def test_encoder_batches_identical_items_and_reports_grids(http):
    async with SimCluster(encode=1, pd=1, config=fast_config()) as c:
        ec = await encode(http, c, [image(URL_A), image(URL_B), image(URL_A)])
        assert set(ec) == {digest(URL_A), digest(URL_B)}
        a = ec[digest(URL_A)]
        assert a["item_indices"] == [0, 2] and ec[digest(URL_B)]["item_indices"] == [1]
        assert a["metadata"] == media_metadata(image(URL_A))
        (t, h, w), = a["metadata"]["image_grid_thw"]
        assert t == 1 and 4 <= h <= 32 and 4 <= w <= 32
        e = c.instances("encode")[0]
        assert (a["peer_host"], a["peer_port"]) == (e.host, e.port)
        assert a["size_bytes"] == (h * w // 4) * 2048 * 2
        assert e.stats.encoded_items == 3
        assert len(c.ec_store) == 2


async def test_engine_hash_processed_and_no_uuid(http):
    async with SimCluster(encode=1, pd=1, config=fast_config()) as c:
        ec = await encode(http, c, [image(URL_A)], mm_processor_kwargs={"max_pixels": 1000})
        assert list(ec) == [digest(URL_A) + "-processed"]
        ec = await encode(http, c, [image(URL_B, uuid=None)])  # --no-rewrite: content hash
        assert list(ec) == [digest(URL_B)]
        audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
        ec = await encode(http, c, [audio])
        (entry,) = ec.values()
        assert set(entry["metadata"]) == {"audio_feature_lengths"}
        video = {"type": "video_url", "video_url": {"url": "https://x/v.mp4"}}
        ec = await encode(http, c, [video])
        assert set(next(iter(ec.values()))["metadata"]) == {"video_grid_thw"}


async def test_consumer_with_embedding_succeeds_and_output_matches_client_body(http):
    async with SimCluster(encode=1, pd=1, config=fast_config()) as c:
        ec = await encode(http, c, [image(URL_A), image(URL_B)])
        meta_a, meta_b = ec[digest(URL_A)]["metadata"], ec[digest(URL_B)]["metadata"]
        client = client_body(image(URL_A, None), image(URL_B, None), max_tokens=7)
        rewritten = client_body(embeds(URL_A, meta_a), embeds(URL_B, meta_b), max_tokens=7,
                                ec_transfer_params={"ec_items": [{"mm_hash": digest(URL_A), "transfer_id": "0" * 32}],
                                                    **ec})
        pd = c.instances("pd")[0]
        r = await http.chat(pd.url, rewritten)
        assert r.status == 200, r.data
        # The text depends on the prompt content, which the rewrite preserves.
        assert r.json["choices"][0]["message"]["content"] == expected_text(client)
        direct = await http.chat(pd.url, client)
        assert direct.json["choices"][0]["message"]["content"] == expected_text(client)
        assert direct.json["usage"] == r.json["usage"]
        # The rewritten request loaded both embeddings; the raw one found them in the EC store too.
        assert pd.stats.ec_hits == 4 and pd.stats.local_encodes == 0


async def test_consumer_without_embedding_fails(http):
    async with SimCluster(encode=1, pd=1, config=fast_config()) as c:
        meta = media_metadata(image(URL_A))
        body = client_body(embeds(URL_A, meta), max_tokens=3)
        pd = c.instances("pd")[0]
        r = await http.chat(pd.url, body)
        assert r.status == 500
        assert r.json["error"]["type"] == "InternalServerError" and "no embedding" in failure(r, pd)
        r = await http.chat(pd.url, dict(body, stream=True, n=2))
        assert r.status == 200
        evs = r.events
        # One role chunk per choice, then the in-band error and [DONE].
        assert [e["choices"][0]["index"] for e in evs[:2]] == [0, 1]
        assert all(e["choices"][0]["delta"] == {"role": "assistant", "content": ""} for e in evs[:2])
        assert "error" in evs[2] and evs[2]["error"]["code"] == 500 and evs[-1] == "[DONE]" and len(evs) == 4
        assert r.data.endswith(GENERIC_EVENT + b"data: [DONE]\n\n") and "no embedding" in failure(r, pd)
        assert pd.stats.ec_failures == 2
        # Encoded with mm_processor_kwargs, consumed without: the hashes differ -> miss.
        await encode(http, c, [image(URL_A)], mm_processor_kwargs={"max_pixels": 1})
        r = await http.chat(pd.url, body)
        assert r.status == 500
        r = await http.chat(pd.url, dict(body, mm_processor_kwargs={"max_pixels": 1}))
        assert r.status == 200
        m = (await http.get(pd.url, "/metrics")).data.decode()
        assert metric(m, "sim:ec_failures_total") == 3


async def test_metadata_mismatch_fails(http):
    async with SimCluster(encode=1, pd=1, config=fast_config()) as c:
        ec = await encode(http, c, [image(URL_A), image(URL_B)])
        meta_a, meta_b = ec[digest(URL_A)]["metadata"], ec[digest(URL_B)]["metadata"]
        assert meta_a != meta_b
        swapped = client_body(embeds(URL_A, meta_b), embeds(URL_B, meta_a), max_tokens=3)
        r = await http.chat(c.urls("pd")[0], swapped)
        assert r.status == 500 and "metadata mismatch" in failure(r, c.instances("pd")[0])
        # The unflattened form the encoder reported is accepted as well.
        ok = client_body({"type": "image_embeds", "image_embeds": meta_a, "uuid": digest(URL_A)}, max_tokens=3)
        assert (await http.chat(c.urls("pd")[0], ok)).status == 200


async def test_raw_media_is_encoded_locally(http):
    async with SimCluster(encode=1, pd=1, config=fast_config()) as c:
        pd = c.instances("pd")[0]
        r = await http.chat(pd.url, client_body(image(URL_A, None), image(URL_B), max_tokens=2))
        assert r.status == 200
        assert pd.stats.local_encodes == 2
        m = (await http.get(pd.url, "/metrics")).data.decode()
        assert metric(m, "sim:local_encodes_total") == 2
        # --no-rewrite: the encoder hashed the content, the consumer finds it.
        await encode(http, c, [image("https://example.com/c.jpg", None)])
        r = await http.chat(pd.url, client_body(image("https://example.com/c.jpg", None), max_tokens=2))
        assert r.status == 200 and pd.stats.local_encodes == 2 and pd.stats.ec_hits == 1


async def test_raw_and_embeds_of_one_modality_are_refused_as_vllm_does(http):
    """A consumer given one image raw (the proxy's local fallback) and another as a
    reference: vLLM's chat parser refuses the mix; all raw, with the encoded one's uuid, is
    served (the encoded image found in the EC store, the other encoded locally)."""
    async with SimCluster(encode=1, pd=1, config=fast_config()) as c:
        ec = await encode(http, c, [image(URL_A)])
        pd = c.instances("pd")[0]
        mixed = client_body(embeds(URL_A, ec[digest(URL_A)]["metadata"]), image(URL_B, None), max_tokens=2)
        r = await http.chat(pd.url, mixed)
        assert r.status == 400 and "Mixing raw image and embedding inputs" in r.json["error"]["message"]
        r = await http.chat(pd.url, client_body(image(URL_A), image(URL_B, None), max_tokens=2))
        assert r.status == 200 and (pd.stats.ec_hits, pd.stats.local_encodes) == (1, 1)


async def test_epd_full_flow_with_prefill_as_ec_consumer(http):
    async with SimCluster(encode=1, prefill=1, decode=1, config=fast_config()) as c:
        ec = await encode(http, c, [image(URL_A)])
        meta = ec[digest(URL_A)]["metadata"]
        client = client_body(image(URL_A, None), max_tokens=6, stream=True,
                             stream_options={"include_usage": True})
        rewritten = client_body(embeds(URL_A, meta), max_tokens=6, stream=True,
                                stream_options={"include_usage": True}, ec_transfer_params=ec)
        p = c.instances("prefill")[0]
        pr = await http.chat(p.url, prefill_body(rewritten), rid="epd-1")
        assert pr.status == 200 and p.stats.ec_hits == 1 and p.stats.local_encodes == 0
        kv = pr.json["kv_transfer_params"]
        dr = await http.chat(c.urls("decode")[0], dict(rewritten, kv_transfer_params=kv), rid="epd-1")
        assert stream_text(dr.events) == expected_text(client)
        d = c.instances("decode")[0]
        # D has no EC role: it loaded KV, never looked at the embeddings.
        assert d.stats.ec_hits == 0 and d.stats.ec_failures == 0 and d.stats.kv_pulls == 1
        # Without the embedding the prefill (EC consumer) fails.
        other = client_body(embeds(URL_B, media_metadata(image(URL_B))), max_tokens=2)
        r = await http.chat(p.url, prefill_body(other))
        assert r.status == 500 and "no embedding" in failure(r, p)


def sha256_uuid(url: str) -> str:
    """vLLM 0.33's EPD proxy's ``content_uuid``: sha256 of the URL, not the engine's hash."""
    return hashlib.sha256(url.encode()).hexdigest()


def vllm_epd_reference(url: str, ec: dict) -> dict:
    """The item as vLLM 0.33's EPD proxy rewrites it (``rewrite_for_decode``): a metadata-only
    reference under its own uuid, the encoder's grid flattened."""
    return {"type": "image_embeds", "image_embeds": flat(ec[sha256_uuid(url)]["metadata"]), "uuid": sha256_uuid(url)}


async def test_reference_under_vllm_epd_proxy_uuid_answers_as_the_raw_image(http):
    """E+P+D as vLLM 0.33's EPD proxy runs it: E gets the raw image with uuid sha256(url); P and
    D get a metadata reference under that uuid plus the encoder's entries and ``ec_items``. The
    answer is the raw image's (the uuid only keys the cache; the model sees the image)."""
    async with SimCluster(encode=1, prefill=1, decode=1, config=fast_config()) as c:
        ec = await encode(http, c, [image(URL_A, sha256_uuid(URL_A))])
        assert list(ec) == [sha256_uuid(URL_A)]
        client = client_body(image(URL_A, None), max_tokens=6, stream=True, stream_options={"include_usage": True})
        params = {**ec, "ec_items": [{"mm_hash": sha256_uuid(URL_A), "transfer_id": "0" * 32}]}
        rewritten = client_body(vllm_epd_reference(URL_A, ec), max_tokens=6, stream=True,
                                stream_options={"include_usage": True}, ec_transfer_params=params)
        p = c.instances("prefill")[0]
        pr = await http.chat(p.url, prefill_body(rewritten), rid="epd-1")
        assert pr.status == 200, pr.data
        assert (p.stats.ec_hits, p.stats.local_encodes) == (1, 0)
        dr = await http.chat(c.urls("decode")[0], dict(rewritten, kv_transfer_params=pr.json["kv_transfer_params"]),
                             rid="epd-1")
        assert dr.status == 200 and c.instances("decode")[0].stats.kv_pulls == 1
        assert stream_text(dr.events) == expected_text(client)
        assert dr.events[-2]["usage"]["prompt_tokens"] == prompt_tokens(client)


async def test_raw_image_and_reference_answer_alike_whatever_the_uuid(http):
    """E+PD: a raw image under any uuid, and a reference to its encoding under the uuid it was
    encoded with, answer as the image without uuid; the same image's processed form differs."""
    async with SimCluster(encode=1, pd=1, config=fast_config()) as c:
        ec = await encode(http, c, [image(URL_A, sha256_uuid(URL_A))])
        pd = c.instances("pd")[0]
        client = client_body(image(URL_A, None), max_tokens=5)
        want = expected_text(client)
        for part in (image(URL_A, "my-own-key"), image(URL_A), vllm_epd_reference(URL_A, ec)):
            r = await http.chat(pd.url, client_body(part, max_tokens=5))
            assert r.status == 200, r.data
            assert r.json["choices"][0]["message"]["content"] == want, part["type"]
            assert r.json["usage"]["prompt_tokens"] == prompt_tokens(client)
        processed = await encode(http, c, [image(URL_A, sha256_uuid(URL_A))], mm_processor_kwargs={"max_pixels": 4})
        ref = {"type": "image_embeds", "image_embeds": flat(processed[sha256_uuid(URL_A) + "-processed"]["metadata"]),
               "uuid": sha256_uuid(URL_A)}
        r = await http.chat(pd.url, client_body(ref, max_tokens=5, mm_processor_kwargs={"max_pixels": 4}))
        raw = client_body(image(URL_A, None), max_tokens=5, mm_processor_kwargs={"max_pixels": 4})
        assert r.status == 200 and r.json["choices"][0]["message"]["content"] == expected_text(raw) != want


async def test_reference_to_an_entry_the_encoder_did_not_produce_fails(http):
    """The image was encoded under one uuid; a reference under another names no entry: the
    consumer fails the request (vLLM's EC load failure), whatever the content."""
    async with SimCluster(encode=1, pd=1, config=fast_config()) as c:
        ec = await encode(http, c, [image(URL_A)])
        ref = {"type": "image_embeds", "image_embeds": flat(ec[digest(URL_A)]["metadata"]), "uuid": sha256_uuid(URL_A)}
        pd = c.instances("pd")[0]
        r = await http.chat(pd.url, client_body(ref, max_tokens=3))
        assert r.status == 500 and "no embedding" in failure(r, pd) and pd.stats.ec_failures == 1


async def test_example_connector_reports_empty_metadata(http):
    """ECExampleConnector: {"<mm_hash>": {"item_indices": [...], "metadata": {}}}, no handle."""
    async with SimCluster(encode=1, pd=1, config=fast_config(ec_connector="example")) as c:
        r = await http.chat(c.urls("encode")[0], {"model": "sim-model", "messages": [
            {"role": "user", "content": [image(URL_A), image(URL_B), image(URL_A)]}]})
        assert r.status == 200
        assert b'"ec_transfer_params":{"%s":{"item_indices":[0,2],"metadata":{}}' % digest(URL_A).encode() in r.data
        ec = r.json["ec_transfer_params"]
        assert ec == {digest(URL_A): {"item_indices": [0, 2], "metadata": {}},
                      digest(URL_B): {"item_indices": [1], "metadata": {}}}
        # The cache itself is there, under the hash (the shared directory).
        assert c.ec_store.get(digest(URL_A)).metadata == media_metadata(image(URL_A))
    # The default ("nixl") keeps the metadata and the handle.
    async with SimCluster(encode=1, config=fast_config()) as c:
        ec = await encode(http, c, [image(URL_A)])
        assert set(ec[digest(URL_A)]) == {"metadata", "item_indices", "peer_host", "peer_port", "size_bytes"}


async def _raw_part_consumption(http, connector: str) -> None:
    async with SimCluster(encode=1, pd=1, config=fast_config(ec_connector=connector)) as c:
        pd = c.instances("pd")[0]
        # E got the item with a uuid; the consumer gets the raw part with that same uuid: an EC hit.
        await encode(http, c, [image(URL_A, "u-a")])
        body = client_body(image(URL_A, "u-a"), max_tokens=3)
        r = await http.chat(pd.url, body)
        assert r.status == 200 and r.json["choices"][0]["message"]["content"] == expected_text(body)
        assert (pd.stats.ec_hits, pd.stats.local_encodes) == (1, 0)
        # The same uuid, but E ran with mm_processor_kwargs: the hash is "<uuid>-processed".
        await encode(http, c, [image(URL_B, "u-b")], mm_processor_kwargs={"max_pixels": 4})
        r = await http.chat(pd.url, client_body(image(URL_B, "u-b"), max_tokens=3,
                                                mm_processor_kwargs={"max_pixels": 4}))
        assert r.status == 200 and (pd.stats.ec_hits, pd.stats.local_encodes) == (2, 0)
        r = await http.chat(pd.url, client_body(image(URL_B, "u-b"), max_tokens=3))  # no kwargs: a miss
        assert r.status == 200 and (pd.stats.ec_hits, pd.stats.local_encodes) == (2, 1)
        # No uuid on either side: the content hash matches.
        await encode(http, c, [image("https://example.com/c.jpg", None)])
        r = await http.chat(pd.url, client_body(image("https://example.com/c.jpg", None), max_tokens=3))
        assert r.status == 200 and (pd.stats.ec_hits, pd.stats.local_encodes) == (3, 1)
        # A uuid E never saw (or E got no uuid and the consumer does): encoded locally.
        r = await http.chat(pd.url, client_body(image("https://example.com/c.jpg", "other"), max_tokens=3))
        assert r.status == 200 and (pd.stats.ec_hits, pd.stats.local_encodes) == (3, 2)
        r = await http.chat(pd.url, client_body(image("https://example.com/d.jpg", None), max_tokens=3))
        assert r.status == 200 and (pd.stats.ec_hits, pd.stats.local_encodes) == (3, 3)
        m = (await http.get(pd.url, "/metrics")).data.decode()
        assert metric(m, "sim:ec_hits_total") == 3 and metric(m, "sim:local_encodes_total") == 3


async def test_raw_part_with_encoder_uuid_is_an_ec_hit_example_connector(http):
    await _raw_part_consumption(http, "example")


async def test_raw_part_with_encoder_uuid_is_an_ec_hit_nixl_connector(http):
    await _raw_part_consumption(http, "nixl")


async def test_example_connector_refuses_embeds_without_data(http):
    """An ``*_embeds`` reference built from empty metadata is vLLM's 400 (BLIP-2 and other
    models without embedding fields), before any stream starts."""
    async with SimCluster(encode=1, pd=1, config=fast_config(ec_connector="example")) as c:
        await encode(http, c, [image(URL_A)])
        part = {"type": "image_embeds", "image_embeds": {}, "uuid": digest(URL_A)}
        for stream in (False, True):
            r = await http.chat(c.urls("pd")[0], client_body(part, max_tokens=2, stream=stream))
            assert r.status == 400 and r.json == {"error": {
                "message": "If given, multi_modal_uuids['image'] must have same length as "
                           "multi_modal_data['image'], but got 1 vs 0.",
                "type": "BadRequestError", "param": None, "code": 400}}
        with_data = embeds(URL_B, media_metadata(image(URL_B)))
        r = await http.chat(c.urls("pd")[0], client_body(with_data, part, max_tokens=2))
        assert r.status == 400 and "but got 2 vs 1." in r.json["error"]["message"]
        # A raw image beside it: the chat parser's refusal of the mix comes first.
        r = await http.chat(c.urls("pd")[0], client_body(image(URL_B), part, max_tokens=2))
        assert r.status == 400 and "Mixing raw image" in r.json["error"]["message"]
        assert c.instances("pd")[0].stats.ec_failures == 0


def test_metadata_of_a_long_url_follows_its_length_head_and_tail():
    head = "data:image/png;base64," + "A" * 5000
    tail = "B" * 5000
    same = media_metadata(image(head + "x" * 100 + tail))
    # The middle is not read (a real encoder takes the size from the header) ...
    assert media_metadata(image(head + "y" * 100 + tail)) == same
    # ... the length, the head and the tail are.
    lengths = {str(media_metadata(image(head + "x" * n + tail))) for n in range(100, 140)}
    heads = {str(media_metadata(image(head[:30] + c + head[31:] + "x" * 100 + tail))) for c in "CDEFGHIJKL"}
    tails = {str(media_metadata(image(head + "x" * 100 + tail[:-30] + c + tail[-29:]))) for c in "CDEFGHIJKL"}
    assert len(lengths) > 20 and len(heads) > 5 and len(tails) > 5
    # A short payload is read whole.
    assert media_metadata(image(URL_A)) != media_metadata(image(URL_B))
