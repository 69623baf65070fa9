"""Failure paths through epd-proxy, against real vLLM (the P/D cluster: tiny Llama, NIXL pull).

- A decode told to pull KV from a dead prefill side channel: real vLLM answers 500 (non-stream)
  or an in-band error event (stream) after its ~5 s handshake timeout. The proxy retries once
  (`--decode-retries 1`, the default) with a fresh prefill, then answers 502 with its error
  envelope; it must not hang.
- vLLM validation errors (stream_options mistakes, context too long) reach the client as vLLM's
  own 400 body.
- A client that disconnects mid-stream: vLLM's `vllm:num_requests_running` returns to 0 and the
  generation stops early.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.parse
import uuid

import pytest
import vllm_e2e as E

CLUSTER = "pd"
ORDER = 20
pytestmark = pytest.mark.vllm

ENDPOINTS = ["completions", "chat"]
STREAMS = [False, True]


@pytest.fixture(scope="module")
def proxy(pd, start_proxy):
    return start_proxy("pd-failures", prefill=[pd.prefill.url], decode=[pd.decode.url])


# --- decode pointed at a dead prefill side channel -------------------------------------------


class DeadSideChannelPrefill(E.Interposer):
    """An HTTP interposer in front of the real prefill instance.

    Everything is forwarded to the real P unchanged, except that `kv_transfer_params` in P's
    JSON answers are pointed at a side-channel port nobody listens on, under a fresh engine id
    (a known engine id would reuse decode's existing NIXL connection and never touch the port).
    """

    def __init__(self, upstream: str) -> None:
        self.dead_port = E.free_port()
        self.generation_posts = 0
        outer = self

        class Handler(E.QuietHandler):
            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                data = self.rfile.read(length) if length else None
                if self.command == "POST" and self.path.startswith("/v1/"):
                    with outer.lock:
                        outer.generation_posts += 1
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("host", "content-length", "connection",
                                                "transfer-encoding")}
                c = http.client.HTTPConnection(outer.upstream.hostname, outer.upstream.port,
                                               timeout=E.REQUEST_TIMEOUT)
                try:
                    c.request(self.command, self.path, body=data, headers=headers)
                    r = c.getresponse()
                    body = r.read()
                    ctype = r.getheader("Content-Type", "")
                    status = r.status
                finally:
                    c.close()
                if ctype.startswith("application/json") and body:
                    try:
                        doc = json.loads(body)
                    except ValueError:
                        doc = None
                    if isinstance(doc, dict) and isinstance(doc.get("kv_transfer_params"), dict):
                        doc["kv_transfer_params"]["remote_port"] = outer.dead_port
                        doc["kv_transfer_params"]["remote_engine_id"] = str(uuid.uuid4())
                        body = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype or "application/octet-stream")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _forward

        super().__init__(upstream, Handler)


@pytest.fixture(scope="module")
def dead_prefill(pd):
    ip = DeadSideChannelPrefill(pd.prefill.url)
    yield ip
    ip.close()


@pytest.fixture(scope="module")
def dead_proxy(pd, dead_prefill, start_proxy):
    return start_proxy("pd-dead-side-channel", prefill=[dead_prefill.url], decode=[pd.decode.url])


def test_vllm_direct_dead_side_channel(pd, dead_prefill):
    """What the proxy has to handle, straight from vLLM: non-stream 500 with vLLM's envelope;
    stream 200 whose events are (chat: a role chunk, then) an error event and [DONE]."""
    for stream in (False, True):
        body = E.text_body("chat", E.unique_prompt(), max_tokens=8)
        pre = dict(body, max_tokens=1, kv_transfer_params={
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None})
        r1 = E.post(dead_prefill.url, "/v1/chat/completions", pre)
        assert r1.status == 200, E.describe(r1)
        ktp = r1.json()["kv_transfer_params"]
        assert ktp["remote_port"] == dead_prefill.dead_port
        r2 = E.post(pd.decode.url, "/v1/chat/completions",
                    dict(body, stream=stream, kv_transfer_params=ktp), timeout=60)
        if not stream:
            assert r2.status == 500, E.describe(r2)
            assert r2.json()["error"]["type"] == "InternalServerError"
        else:
            assert r2.status == 200, E.describe(r2)
            events = r2.events()
            errors = [ev for ev in events if isinstance(ev, dict) and "error" in ev]
            assert errors and errors[0]["error"]["code"] == 500, E.describe(r2, 2000)
            assert events[-1] == "[DONE]"


@pytest.mark.parametrize("stream", STREAMS, ids=["nonstream", "stream"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_dead_prefill_side_channel_gives_502(pd, dead_prefill, dead_proxy, endpoint, stream):
    body = E.text_body(endpoint, E.unique_prompt(), max_tokens=8, stream=stream)
    d0 = pd.decode.metrics()
    posts0 = dead_prefill.generation_posts
    t0 = time.monotonic()

    resp = E.post(dead_proxy.url, E.endpoint_path(endpoint), body, timeout=90)

    elapsed = time.monotonic() - t0
    assert resp.status == 502, E.describe(resp)
    assert resp.content_type.startswith("application/json"), E.describe(resp)
    err = resp.json().get("error")
    assert isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err), E.describe(resp)
    assert elapsed < 60, f"took {elapsed:.1f}s"
    # one attempt + one retry (--decode-retries 1), each with a fresh prefill
    assert dead_prefill.generation_posts - posts0 == 2
    assert E.delta(pd.decode, "vllm:request_success_total", d0, 2, finished_reason="error") == 2
    # decode survived and holds nothing
    assert E.request(pd.decode.url, "GET", "/health").status == 200
    assert E.wait_for(lambda: pd.decode.metrics().get(E.RUNNING) == 0, 10)


# --- vLLM validation errors are relayed --------------------------------------------------------

LONG_PROMPT = " ".join(["fox"] * 2100)  # > max-model-len 2048 tokens

VALIDATION_CASES = {
    # stream_options only with stream=true (P never sees it: the proxy strips it for prefill)
    "stream_options_without_stream": dict(stream=False, stream_options={"include_usage": True}),
    # a malformed stream_options on a streaming request (pydantic's 400)
    "stream_options_bad_type": dict(stream=True, stream_options={"include_usage": "maybe"}),
    "context_too_long": dict(stream=False, prompt=LONG_PROMPT),
    "context_too_long_stream": dict(stream=True, prompt=LONG_PROMPT),
}


@pytest.mark.parametrize("case", list(VALIDATION_CASES))
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_vllm_validation_error_is_relayed(pd, proxy, endpoint, case):
    spec = dict(VALIDATION_CASES[case])
    prompt = spec.pop("prompt", None) or E.unique_prompt()
    body = E.text_body(endpoint, prompt, max_tokens=8, **spec)
    direct = E.post(pd.decode.url, E.endpoint_path(endpoint), body)
    assert direct.status == 400, f"vLLM itself: {E.describe(direct)}"

    resp = E.post(proxy.url, E.endpoint_path(endpoint), body, timeout=60)

    assert resp.status == 400, E.describe(resp)
    assert resp.content_type.startswith("application/json"), E.describe(resp)
    assert resp.body == direct.body, (f"\nproxy:  {resp.body[:500]!r}"
                                      f"\nvLLM:   {direct.body[:500]!r}")


# --- client disconnect mid-stream ------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_client_disconnect_mid_stream_aborts_decode(pd, proxy, endpoint):
    max_tokens = 1800  # ~5 s of decoding on this machine if nobody aborts it
    body = E.text_body(endpoint, E.unique_prompt(), max_tokens=max_tokens, stream=True)
    d0 = pd.decode.metrics()
    u = urllib.parse.urlsplit(proxy.url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    c.request("POST", E.endpoint_path(endpoint), body=json.dumps(body),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    events = 0
    while events < 4:
        line = r.fp.readline()
        assert line, "stream ended early"
        if line.startswith(b"data:"):
            events += 1
    assert pd.decode.metrics().get(E.RUNNING) >= 1
    c.sock.shutdown(socket.SHUT_RDWR)
    c.close()
    t0 = time.monotonic()

    assert E.wait_for(lambda: pd.decode.metrics().get(E.RUNNING) == 0, 10, 0.1), \
        "decode still running 10 s after the client went away"
    waited = time.monotonic() - t0
    time.sleep(0.5)
    d1 = pd.decode.metrics()
    generated = d1.get("vllm:generation_tokens_total") - d0.get("vllm:generation_tokens_total")
    assert generated < max_tokens // 2, f"decode generated {generated} tokens: not aborted"
    assert (d1.get("vllm:request_success_total", finished_reason="length")
            == d0.get("vllm:request_success_total", finished_reason="length"))
    assert pd.prefill.metrics().get(E.RUNNING) == 0
    print(f"\n[e2e] decode idle {waited:.2f}s after the disconnect ({generated:.0f} tokens)")
