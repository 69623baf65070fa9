"""P/D push over NIXL through epd-proxy (`--kv-connector nixl-push`), against real vLLM 0.32.0:
1 prefill + 1 decode (tiny Llama), both with `NixlPushConnector`, P's engine_id pinned.

How vLLM 0.32.0's NixlPushConnector works (read from its source, pinned down here):
- P and D get their legs at the same time. D allocates blocks for the prompt, handshakes with P's
  side channel (`remote_engine_id`/`remote_host`/`remote_port`/`tp_size`/`pp_size` from its
  `kv_transfer_params`) and sends P a PUSH_REG notification with its block ids. When P's request
  finishes, P WRITEs the KV into those blocks and notifies D, which then decodes.
- P pairs a registration with a finished request by **vLLM's internal request id** with the
  random `-<8 hex>` suffix stripped, i.e. by the X-Request-Id both legs carry
  (`cmpl-<X-Request-Id>-0` / `chatcmpl-<X-Request-Id>`). `transfer_id` is not read by vLLM
  0.32.0 at all; `remote_request_id` is required on D (without it D's EngineCore dies with a
  KeyError) but is only used for lease heartbeats.
- The transfer is issued by P: P's `vllm:nixl_*` transfer metrics grow, D's do not; D's
  `vllm:external_prefix_cache_hits_total` grows by the prompt length.

The reference ("single-instance") answer is the same greedy request sent straight to the decode
instance without `kv_transfer_params` (see test_pd_nixl.py).
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import time
import uuid

import pytest
import vllm_e2e as E

CLUSTER = "push"
ORDER = 10
pytestmark = pytest.mark.vllm

ENDPOINTS = ["completions", "chat"]
STREAMS = [False, True]
PUSH_PREFILL_REQUEST = {"do_remote_decode": True, "do_remote_prefill": False,
                        "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                        "remote_port": None}


def decode_push_params(push, request_id: str, transfer_id: str) -> dict:
    """What the proxy sends D in push mode (docs/protocol.md §2.4): P's identity, no block ids."""
    return {"do_remote_decode": False, "do_remote_prefill": True,
            "remote_engine_id": push.prefill.engine_id, "remote_host": "127.0.0.1",
            "remote_port": push.prefill.side_channel_port, "tp_size": 1, "pp_size": 1,
            "remote_request_id": request_id, "transfer_id": transfer_id}


@pytest.fixture(scope="module")
def proxy(push, start_proxy):
    return start_proxy("push", prefill=[push.prefill.push_spec()], decode=[push.decode.url],
                       kv_connector="nixl-push")


def both_legs(push, path: str, p_body: dict, d_body: dict, p_rid: str, d_rid: str
              ) -> tuple[E.Response, E.Response]:
    """P's and D's legs sent at the same time, as the proxy does."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        fp = pool.submit(E.post, push.prefill.url, path, p_body, headers={"X-Request-Id": p_rid})
        fd = pool.submit(E.post, push.decode.url, path, d_body, headers={"X-Request-Id": d_rid})
        return fp.result(), fd.result()


# --- the environment itself, without the proxy: tells a broken vLLM setup from a proxy bug ----


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_vllm_direct_push_roundtrip(push, endpoint):
    """The proxy's push sequence by hand: both legs at once, same X-Request-Id."""
    body = E.text_body(endpoint, E.unique_prompt(), max_tokens=16)
    ref = E.reference(push, endpoint, body)
    n = ref.json()["usage"]["prompt_tokens"]
    p0, d0 = push.prefill.metrics(), push.decode.metrics()
    rid, xfer = f"e2e-push-{uuid.uuid4().hex[:12]}", f"xfer-{uuid.uuid4()}"
    pre = dict(body, max_tokens=1, kv_transfer_params=dict(PUSH_PREFILL_REQUEST, transfer_id=xfer))
    dec = dict(body, kv_transfer_params=decode_push_params(push, rid, xfer))

    r1, r2 = both_legs(push, E.endpoint_path(endpoint), pre, dec, rid, rid)

    assert r1.status == 200, E.describe(r1)
    ktp = r1.json()["kv_transfer_params"]
    assert ktp["transfer_mode"] == "push", ktp
    assert ktp["remote_engine_id"] == push.prefill.engine_id, ktp
    assert ktp["remote_port"] == push.prefill.side_channel_port, ktp
    prefix = "cmpl-" if endpoint == "completions" else "chatcmpl-"
    assert ktp["remote_request_id"].startswith(f"{prefix}{rid}-"), ktp
    assert r2.status == 200, E.describe(r2)
    assert E.text_of(r2, endpoint) == E.text_of(ref, endpoint)
    # P issued one WRITE; D loaded the whole prompt from it and issued no transfer itself.
    assert E.delta(push.prefill, E.NIXL_XFERS, p0, 1) == 1
    assert E.delta(push.decode, E.EXT_HITS, d0, n) == n
    assert push.decode.metrics().get(E.NIXL_XFERS) == d0.get(E.NIXL_XFERS)


