"""The EC hand-off store and both sides of the EC hand-off, without sockets."""

from epd_proxy.sim.ec_store import (
    EcEntry,
    EcStore,
    empty_embeds_refusal,
    encode_groups,
    load_for_consumer,
    store_outputs,
)
from epd_proxy.sim.tokens import MediaRef, analyze


def _media(index, mm_hash, *, raw=True, metadata=None, family="image"):
    return MediaRef(index=index, type="image_url" if raw else "image_embeds", family=family, part={},
                    mm_hash=mm_hash, metadata=metadata if metadata is not None else {"image_grid_thw": [[1, 4, 4]]},
                    raw=raw)


def test_ec_store_evicts_the_oldest_entry_beyond_capacity():
    store = EcStore(capacity=2)
    for key in ("a", "b", "c"):
        store.put(key, EcEntry({}, 0, "encode-0", "127.0.0.1", 1))
    assert store.keys() == ["b", "c"]


def test_identical_items_of_one_request_share_one_encoder_entry():
    groups = encode_groups([_media(0, "h1"), _media(1, "h2"), _media(2, "h1"), _media(3, "h3", raw=False)])
    assert {k: g["item_indices"] for k, g in groups.items()} == {"h1": [0, 2], "h2": [1]}


def test_consumer_loads_hits_encodes_misses_and_fails_a_missing_reference():
    store = EcStore()
    store.put("h1", EcEntry({"image_grid_thw": [[1, 4, 4]]}, 0, "encode-0", "127.0.0.1", 1))
    ok = load_for_consumer(store, [_media(0, "h1"), _media(1, "h2")], "pd-0")
    assert (ok.hits, ok.local_encodes, ok.error) == (1, 1, None)
    bad = load_for_consumer(store, [_media(0, "h9", raw=False)], "pd-0")
    assert bad.error is not None and "h9" in bad.error


def test_embeds_without_data_are_refused_as_vllm_refuses_them():
    assert empty_embeds_refusal([_media(0, "h1")]) is None
    msg = empty_embeds_refusal([_media(0, "h1", raw=False, metadata={})])
    assert msg.endswith("but got 1 vs 0.")


def test_an_entry_remembers_the_content_it_was_encoded_from():
    """A reference resolves through the store to the content its entry was encoded from."""
    store = EcStore()
    media = [MediaRef(0, "image_url", "image", {}, "uuid-1", {"image_grid_thw": [[1, 4, 4]]}, True, "content-1")]
    store_outputs(store, encode_groups(media), example=False, hidden_size=8, producer="encode-0",
                  host="127.0.0.1", port=1)
    assert store.content_of("uuid-1") == "content-1" and store.content_of("uuid-2") is None


def test_fingerprint_follows_the_content_not_the_uuid():
    """A uuid keys caches only: the raw image answers alike under any uuid; a reference takes
    the content its entry stands for, and without an entry its own key."""
    url = "https://example.com/a.jpg"
    raw = {"type": "image_url", "image_url": {"url": url}}
    grid = {"image_grid_thw": [1, 6, 8]}

    def body(part):
        return {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "what?"}]}]}

    plain = analyze(body(raw), True)
    assert analyze(body({**raw, "uuid": "k1"}), True).fingerprint == plain.fingerprint
    ref = body({"type": "image_embeds", "image_embeds": grid, "uuid": "k1"})
    content = plain.media[0].content
    assert analyze(ref, True, {"k1": content}.get).fingerprint == plain.fingerprint
    assert analyze(ref, True, {}.get).fingerprint == analyze(ref, True).fingerprint != plain.fingerprint
