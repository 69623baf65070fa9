import copy
import hashlib

import pytest
from chat_parts import body_with, digest, img

from epd_proxy.encode.ec_match import (
    ItemResult,
    consumer_ec_params,
    flatten_metadata,
    match_encoder_output,
    rewrite_media,
)
from epd_proxy.encode.encoder_plan import (
    SubRequest,
    encoder_body,
    new_transfer_id,
    plan_sub_requests,
)
from epd_proxy.encode.multimodal import client_key, collect_media, content_uuid
from epd_proxy.routing.policies import assign_round_robin
from epd_proxy.wire.errors import ProxyError


def sub_of(*urls, encoder=0):
    body = {"messages": [{"role": "user", "content": [img(u) for u in urls]}]}
    return SubRequest(encoder, collect_media(body))


# ---------------------------------------------------------------- matching


def test_single_item_single_entry_with_rehashed_key():
    sub = sub_of("https://x/a.jpg")
    entry = {"metadata": {"image_grid_thw": [[1, 2, 2]]}, "peer_port": 7}
    results, handles = match_encoder_output(sub, ["t0"], {"engine-h": entry})
    assert results == [
        ItemResult(
            metadata={"image_grid_thw": [[1, 2, 2]]},
            mm_hash=content_uuid(img("https://x/a.jpg")),
            ec_mm_hash="engine-h",
            transfer_id="t0",
        )
    ]
    assert handles == {"engine-h": entry}


def test_fallback_to_proxy_uuid_key():
    sub = sub_of("a", "b")
    ua, ub = (i.uuid for i in sub.items)
    params = {ub: {"metadata": {"g": [[2]]}}, ua: {"metadata": {"g": [[1]]}}}
    results, handles = match_encoder_output(sub, ["t0", "t1"], params)
    assert [r.metadata for r in results] == [{"g": [[1]]}, {"g": [[2]]}]
    assert [r.ec_mm_hash for r in results] == [ua, ub]
    assert set(handles) == {ua, ub}


def test_item_indices_with_reverse_reply_order_and_shared_entry():
    sub = sub_of("A", "C", "A")
    params = {
        "C-processed": {"metadata": {"g": [[1, 4, 4]]}, "item_indices": [1], "peer_port": 2},
        "A-processed": {"metadata": {"g": [[1, 2, 2]]}, "item_indices": [2, 0], "peer_port": 1},
    }
    results, handles = match_encoder_output(sub, ["t0", "t1", "t2"], params)
    assert [r.metadata["g"] for r in results] == [[[1, 2, 2]], [[1, 4, 4]], [[1, 2, 2]]]
    assert [r.ec_mm_hash for r in results] == ["A-processed", "C-processed", "A-processed"]
    assert [r.transfer_id for r in results] == ["t0", "t1", "t2"]
    assert handles["A-processed"]["peer_port"] == 1
    assert handles["C-processed"]["peer_port"] == 2


@pytest.mark.parametrize("bad", [2, -1, "0", 1.0, True, None])
def test_invalid_item_index_is_502(bad):
    sub = sub_of("a", "b")
    params = {"h": {"metadata": {"g": [1]}, "item_indices": [0, bad]}}
    with pytest.raises(ProxyError) as exc:
        match_encoder_output(sub, ["t0", "t1"], params)
    assert exc.value.status == 502
    assert "Invalid encoder item index" in exc.value.message


def test_item_indices_not_a_list_is_502():
    sub = sub_of("a", "b")
    with pytest.raises(ProxyError) as exc:
        match_encoder_output(sub, ["t0", "t1"], {"h": {"metadata": {}, "item_indices": 0}})
    assert exc.value.status == 502
    assert "Invalid encoder item index" in exc.value.message


def test_duplicate_item_index_is_502():
    sub = sub_of("a", "b")
    params = {
        "h1": {"metadata": {"g": [1]}, "item_indices": [0]},
        "h2": {"metadata": {"g": [2]}, "item_indices": [0, 1]},
    }
    with pytest.raises(ProxyError) as exc:
        match_encoder_output(sub, ["t0", "t1"], params)
    assert exc.value.status == 502
    assert "Duplicate encoder item index" in exc.value.message


