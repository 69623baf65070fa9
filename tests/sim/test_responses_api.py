"""``/v1/responses`` (OpenAI Responses), as vLLM 0.32 serves it: the response object, the typed
events, the store (retrieve, cancel, previous_response_id) and P/D."""

from __future__ import annotations

import asyncio

import pytest
from simhelpers import fast_config, named_events, nixl_prefill_params

from epd_proxy.sim import SimCluster, expected_text, prompt_tokens
from epd_proxy.sim.responses_api import to_chat

PATH = "/v1/responses"
RID = [(b"x-request-id", b"r-1")]


def text_of(reply) -> str:
    if reply.headers[b"content-type"].startswith(b"text/event-stream"):
        return "".join(d["delta"] for n, d in named_events(reply.data) if n == "response.output_text.delta")
    return "".join(p["text"] for item in reply.json["output"] for p in item["content"])


async def test_non_stream_response_object(http):
    async with SimCluster(pd=1, config=fast_config(created=1700000000)) as c:
        body = {"model": "sim-model", "input": "describe the responses api", "instructions": "be brief",
                "max_output_tokens": 5}
        r = await http.post(c.urls("pd")[0], PATH, body, headers=RID)
        assert r.status == 200
        j = r.json
        chat = to_chat(body)
        assert chat["messages"][0] == {"role": "system", "content": "be brief"}
        assert j["id"] == "resp_r-1" and j["object"] == "response" and j["created_at"] == 1700000000
        assert j["status"] == "incomplete" and j["incomplete_details"] == {"reason": "max_output_tokens"}
        assert j["max_output_tokens"] == 5 and j["instructions"] == "be brief"
        (item,) = j["output"]
        assert item["type"] == "message" and item["role"] == "assistant" and item["status"] == "completed"
        assert item["id"].startswith("msg_")
        assert item["content"] == [{"annotations": [], "text": expected_text(chat), "type": "output_text",
                                    "logprobs": None}]
        p = prompt_tokens(chat)
        assert j["usage"]["input_tokens"] == p and j["usage"]["output_tokens"] == 5
        assert j["usage"]["total_tokens"] == p + 5
        assert j["kv_transfer_params"] is None and j["ec_transfer_params"] is None
        # Without a cap the model stops by itself: completed.
        r = await http.post(c.urls("pd")[0], PATH, {"input": "describe the responses api"})
        assert r.json["status"] == "completed" and r.json["incomplete_details"] is None
        assert r.json["max_output_tokens"] == 32768 - prompt_tokens(to_chat({"input": "describe the responses api"}))


async def test_stream_typed_events(http):
    async with SimCluster(pd=1, config=fast_config()) as c:
        body = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "stream please"}]}],
                "max_output_tokens": 3, "stream": True}
        r = await http.post(c.urls("pd")[0], PATH, body, headers=RID)
        assert r.status == 200 and b"[DONE]" not in r.data
        evs = named_events(r.data)
        assert [n for n, _ in evs] == [
            "response.created", "response.in_progress", "response.output_item.added",
            "response.content_part.added"] + ["response.output_text.delta"] * 3 + [
            "response.output_text.done", "response.content_part.done", "response.output_item.done",
            "response.completed"]
        assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
        assert all(d["type"] == n for n, d in evs)
        created = evs[0][1]["response"]
        assert created["status"] == "in_progress" and created["output"] == [] and created["usage"] is None
        final = evs[-1][1]["response"]
        assert final["status"] == "incomplete" and final["id"] == "resp_r-1"
        text = expected_text(to_chat(body))
        assert text_of(r) == text == evs[-4][1]["text"] == final["output"][0]["content"][0]["text"]
        item_ids = {d["item_id"] for _, d in evs[3:-2]} | {evs[2][1]["item"]["id"], evs[-2][1]["item"]["id"]}
        assert item_ids == {final["output"][0]["id"]}
        assert all(e["response"]["kv_transfer_params"] is None for _, e in (evs[0], evs[1], evs[-1]))


