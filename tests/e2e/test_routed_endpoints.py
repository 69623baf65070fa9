"""The routed endpoints against real vLLM: /tokenize and /detokenize through the proxy equal
the instance's own answer, byte for byte, on the pd cluster (prefill and decode both hold the
tokenizer: the proxy may ask either)."""

from __future__ import annotations

import pytest
import vllm_e2e as E

CLUSTER = "pd"
ORDER = 14  # before test_pd_usage; asks nothing that changes the instances
pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def proxy(pd, start_proxy):
    return start_proxy("pd-routed", prefill=[pd.prefill.url], decode=[pd.decode.url])


def test_tokenize_and_detokenize_equal_the_instances_answer(pd, proxy):
    model = E.MODEL_NAME
    body = {"model": model, "prompt": "The proxy routes tokenizer requests too.", "return_token_strs": True}
    through = E.post(proxy.url, "/tokenize", body)
    assert through.status == 200, E.describe(through)
    for inst in (pd.prefill, pd.decode):
        own = E.post(inst.url, "/tokenize", body)
        assert (through.status, through.body) == (own.status, own.body)
    tokens = through.json()["tokens"]
    assert through.json()["count"] == len(tokens) > 0
    back = E.post(proxy.url, "/detokenize", {"model": model, "tokens": tokens})
    own = E.post(pd.decode.url, "/detokenize", {"model": model, "tokens": tokens})
    assert back.status == 200 and back.body == own.body
    assert "tokenizer requests" in back.json()["prompt"]
    # vLLM's own version, and HEAD on a GET route.
    version = E.request(proxy.url, "GET", "/version")
    assert version.body == E.request(pd.decode.url, "GET", "/version").body
    assert E.request(proxy.url, "HEAD", "/metrics").status == 200