def test_batch_rejects_ambiguous_metadata():
    sub = sub_of("a", "b")
    params = {"unknown-key": {"metadata": {"g": [1]}}}
    with pytest.raises(ProxyError) as exc:
        match_encoder_output(sub, ["t0", "t1"], params)
    assert exc.value.status == 502
    assert "cannot be matched" in exc.value.message


def test_single_item_with_two_unknown_entries_is_ambiguous():
    sub = sub_of("a")
    params = {"x": {"metadata": {"g": [1]}}, "y": {"metadata": {"g": [2]}}}
    with pytest.raises(ProxyError) as exc:
        match_encoder_output(sub, ["t0"], params)
    assert exc.value.status == 502


@pytest.mark.parametrize("params", [None, "garbage", [], {}, {"h": "not-a-dict"}, {"h": None}])
def test_missing_or_unusable_params_give_nothing(params):
    sub = sub_of("a", "b")
    assert match_encoder_output(sub, ["t0", "t1"], params) == ([None, None], {})


def test_non_dict_entries_are_skipped():
    sub = sub_of("a")
    params = {"junk": [1, 2], "h": {"metadata": {"g": [[1]]}}}
    results, handles = match_encoder_output(sub, ["t0"], params)
    assert results[0].ec_mm_hash == "h"
    assert list(handles) == ["h"]


def test_empty_metadata_still_contributes_handle():
    sub = sub_of("a")
    results, handles = match_encoder_output(sub, ["t0"], {"h": {"metadata": {}, "peer_port": 3}})
    assert results[0].metadata == {}
    assert handles == {"h": {"metadata": {}, "peer_port": 3}}
    # Not rewritten (kept raw with its uuid), but still declared: the consumer
    # resolves it to the same engine hash, in both modes.
    want = {"ec_items": [{"mm_hash": "h", "transfer_id": "t0"}], "h": {"metadata": {}, "peer_port": 3}}
    assert consumer_ec_params(sub.items, results, handles) == want
    assert consumer_ec_params(sub.items, results, handles, rewrite=False) == want


def test_transfer_ids_length_must_match():
    with pytest.raises(ValueError):
        match_encoder_output(sub_of("a", "b"), ["t0"], {})


# ---------------------------------------------------------------- consumer params


def test_consumer_params_engine_hash_and_ec_items():
    sub = sub_of("https://x/a.jpg")
    entry = {"metadata": {"image_grid_thw": [[1, 36, 52]]}, "item_indices": [0], "peer_port": 5601}
    results, handles = match_encoder_output(sub, ["transfer"], {"engine-derived-hash": entry})
    out = consumer_ec_params(sub.items, results, handles)
    assert out == {
        "ec_items": [{"mm_hash": "engine-derived-hash", "transfer_id": "transfer"}],
        "engine-derived-hash": entry,
    }
    assert results[0].mm_hash == content_uuid(img("https://x/a.jpg"))


def test_consumer_params_without_transfer_id():
    sub = sub_of("a")
    results = [ItemResult({"g": [1]}, sub.items[0].uuid, "eh", "")]
    assert consumer_ec_params(sub.items, results, {}) == {"ec_items": [{"mm_hash": "eh"}]}


def test_consumer_params_none_when_nothing():
    sub = sub_of("a", "b")
    assert consumer_ec_params(sub.items, [None, None], {}) is None
    assert consumer_ec_params([], [], {}) is None


# ---------------------------------------------------------------- batches keep item identity (docs/protocol.md §4.4)


GRIDS = {"A": [[1, 2, 2]], "C": [[1, 4, 4]], "D": [[1, 6, 6]], "F": [[1, 8, 8]]}


def fake_encoder(enc_body, port):
    """An engine: hashes by uuid (or content), rehashes with processing
    options, answers one entry per distinct hash in reverse order."""
    entries = {}
    for pos, part in enumerate(enc_body["messages"][0]["content"]):
        url = part["image_url"]["url"]
        base = part.get("uuid") or "content-" + hashlib.sha256(url.encode()).hexdigest()
        h = f"{base}-processed"
        letter = url[-5]
        entry = entries.setdefault(
            h, {"metadata": {"image_grid_thw": GRIDS[letter]}, "item_indices": [], "peer_port": port}
        )
        entry["item_indices"].append(pos)
    return dict(reversed(list(entries.items())))


