"""The official SDKs against a key's limits: each sees the 429 as its own RateLimitError, with
the headers it reads, and its retry waits for ``Retry-After`` (counted at the proxy)."""

import asyncio
import time

import pytest
from helpers import stack

from epd_proxy.sim import SimConfig

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

SIM = SimConfig(itl_ms=0, ttft_ms=0.5)
TENANTS = {"keys": [{"name": "team-a", "requests_per_second": 1}]}
MESSAGES = [{"role": "user", "content": "hello"}]


def keys(tmp_path) -> str:
    path = tmp_path / "keys"
    path.write_text("team-a:secret-a\n")
    return str(path)


async def _second_start() -> None:
    """Just after a second turns: two quick calls then fall in one per-second window."""
    await asyncio.sleep(1.05 - time.time() % 1)


def limited(proxy) -> int:
    return proxy.app.pipeline.tenants.counts["team-a"].limited.get("requests_per_second", 0)


async def test_openai_sees_its_rate_limit_error_and_retries_after_retry_after(tmp_path):
    async with stack(sim=SIM, api_key_file=keys(tmp_path), tenants=TENANTS) as (cluster, proxy, _):
        bare = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="secret-a", max_retries=0)
        patient = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="secret-a", max_retries=2)
        try:
            await _second_start()
            await bare.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=2)
            with pytest.raises(openai.RateLimitError) as err:
                await bare.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=2)
            assert err.value.status_code == 429 and err.value.response.headers["retry-after"] == "1"
            assert err.value.response.headers["x-ratelimit-remaining-requests"] == "0"
            assert limited(proxy) == 1
            await _second_start()
            await patient.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=2)
            t0 = time.monotonic()
            raw = await patient.chat.completions.with_raw_response.create(model="sim-model", messages=MESSAGES,
                                                                         max_tokens=2)
            waited = time.monotonic() - t0
            assert raw.http_response.status_code == 200
            assert raw.headers["x-ratelimit-limit-requests"] == "1"
            # One 429, then the retry after Retry-After (1 s; the SDK's own first back-off, about
            # half a second, would have landed in the same window and been refused again).
            assert limited(proxy) == 2 and raw.retries_taken == 1 and waited >= 0.9
        finally:
            await bare.close()
            await patient.close()


async def test_anthropic_sees_its_rate_limit_error_and_retries_after_retry_after(tmp_path):
    async with stack(sim=SIM, api_key_file=keys(tmp_path), tenants=TENANTS) as (cluster, proxy, _):
        # The SDK's api_key goes as X-Api-Key, its auth_token as Authorization: Bearer: both are keys.
        bare = anthropic.AsyncAnthropic(base_url=proxy.url, api_key="secret-a", max_retries=0)
        patient = anthropic.AsyncAnthropic(base_url=proxy.url, auth_token="secret-a", max_retries=2)
        try:
            await _second_start()
            await bare.messages.create(model="sim-model", max_tokens=2, messages=MESSAGES)
            with pytest.raises(anthropic.RateLimitError) as err:
                await bare.messages.create(model="sim-model", max_tokens=2, messages=MESSAGES)
            headers = err.value.response.headers
            assert err.value.status_code == 429 and headers["retry-after"] == "1"
            assert headers["anthropic-ratelimit-requests-limit"] == "1"
            assert headers["anthropic-ratelimit-requests-remaining"] == "0"
            await _second_start()
            await patient.messages.create(model="sim-model", max_tokens=2, messages=MESSAGES)
            t0 = time.monotonic()
            raw = await patient.messages.with_raw_response.create(model="sim-model", max_tokens=2, messages=MESSAGES)
            waited = time.monotonic() - t0
            assert raw.http_response.status_code == 200 and raw.retries_taken == 1 and waited >= 0.9
            assert raw.headers["anthropic-ratelimit-requests-limit"] == "1"
            assert limited(proxy) == 2
        finally:
            await bare.close()
            await patient.close()
