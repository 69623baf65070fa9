"""The official ``anthropic`` and ``openai`` SDKs against the proxy on the simulator: what a
client of one vLLM instance uses must work through P/D unchanged."""

from __future__ import annotations

import pytest
from helpers import stack

from epd_proxy.sim import SimConfig, expected_text
from epd_proxy.sim.messages import to_chat as messages_chat
from epd_proxy.sim.responses_api import to_chat as responses_chat

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

SIM = SimConfig(itl_ms=0, ttft_ms=0.5)
PROMPT = "tell me about prefill and decode"


async def test_anthropic_messages_create_and_stream():
    async with stack(sim=SIM) as (cluster, proxy, _):
        client = anthropic.AsyncAnthropic(base_url=proxy.url, api_key="unused", max_retries=0)
        try:
            messages = [{"role": "user", "content": PROMPT}]
            want = expected_text(messages_chat({"model": "sim-model", "max_tokens": 6, "messages": messages}))
            msg = await client.messages.create(model="sim-model", max_tokens=6, messages=messages)
            assert msg.content[0].text == want and msg.stop_reason == "max_tokens"
            assert msg.usage.output_tokens == 6 and msg.usage.input_tokens > 0
            async with client.messages.stream(model="sim-model", max_tokens=6, messages=messages) as stream:
                text = "".join([t async for t in stream.text_stream])
                final = await stream.get_final_message()
            assert text == want and final.usage.output_tokens == 6
        finally:
            await client.close()
        assert cluster.instances("decode")[0].stats.kv_pulls == 2


async def test_openai_responses_create_stream_and_retrieve():
    async with stack(sim=SIM) as (cluster, proxy, _):
        client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
        try:
            want = expected_text(responses_chat({"model": "sim-model", "input": PROMPT, "max_output_tokens": 6}))
            resp = await client.responses.create(model="sim-model", input=PROMPT, max_output_tokens=6)
            assert resp.output_text == want and resp.usage.output_tokens == 6
            got = await client.responses.retrieve(resp.id)
            assert got.id == resp.id and got.output_text == want
            stream = await client.responses.create(model="sim-model", input=PROMPT, max_output_tokens=6,
                                                   stream=True)
            deltas, completed = [], None
            async for event in stream:
                if event.type == "response.output_text.delta":
                    deltas.append(event.delta)
                elif event.type == "response.completed":
                    completed = event.response
            assert "".join(deltas) == want and completed is not None and completed.output_text == want
            follow = await client.responses.create(model="sim-model", input="and then?", max_output_tokens=4,
                                                   previous_response_id=resp.id)
            assert follow.previous_response_id == resp.id and follow.usage.output_tokens == 4
        finally:
            await client.close()


PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
LONG = " ".join(f"word{i}" for i in range(80))  # several 16-token blocks


async def test_sdks_send_images_through_the_encoders_and_read_the_cached_tokens():
    """E+P+D: an image block (anthropic) and an input_image (openai) are encoded on the encoder;
    a repeated long prefix reads as the prefill's prefix hits in each SDK's usage type."""
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, prompt_tokens_details=True)
    async with stack(encode=1, sim=sim) as (cluster, proxy, _):
        ac = anthropic.AsyncAnthropic(base_url=proxy.url, api_key="unused", max_retries=0)
        oc = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
        try:
            content = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
                       {"type": "text", "text": "what is this"}]
            msg = await ac.messages.create(model="sim-model", max_tokens=4,
                                           messages=[{"role": "user", "content": content}])
            assert msg.content[0].text and msg.usage.output_tokens == 4
            resp = await oc.responses.create(model="sim-model", max_output_tokens=4, input=[
                {"role": "user", "content": [{"type": "input_image", "image_url": f"data:image/png;base64,{PNG}",
                                              "detail": "auto"},
                                             {"type": "input_text", "text": "what is this"}]}])
            assert resp.output_text and resp.usage.output_tokens == 4
            assert len(cluster.records("encode")) == 2
            for tail in ("one", "two"):
                msg = await ac.messages.create(model="sim-model", max_tokens=4,
                                               messages=[{"role": "user", "content": LONG + " " + tail}])
            assert msg.usage.cache_read_input_tokens and msg.usage.cache_read_input_tokens >= 64
            for tail in ("three", "four"):
                resp = await oc.responses.create(model="sim-model", max_output_tokens=4, input=LONG + " x " + tail)
            assert resp.usage.input_tokens_details.cached_tokens >= 64
        finally:
            await ac.close()
            await oc.close()