def engine_hash_for(item, rewrite):
    url = item.part["image_url"]["url"]
    base = item.uuid if rewrite else "content-" + hashlib.sha256(url.encode()).hexdigest()
    return f"{base}-processed"


@pytest.mark.parametrize("rewrite", [True, False])
@pytest.mark.parametrize(
    "max_batch, sizes", [(0, [3, 3]), (1, [1] * 6), (2, [2, 2, 1, 1])]
)
def test_image_batches_preserve_item_identity(rewrite, max_batch, sizes):
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "sys"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "look"}]
                + [img(f"https://x/{c}.jpg") for c in "AACDAF"],
            },
        ],
        "mm_processor_kwargs": {"max_pixels": 1024},
        "stream": True,
    }
    before = copy.deepcopy(body)
    items = collect_media(body)
    encoders, _ = assign_round_robin(0, 2, len(items))
    subs = plan_sub_requests(items, encoders, max_batch)
    assert [len(s.items) for s in subs] == sizes

    sent_tids: dict[int, str] = {}  # global item index -> transfer id sent to E
    results = [None] * len(items)
    handles = {}
    seen_letters = {0: set(), 1: set()}
    for sub in subs:
        tids = [new_transfer_id() for _ in sub.items]
        eb = encoder_body(body, sub, rewrite=rewrite, transfer_ids=tids, consumer_zmq="tcp://c:1")
        assert eb["mm_processor_kwargs"] == {"max_pixels": 1024}
        assert [e["transfer_id"] for e in eb["ec_transfer_params"]["ec_items"]] == tids
        for part in eb["messages"][0]["content"]:
            assert ("uuid" in part) is rewrite
            seen_letters[sub.encoder].add(part["image_url"]["url"][-5])
        for item, t in zip(sub.items, tids):
            sent_tids[item.index] = t
        sub_results, sub_handles = match_encoder_output(sub, tids, fake_encoder(eb, 5600 + sub.encoder))
        for item, r in zip(sub.items, sub_results):
            results[item.index] = r
        handles.update(sub_handles)

    assert len(set(sent_tids.values())) == 6
    assert seen_letters == {0: {"A", "C"}, 1: {"A", "D", "F"}}
    letters = [i.part["image_url"]["url"][-5] for i in items]
    for item, r, letter in zip(items, results, letters):
        assert r.metadata == {"image_grid_thw": GRIDS[letter]}
        assert r.ec_mm_hash == engine_hash_for(item, rewrite)
        assert r.ec_mm_hash.endswith("-processed")
        assert r.mm_hash == item.uuid
        assert r.transfer_id == sent_tids[item.index]
    for h, entry in handles.items():
        assert h.endswith("-processed")
        assert entry["peer_port"] in (5600, 5601)

    params = consumer_ec_params(items, results, handles, rewrite=rewrite)
    # Positional resolution, as the Mooncake scheduler does: item i's engine
    # hash must sit at ec_items[i] with the transfer id E got for item i.
    ec_items = params["ec_items"]
    assert len(ec_items) == 6
    for item, r in zip(items, results):
        assert ec_items[item.index] == {"mm_hash": r.ec_mm_hash, "transfer_id": sent_tids[item.index]}
    assert set(params) == {"ec_items"} | set(handles)

    if rewrite:
        out = rewrite_media(body, items, results)
        parts = out["messages"][1]["content"]
        assert parts[0] == {"type": "text", "text": "look"}
        for item, letter in zip(items, letters):
            assert parts[item.part_index] == {
                "type": "image_embeds",
                "image_embeds": {"image_grid_thw": GRIDS[letter][0]},
                "uuid": content_uuid(item.part),
            }
    assert body == before


# ---------------------------------------------------------------- flatten


def test_flatten_metadata_one_level():
    assert flatten_metadata({"image_grid_thw": [[1, 36, 52]]}) == {"image_grid_thw": [1, 36, 52]}
    assert flatten_metadata({"g": [[1, 2], [3, 4]]}) == {"g": [1, 2, 3, 4]}
    assert flatten_metadata({"g": [[1, 2], 3]}) == {"g": [1, 2, 3]}
    assert flatten_metadata({"g": [[[1, 2]]]}) == {"g": [[1, 2]]}
    assert flatten_metadata({"g": [1, 2, 3], "s": 5, "t": "x"}) == {
        "g": [1, 2, 3],
        "s": 5,
        "t": "x",
    }