def same_length_prompts(inst: E.Vllm) -> tuple[str, str]:
    """Two different prompts with the same token count and the same last tokens, so that a
    decode given the other one's KV answers exactly what the other one would: D loads all but
    the last prompt token from P and computes that one itself."""
    def count(prompt: str) -> int:
        r = E.post(inst.url, "/tokenize", {"model": E.MODEL_NAME, "prompt": prompt})
        assert r.status == 200, E.describe(r)
        return r.json()["count"]

    # Random prompts vary in length by a few tokens; a match usually comes within tens of
    # tries, but 100 was seen to miss once, so look longer (each try is one /tokenize call).
    a = E.unique_prompt() + ". The end."
    n = count(a)
    for _ in range(1000):
        b = E.unique_prompt() + ". The end."
        if count(b) == n:
            return a, b
    pytest.fail(f"no second prompt of {n} tokens found")


def test_vllm_push_pairs_by_request_id_not_transfer_id(push):
    """Pins down vLLM 0.32.0's pairing key: two prefills under one X-Request-Id (different
    prompts, different transfer_ids) are handed to decodes in the order they finished,
    whatever their transfer_id says. So a proxy must give every push attempt its own
    X-Request-Id."""
    rid = f"e2e-shared-{uuid.uuid4().hex[:12]}"
    a, b = (E.text_body("completions", p, max_tokens=12) for p in same_length_prompts(push.decode))
    ref_a = E.text_of(E.reference(push, "completions", a), "completions")
    ref_b = E.text_of(E.reference(push, "completions", b), "completions")
    assert ref_a != ref_b
    xa, xb = f"xfer-{uuid.uuid4()}", f"xfer-{uuid.uuid4()}"
    for body, xfer in ((a, xa), (b, xb)):  # A finishes first, then B
        r = E.post(push.prefill.url, "/v1/completions",
                   dict(body, max_tokens=1, kv_transfer_params=dict(PUSH_PREFILL_REQUEST, transfer_id=xfer)),
                   headers={"X-Request-Id": rid})
        assert r.status == 200, E.describe(r)

    # D for B, with B's transfer_id, is served A's KV (the first finished under that id) ...
    rb = E.post(push.decode.url, "/v1/completions",
                dict(b, kv_transfer_params=decode_push_params(push, rid, xb)),
                headers={"X-Request-Id": rid}, timeout=30)
    assert rb.status == 200, E.describe(rb)
    # ... and D for A gets B's.
    ra = E.post(push.decode.url, "/v1/completions",
                dict(a, kv_transfer_params=decode_push_params(push, rid, xa)),
                headers={"X-Request-Id": rid}, timeout=30)
    assert ra.status == 200, E.describe(ra)
    assert (E.text_of(rb, "completions"), E.text_of(ra, "completions")) == (ref_a, ref_b), \
        "vLLM no longer pairs push legs by X-Request-Id alone: update docs/real-vllm.md"


# --- through the proxy ----------------------------------------------------------------------