async def test_input_image_parts_are_media(http):
    async with SimCluster(pd=1, config=fast_config()) as c:
        body = {"input": [{"role": "user", "content": [
            {"type": "input_text", "text": "what is this"},
            {"type": "input_image", "image_url": "https://example.com/dog.png", "detail": "auto"}]}]}
        chat = to_chat(body)
        assert chat["messages"][0]["content"][1] == {"type": "image_url",
                                                     "image_url": {"url": "https://example.com/dog.png"}}
        r = await http.post(c.urls("pd")[0], PATH, body)
        assert r.json["usage"]["input_tokens"] == prompt_tokens(chat) > 4
        assert text_of(r) == expected_text(chat)
        assert c.instances("pd")[0].stats.local_encodes == 1


async def test_store_retrieve_cancel_and_previous_response(http):
    async with SimCluster(pd=2, config=fast_config()) as c:
        a, b = c.urls("pd")
        first = {"input": "first turn", "max_output_tokens": 4}
        r1 = await http.post(a, PATH, first, headers=RID)
        got = await http.get(a, "/v1/responses/resp_r-1")
        assert got.status == 200 and got.json == r1.json
        # Cancelling a finished (synchronous) response is refused, as vLLM does.
        r = await http.post(a, "/v1/responses/resp_r-1/cancel", None)
        assert r.status == 400 and r.json["error"] == {
            "message": "Cannot cancel a synchronous response.", "type": "invalid_request_error",
            "param": "response_id", "code": 400}
        missing = {"error": {"message": "Response with id 'resp_nope' not found.", "type": "invalid_request_error",
                             "param": "response_id", "code": 404}}
        for method, path in (("GET", "/v1/responses/resp_nope"), ("POST", "/v1/responses/resp_nope/cancel")):
            r = await http.request(method, a, path)
            assert r.status == 404 and r.json == missing
        # The follow-up continues the stored conversation: its messages and its answer.
        second = {"input": "second turn", "max_output_tokens": 4, "previous_response_id": "resp_r-1"}
        r2 = await http.post(a, PATH, second)
        assert r2.status == 200 and r2.json["previous_response_id"] == "resp_r-1"
        history = [*to_chat(first)["messages"], {"role": "assistant", "content": text_of(r1)}]
        assert text_of(r2) == expected_text(to_chat(second, history))
        assert r2.json["usage"]["input_tokens"] == prompt_tokens(to_chat(second, history))
        # Another instance does not hold it.
        r = await http.post(b, PATH, second)
        assert r.status == 404 and r.json == {"error": dict(missing["error"],
                                                            message="Response with id 'resp_r-1' not found.")}
        # store: false keeps nothing; a crash forgets everything.
        await http.post(a, PATH, dict(first, store=False), headers=[(b"x-request-id", b"r-2")])
        assert (await http.get(a, "/v1/responses/resp_r-2")).status == 404
        inst = c.instances("pd")[0]
        await inst.crash()
        await inst.restart()
        assert (await http.get(a, "/v1/responses/resp_r-1")).status == 404


async def test_store_off_as_plain_vllm(http):
    async with SimCluster(pd=1, config=fast_config(responses_store=False)) as c:
        await http.post(c.urls("pd")[0], PATH, {"input": "hi"}, headers=RID)
        assert (await http.get(c.urls("pd")[0], "/v1/responses/resp_r-1")).status == 404


@pytest.mark.parametrize("stream", [False, True])
async def test_prefill_then_decode_equals_one_instance(http, stream):
    async with SimCluster(prefill=1, decode=1, pd=1, config=fast_config()) as c:
        body = {"input": "a prompt that is split between prefill and decode", "max_output_tokens": 6,
                "stream": stream}
        alone = await http.post(c.urls("pd")[0], PATH, body)
        pre = dict(body, max_output_tokens=1, stream=False, store=False, kv_transfer_params=nixl_prefill_params())
        rp = await http.post(c.urls("prefill")[0], PATH, pre, headers=[(b"x-request-id", b"pd-1")])
        assert rp.status == 200
        kv = rp.json["kv_transfer_params"]
        assert kv["do_remote_prefill"] is True and kv["remote_block_ids"] and kv["remote_request_id"] == "resp_pd-1"
        rd = await http.post(c.urls("decode")[0], PATH, dict(body, kv_transfer_params=kv))
        assert rd.status == 200
        assert text_of(rd) == text_of(alone) == expected_text(to_chat(body))
        assert c.instances("decode")[0].stats.kv_pulls == 1 and c.instances("decode")[0].stats.local_prefills == 0
        assert c.held_kv_blocks == 0
        if not stream:
            assert rd.json["kv_transfer_params"] is None