# ---------------------------------------------------------------- rewrite


def res(metadata, h="engine", t="tid"):
    return ItemResult(metadata=metadata, mm_hash="p", ec_mm_hash=h, transfer_id=t)


def test_rewrite_media_replaces_items_and_keeps_the_rest():
    text = {"type": "text", "text": "What is this?"}
    audio = {"type": "input_audio", "input_audio": {"data": "QQ==", "format": "wav"}}
    body = body_with(img("https://x/a.jpg"), text, audio, img("https://x/b.jpg"))
    body["messages"].append({"role": "user", "content": [{"type": "text", "text": "more"}]})
    before = copy.deepcopy(body)
    items = collect_media(body)
    results = [
        res({"image_grid_thw": [[1, 36, 52]]}),
        res({"audio_len": [[7]]}),
        None,
    ]
    out = rewrite_media(body, items, results)

    assert body == before
    content = out["messages"][1]["content"]
    # Image b has no result and stays raw, so image a does too: vLLM refuses raw images and
    # image_embeds in one request ("Mixing raw image and embedding inputs is not allowed").
    assert content[0] == {**img("https://x/a.jpg"), "uuid": digest("https://x/a.jpg")}
    assert content[1] is text
    assert content[2] == {
        "type": "audio_embeds",
        "audio_embeds": {"audio_len": [7]},
        "uuid": content_uuid(audio),
    }
    # No result: the raw part is kept, with the uuid the encoder was given.
    assert content[3] == {**body["messages"][1]["content"][3], "uuid": digest("https://x/b.jpg")}
    # Untouched messages are shared; changed ones are new objects.
    assert out["messages"][0] is body["messages"][0]
    assert out["messages"][2] is body["messages"][2]
    assert out["messages"][1] is not body["messages"][1]
    assert out["messages"] is not body["messages"]
    assert out["max_tokens"] == 8 and out["model"] == "m"


def test_rewrite_media_rewrites_a_modality_only_when_every_item_of_it_has_metadata():
    video = {"type": "video_url", "video_url": {"url": "https://x/v.mp4"}}
    body = body_with(img("https://x/a.jpg"), img("https://x/b.jpg"), video)
    items = collect_media(body)
    out = rewrite_media(body, items, [res({"image_grid_thw": [[1, 2, 2]]}), res({"image_grid_thw": [[1, 4, 4]]}), None])
    content = out["messages"][1]["content"]
    assert [p["type"] for p in content] == ["image_embeds", "image_embeds", "video_url"]
    # An image without metadata (ECExampleConnector) keeps both images raw; the video is another modality.
    out = rewrite_media(body, items, [res({}), res({"image_grid_thw": [[1, 4, 4]]}), None])
    assert [p["type"] for p in out["messages"][1]["content"]] == ["image_url", "image_url", "video_url"]
    assert all(p["uuid"] for p in out["messages"][1]["content"])


def test_rewrite_media_empty_metadata_keeps_raw_part():
    body = body_with(img("https://x/a.jpg"))
    items = collect_media(body)
    out = rewrite_media(body, items, [res({})])
    # Raw, but with the encoder's uuid, so the consumer hashes it as the encoder did.
    assert out["messages"][1]["content"][0] == {**img("https://x/a.jpg"), "uuid": digest("https://x/a.jpg")}
    assert body["messages"][1]["content"][0] == img("https://x/a.jpg")


def test_rewrite_media_uses_client_uuid_and_video_type():
    body = body_with({"type": "video_url", "video_url": {"url": "v"}, "uuid": "mine"})
    items = collect_media(body)
    out = rewrite_media(body, items, [res({"video_grid_thw": [[2, 4, 4]]})])
    assert out["messages"][1]["content"][0] == {
        "type": "video_embeds",
        "video_embeds": {"video_grid_thw": [2, 4, 4]},
        "uuid": client_key("mine"),
    }


def test_rewrite_media_length_mismatch():
    body = body_with(img("a"))
    with pytest.raises(ValueError):
        rewrite_media(body, collect_media(body), [])
