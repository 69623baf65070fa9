"""``POST /inference/v1/generate`` (token ids in and out), as vLLM 0.32 serves it with
``--enable-scale-out``."""

from __future__ import annotations

import argparse

import pytest
from simhelpers import fast_config, nixl_prefill_params, sse_events

from epd_proxy.sim import VOCAB, SimCluster, SimConfig, expected_text, expected_tokens
from epd_proxy.sim import cli as sim_cli
from epd_proxy.sim.generate import to_completion

PATH = "/inference/v1/generate"
PROMPT = [101, 7592, 2088, 2003, 1037, 3231, 102]


def token_ids(reply) -> list[int]:
    if reply.headers[b"content-type"].startswith(b"text/event-stream"):
        return [t for ev in sse_events(reply.data) if isinstance(ev, dict)
                for ch in ev["choices"] for t in ch["token_ids"]]
    return reply.json["choices"][0]["token_ids"]


def text(ids: list[int]) -> str:
    return "".join(VOCAB[t] for t in ids)


async def test_forbidden_without_scale_out(http):
    async with SimCluster(pd=1, config=fast_config()) as c:
        r = await http.post(c.urls("pd")[0], PATH, {"token_ids": PROMPT, "sampling_params": {}})
        assert r.status == 403
        assert r.json == {"error": {
            "message": "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them.",
            "type": "PermissionDeniedError", "param": None, "code": 403}}
        assert c.instances("pd")[0].stats.requests == 0


async def test_non_stream_and_stream(http):
    async with SimCluster(pd=1, config=fast_config(enable_scale_out=True, created=1700000000)) as c:
        url = c.urls("pd")[0]
        body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 5}}
        r = await http.post(url, PATH, body, headers=[(b"x-request-id", b"g-1")])
        assert r.status == 200
        j = r.json
        assert j["request_id"] == "generate-tokens-g-1" and j["created"] == 1700000000
        assert j["output_mode"] == "tokens" and j["kv_transfer_params"] is None
        (ch,) = j["choices"]
        assert ch["finish_reason"] == "length" and len(ch["token_ids"]) == 5
        assert text(ch["token_ids"]) == expected_text(to_completion(body))
        assert j["usage"] == {"prompt_tokens": len(PROMPT), "total_tokens": len(PROMPT) + 5, "completion_tokens": 5,
                              "prompt_tokens_details": None, "completion_tokens_details": None}
        s = await http.post(url, PATH, dict(body, stream=True, stream_options={"include_usage": True}),
                            headers=[(b"x-request-id", b"g-2")])
        evs = sse_events(s.data)
        assert evs[-1] == "[DONE]" and len(evs) == 5 + 2
        assert evs[0] == {"request_id": "generate-tokens-g-2", "usage": None, "output_mode": "tokens",
                          "choices": [{"index": 0, "finish_reason": None, "stop_reason": None,
                                       "token_ids": ch["token_ids"][:1], "routed_experts": None,
                                       "sampling_mask": None, "weight_versions": None, "logprobs": None}]}
        assert evs[4]["choices"][0]["finish_reason"] == "length"
        assert evs[5] == {"request_id": "generate-tokens-g-2", "output_mode": "tokens", "choices": [],
                          "usage": {"prompt_tokens": len(PROMPT), "total_tokens": len(PROMPT) + 5,
                                    "completion_tokens": 5}}
        assert token_ids(s) == ch["token_ids"]
        # Without a cap the model stops by itself.
        r = await http.post(url, PATH, {"token_ids": PROMPT, "sampling_params": {}})
        assert r.json["choices"][0]["finish_reason"] == "stop"
        assert text(token_ids(r)) == "".join(expected_tokens(to_completion({"token_ids": PROMPT,
                                                                             "sampling_params": {}})))
        r = await http.post(url, PATH, dict(body, request_id="mine"))
        assert r.json["request_id"] == "generate-tokens-mine"
        r = await http.post(url, PATH, dict(body, request_id="mine"), headers=[(b"x-request-id", b"g-3")])
        assert r.json["request_id"] == "generate-tokens-g-3"
        r = await http.post(url, PATH, {"sampling_params": {}})
        assert r.status == 400 and r.json["error"]["param"] == "body.token_ids"


@pytest.mark.parametrize("stream", [False, True])
async def test_prefill_then_decode_equals_one_instance(http, stream):
    async with SimCluster(prefill=1, decode=1, pd=1, config=fast_config(enable_scale_out=True)) as c:
        body = {"token_ids": PROMPT * 3, "sampling_params": {"max_tokens": 6}, "stream": stream}
        alone = await http.post(c.urls("pd")[0], PATH, body)
        pre = dict(body, stream=False, sampling_params={"max_tokens": 1}, kv_transfer_params=nixl_prefill_params())
        rp = await http.post(c.urls("prefill")[0], PATH, pre, headers=[(b"x-request-id", b"pd-1")])
        assert rp.status == 200
        kv = rp.json["kv_transfer_params"]
        assert kv["do_remote_prefill"] is True and kv["remote_request_id"] == "generate-tokens-pd-1"
        assert kv["remote_num_tokens"] == len(PROMPT) * 3
        rd = await http.post(c.urls("decode")[0], PATH, dict(body, kv_transfer_params=kv))
        assert rd.status == 200
        assert token_ids(rd) == token_ids(alone) and text(token_ids(rd)) == expected_text(to_completion(body))
        assert c.instances("decode")[0].stats.kv_pulls == 1 and c.instances("decode")[0].stats.local_prefills == 0
        assert c.held_kv_blocks == 0
        if not stream:
            assert rd.json["kv_transfer_params"] is None


async def test_in_band_error(http):
    async with SimCluster(pd=1, config=fast_config(enable_scale_out=True)) as c:
        body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 4}, "stream": True, "sim_fault": "error-after=2"}
        evs = sse_events((await http.post(c.urls("pd")[0], PATH, body)).data)
        assert len(evs) == 4 and evs[2]["error"]["type"] == "InternalServerError" and evs[3] == "[DONE]"


def test_switched_on_by_the_cli_and_the_spec():
    parser = argparse.ArgumentParser()
    sim_cli.add_arguments(parser)
    assert sim_cli.config_from_args(parser.parse_args(["--enable-scale-out"])).enable_scale_out is True
    assert sim_cli.config_from_args(parser.parse_args([])).enable_scale_out is False
    assert SimConfig().with_values({"enable_scale_out": "true"}).enable_scale_out is True
