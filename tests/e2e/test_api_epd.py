"""Images of the Messages and Responses APIs through E+P+D and E+PD, against real vLLM (the
``epd`` cluster of test_epd.py: tiny BLIP-2, ECExampleConnector, NIXL).

An Anthropic image block (base64 source) and a Responses ``input_image`` (a data: URL) go to
the encoder as the chat ``image_url`` part vLLM makes of them; the consumer gets the API's own
body with the encoder's ``ec_transfer_params`` and hashes the same image to the same key. The
evidence per request is test_epd.py's: a new encoder-cache entry, P's log line saying it
loaded it, for E+P+D one NIXL transfer into D; and the text equals the same request answered
by D alone (no EC role, no kv params: it encodes the image itself).
"""

from __future__ import annotations

import pytest
import vllm_e2e as E
from test_epd import assert_consumer_loaded, ec_entries, ec_lookups_missed, new_entry

CLUSTER = "epd"
ORDER = 12
pytestmark = pytest.mark.vllm

STREAMS = [False, True]


@pytest.fixture(scope="module")
def api_proxies(epd, start_proxy):
    return {
        "E+P+D": start_proxy("api-e-p-d", encode=[epd.encode.url], prefill=[epd.prefill.url],
                             decode=[epd.decode.url]),
        "E+PD": start_proxy("api-e-pd", encode=[epd.encode.url], decode=[epd.prefill.url]),
    }


def image_body(path: str, url: str, stream: bool) -> dict:
    text = "What is in this image?"
    if path == E.MESSAGES:
        media_type, data = url[5:].split(";base64,", 1)
        return {"model": E.MODEL_NAME, "max_tokens": 8, "temperature": 0, "stream": stream,
                "messages": [{"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}},
                    {"type": "text", "text": text}]}]}
    return {"model": E.MODEL_NAME, "max_output_tokens": 8, "temperature": 0, "stream": stream, "store": False,
            "input": [{"role": "user", "content": [{"type": "input_image", "image_url": url},
                                                   {"type": "input_text", "text": text}]}]}


@pytest.mark.parametrize("stream", STREAMS, ids=["nonstream", "stream"])
@pytest.mark.parametrize("topology", ["E+PD", "E+P+D"])
@pytest.mark.parametrize("path", [E.MESSAGES, E.RESPONSES], ids=["messages", "responses"])
def test_api_image_through_the_encoder(epd, api_proxies, path, topology, stream):
    body = image_body(path, E.png_data_url(E.unique_color()), stream)
    alone = E.post(epd.decode.url, path, dict(body, stream=False))
    E.assert_api_ok(alone, False)
    before, missed = ec_entries(epd), ec_lookups_missed(epd)
    d0, p0 = epd.decode.metrics(), epd.prefill.metrics()

    resp = E.post(api_proxies[topology].url, path, body)

    E.assert_api_ok(resp, stream)
    assert E.api_text(path, resp) == E.api_text(path, alone) != ""
    mm_hash = new_entry(epd, before)                  # the encoder ran and stored its output
    assert_consumer_loaded(epd, mm_hash, missed)      # ... and P used it instead of encoding
    if topology == "E+P+D":
        assert E.delta(epd.decode, E.NIXL_XFERS, d0, 1) == 1, "no NIXL transfer into D"
        assert E.delta(epd.prefill, "vllm:generation_tokens_total", p0, 1) == 1
    else:
        assert epd.decode.metrics().get(E.NIXL_XFERS) == d0.get(E.NIXL_XFERS)
    assert b"do_remote" not in resp.body and b"ec_items" not in resp.body, E.describe(resp, 4000)