async def test_generation_failure_breaks_the_stream(http):
    async with SimCluster(pd=1, config=fast_config()) as c:
        r = await http.post(c.urls("pd")[0], PATH, {"input": "x", "sim_fault": "error-after=0"})
        assert r.status == 500 and r.json["error"]["type"] == "InternalServerError"
        with pytest.raises(Exception):  # noqa: B017  # the connection is reset mid-stream
            await http.post(c.urls("pd")[0], PATH, {"input": "x", "stream": True, "sim_fault": "error-after=1"})


async def test_encode_prefill_decode_with_an_image(http):
    async with SimCluster(encode=1, prefill=1, decode=1, pd=1, config=fast_config()) as c:
        body = {"input": [{"role": "user", "content": [
            {"type": "input_text", "text": "what is in the picture"},
            {"type": "input_image", "image_url": "https://example.com/bird.png"}]}], "max_output_tokens": 5}
        alone = await http.post(c.urls("pd")[0], PATH, body)
        re = await http.post(c.urls("encode")[0], PATH, dict(body, store=False))
        assert re.status == 200 and text_of(re) == ""
        (entry,) = re.json["ec_transfer_params"].values()
        assert entry["metadata"]["image_grid_thw"]
        # The raw item without uuid is found in the EC store by its content hash (--no-rewrite).
        pre = dict(body, max_output_tokens=1, store=False, kv_transfer_params=nixl_prefill_params(),
                   ec_transfer_params=re.json["ec_transfer_params"])
        rp = await http.post(c.urls("prefill")[0], PATH, pre)
        assert rp.status == 200 and c.instances("prefill")[0].stats.ec_hits == 1
        assert c.instances("prefill")[0].stats.local_encodes == 0
        rd = await http.post(c.urls("decode")[0], PATH, dict(body, kv_transfer_params=rp.json["kv_transfer_params"]))
        assert text_of(rd) == text_of(alone) == expected_text(to_chat(body))


async def _until(predicate, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not await predicate():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.01)


async def test_background_response_completes(http):
    async with SimCluster(pd=1, config=fast_config()) as c:
        url = c.urls("pd")[0]
        body = {"input": "run me in the background", "max_output_tokens": 20, "background": True}
        r = await http.post(url, PATH, body, headers=RID)
        assert r.status == 200 and r.json["status"] == "queued" and r.json["background"] is True
        assert r.json["output"] == [] and r.json["usage"] is None

        async def done() -> bool:
            return (await http.get(url, "/v1/responses/resp_r-1")).json["status"] != "queued"
        await _until(done)
        final = (await http.get(url, "/v1/responses/resp_r-1")).json
        assert final["status"] == "incomplete" and text_of_json(final) == expected_text(to_chat(body))
        r = await http.post(url, "/v1/responses/resp_r-1/cancel", None)
        assert r.status == 400


async def test_background_response_cancelled(http):
    async with SimCluster(pd=1, config=fast_config(itl_ms=20)) as c:
        url = c.urls("pd")[0]
        inst = c.instances("pd")[0]
        body = {"input": "a long background answer", "max_output_tokens": 500, "background": True}
        r = await http.post(url, PATH, body, headers=RID)
        assert r.json["status"] == "queued"
        r = await http.post(url, "/v1/responses/resp_r-1/cancel", None)
        assert r.status == 200 and r.json["status"] == "cancelled"

        async def aborted() -> bool:
            return inst.engine.num_running == 0 and inst.stats.success["abort"] == 1
        await _until(aborted)
        assert (await http.get(url, "/v1/responses/resp_r-1")).json["status"] == "cancelled"
        r = await http.post(url, PATH, dict(body, stream=True))
        assert r.status == 400 and r.json["error"]["param"] == "background"


def text_of_json(response: dict) -> str:
    return "".join(p["text"] for item in response["output"] for p in item["content"])