@pytest.mark.parametrize("stream", STREAMS, ids=["nonstream", "stream"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_push_text_equals_single_instance(push, proxy, endpoint, stream):
    body = E.text_body(endpoint, E.unique_prompt(), max_tokens=16, stream=stream)
    ref = E.reference(push, endpoint, body)
    prompt_tokens = ref.json()["usage"]["prompt_tokens"]
    d0, p0 = push.decode.metrics(), push.prefill.metrics()

    resp = E.post(proxy.url, E.endpoint_path(endpoint), body)

    E.assert_ok(resp, stream)
    assert E.text_of(resp, endpoint) == E.text_of(ref, endpoint)
    if not stream:
        assert resp.json()["usage"]["completion_tokens"] == 16, E.describe(resp)
    # Exactly one NIXL WRITE from P into D, covering the whole prompt, and nothing failed.
    assert E.delta(push.prefill, E.NIXL_XFERS, p0, 1) == 1
    assert E.delta(push.decode, E.EXT_HITS, d0, prompt_tokens) == prompt_tokens
    assert push.decode.metrics().get(E.NIXL_XFERS) == d0.get(E.NIXL_XFERS)  # P did the transfer
    for inst, before in ((push.prefill, p0), (push.decode, d0)):
        assert inst.metrics().get(E.NIXL_FAILED) == before.get(E.NIXL_FAILED)
    # The prefill leg generated one token (max_tokens=1), decode generated the rest.
    assert E.delta(push.prefill, "vllm:generation_tokens_total", p0, 1) == 1
    assert E.delta(push.prefill, "vllm:prompt_tokens_total", p0, prompt_tokens) == prompt_tokens


def test_push_16_concurrent_requests(push, proxy):
    n = 16
    jobs = []
    for i in range(n):
        endpoint = ENDPOINTS[i % 2]
        stream = bool((i // 2) % 2)
        jobs.append((endpoint, stream, E.text_body(endpoint, E.unique_prompt(), max_tokens=8,
                                                   stream=stream)))
    p0, d0 = push.prefill.metrics(), push.decode.metrics()
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_workers=n) as pool:
        results = list(pool.map(
            lambda job: E.post(proxy.url, E.endpoint_path(job[0]), job[2]), jobs))
    elapsed = time.monotonic() - t0
    failures = [(job[0], job[1], E.describe(r)) for job, r in zip(jobs, results)
                if r.status != 200 or not E.text_of(r, job[0])]
    assert not failures, f"{len(failures)}/{n} failed: {failures[:3]}"
    for (_, stream, _), r in zip(jobs, results):
        E.assert_ok(r, stream)
        if not stream:
            assert r.json()["usage"]["completion_tokens"] == 8
    assert E.delta(push.prefill, E.NIXL_XFERS, p0, n) == n
    assert push.prefill.metrics().get(E.NIXL_FAILED) == p0.get(E.NIXL_FAILED)
    assert push.decode.metrics().get(E.NIXL_FAILED) == d0.get(E.NIXL_FAILED)
    print(f"\n[e2e] {n} concurrent push requests through the proxy in {elapsed:.2f}s")


def test_push_reused_client_request_id_gets_its_own_kv(push, proxy):
    """A client that reuses an X-Request-Id (or a prefill left over under that id) must not
    change its answer. Here a prefill of another prompt under the same id is waiting on P
    (as after an earlier request or attempt whose decode never registered)."""
    rid = f"e2e-client-{uuid.uuid4().hex[:12]}"
    stale = E.text_body("completions", E.unique_prompt(), max_tokens=12)
    r = E.post(push.prefill.url, "/v1/completions",
               dict(stale, max_tokens=1, kv_transfer_params=PUSH_PREFILL_REQUEST),
               headers={"X-Request-Id": rid})
    assert r.status == 200, E.describe(r)
    body = E.text_body("completions", E.unique_prompt(), max_tokens=12)
    ref = E.reference(push, "completions", body)

    resp = E.post(proxy.url, "/v1/completions", body, headers={"X-Request-Id": rid}, timeout=60)

    assert resp.status == 200, E.describe(resp)
    assert E.text_of(resp, "completions") == E.text_of(ref, "completions")


def test_push_validation_error_is_relayed(push, proxy):
    """A prompt longer than the context: both legs get vLLM's 400 at once; the client gets it
    byte for byte and decode is left with nothing waiting."""
    body = E.text_body("completions", " ".join(["fox"] * 600), max_tokens=8)  # > 512 tokens
    direct = E.post(push.decode.url, "/v1/completions", body)
    assert direct.status == 400, f"vLLM itself: {E.describe(direct)}"

    resp = E.post(proxy.url, "/v1/completions", body, timeout=60)

    assert resp.status == 400, E.describe(resp)
    assert resp.body == direct.body, f"\nproxy:  {resp.body[:500]!r}\nvLLM:   {direct.body[:500]!r}"
    m = push.decode.metrics()
    assert m.get(E.RUNNING) == 0 and m.get("vllm:num_requests_waiting") == 0


# --- failures -----------------------------------------------------------------------------------


class FailingPrefill(E.Interposer):
    """An HTTP interposer standing in for the prefill's HTTP side: every POST is answered
    HTTP 500 (vLLM's error envelope) without reaching P; GETs (health, models) go to the real P.

    The proxy still tells decode the real P's NIXL identity, so decode registers with the real P
    and waits for a push that never comes: only the proxy cancelling it ends that wait (vLLM's
    `push_registration_timeout`, 480 s by default, merely drops the registration)."""

    def __init__(self, upstream: str) -> None:
        self.posts = 0
        self.events: list[tuple[float, str, str | None, float]] = []  # (t, path, id, secs)
        outer = self

        class Handler(E.QuietHandler):
            def _reply(self, status: int, ctype: str, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                t0 = time.time()
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                with outer.lock:
                    outer.posts += 1
                self._reply(500, "application/json", json.dumps({"error": {
                    "message": "injected prefill failure", "type": "InternalServerError",
                    "param": None, "code": 500}}).encode())
                with outer.lock:
                    outer.events.append((t0, self.path, self.headers.get("X-Request-Id"),
                                         time.time() - t0))

            def do_GET(self):
                c = http.client.HTTPConnection(outer.upstream.hostname, outer.upstream.port,
                                               timeout=30)
                try:
                    c.request("GET", self.path)
                    r = c.getresponse()
                    data = r.read()
                    self._reply(r.status, r.getheader("Content-Type", "text/plain"), data)
                finally:
                    c.close()

        super().__init__(upstream, Handler)


@pytest.fixture(scope="module")
def failing_prefill(push):
    ip = FailingPrefill(push.prefill.url)
    yield ip
    ip.close()


@pytest.fixture
def failing_proxy(push, failing_prefill, e2e_log_dir, proxy_ready):
    """A proxy whose prefill is the failing interposer (with the real P's NIXL identity); one per
    test, so that a decode leg it failed to cancel would die with it."""
    spec = push.prefill.push_spec().replace(push.prefill.url, failing_prefill.url, 1)
    # A high fail threshold keeps the (deliberately failing) prefill in rotation.
    p = E.start_proxy("push-failing-prefill", e2e_log_dir, prefill=[spec], decode=[push.decode.url],
                      kv_connector="nixl-push", extra=["--fail-threshold", "1000"])
    yield p
    p.stop()


# A decode leg cancelled just as its TCP connect completes must stay cancelled (on Python 3.11
# asyncio.wait_for could swallow that cancellation; the proxy uses asyncio.timeout): the client
# gets its 502 at once instead of waiting for a push that never comes.


@pytest.mark.parametrize("stream", STREAMS, ids=["nonstream", "stream"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_push_prefill_failure_cancels_decode(push, failing_prefill, failing_proxy, endpoint, stream):
    body = E.text_body(endpoint, E.unique_prompt(), max_tokens=8, stream=stream)
    posts0 = failing_prefill.posts
    t0 = time.monotonic()

    resp = E.post(failing_proxy.url, E.endpoint_path(endpoint), body, timeout=15)

    elapsed = time.monotonic() - t0
    assert resp.status == 502, E.describe(resp)
    assert resp.content_type.startswith("application/json"), E.describe(resp)
    err = resp.json().get("error")
    assert isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err), E.describe(resp)
    assert "injected prefill failure" in err["message"], E.describe(resp)
    # one attempt + one retry (--decode-retries 1); decode did not wait for a push
    assert failing_prefill.posts - posts0 == 2
    assert elapsed < 10, f"took {elapsed:.1f}s"
    # The decode legs were cancelled: vLLM aborted them and holds no request.
    assert E.wait_for(lambda: (lambda m: m.get(E.RUNNING) == 0
                               and m.get("vllm:num_requests_waiting") == 0)(push.decode.metrics()),
                      10), "decode still holds a request after the prefill failed"
    assert E.request(push.decode.url, "GET", "/health").status == 200


def test_push_dead_prefill_side_channel_gives_502(push, start_proxy):
    """The proxy gives decode a prefill identity whose side channel is dead: vLLM's NIXL
    handshake fails after ~5 s and decode answers 500; P itself succeeded. The proxy retries
    once, then answers 502."""
    dead = E.free_port()
    spec = (f"{push.prefill.url};engine_id=e2e-dead-{uuid.uuid4().hex[:8]};kv_host=127.0.0.1;"
            f"kv_port={dead};tp=1;pp=1")
    proxy = start_proxy("push-dead-side-channel", prefill=[spec], decode=[push.decode.url],
                        kv_connector="nixl-push")
    body = E.text_body("completions", E.unique_prompt(), max_tokens=8)
    d0 = push.decode.metrics()
    t0 = time.monotonic()

    resp = E.post(proxy.url, "/v1/completions", body, timeout=90)

    elapsed = time.monotonic() - t0
    assert resp.status == 502, E.describe(resp)
    assert elapsed < 60, f"took {elapsed:.1f}s"
    assert E.delta(push.decode, "vllm:request_success_total", d0, 2, finished_reason="error") == 2
    assert E.request(push.decode.url, "GET", "/health").status == 200
    assert E.wait_for(lambda: push.decode.metrics().get(E.RUNNING) == 0, 10)


def test_push_still_serves_after_failures(push, proxy):
    """The failures above left decode (and prefill) usable."""
    body = E.text_body("chat", E.unique_prompt(), max_tokens=8, stream=True)
    ref = E.reference(push, "chat", body)
    resp = E.post(proxy.url, "/v1/chat/completions", body)
    E.assert_ok(resp, True)
    assert E.text_of(resp, "chat") == E.text_of(ref, "chat")
