"""A stream survives its decode, against real vLLM: two plain instances (tiny Llama) as the
decodes; the one serving a stream is SIGKILLed mid-answer, and the client's stream goes on from
the other (request/migration.py): complete, one id, one terminator, and at temperature 0 the
text compared with one instance's uninterrupted answer (docs/protocol.md §5.3.1: the text
continuation is exact where the partial answer re-tokenizes to the tokens that made it; the
generate stream's token-in continuation is exact by construction). Then the exactness over many
cut points: the decode serving a stream SIGSTOPped (wedged: the stall rule moves the stream)
after the client got k events, k = 1..EPD_E2E_MIGRATION_CUTS (default 3; docs/benchmarks.md has
a run with 16); the cut falls where the decode was when it stopped, the proxy's log says where."""

from __future__ import annotations

import http.client
import json
import os
import re
import sys
import time
import urllib.parse

import pytest
import vllm_e2e as E

CLUSTER = "two"
ORDER = 10
pytestmark = pytest.mark.vllm

TOKENS = 400
KILL_AFTER = 40  # events received before the decode serving the stream is killed


@pytest.fixture(scope="module")
def proxy(two, start_proxy):
    return start_proxy("two-migration", decode=[two.decode.url, two.decode_b.url],
                       extra=["--probe-interval", "1"])


def _serving(base: str, two) -> E.Vllm | None:
    """The decode the proxy has the stream on (its /status: the one with a request in flight;
    None when the stream has already ended there)."""
    pool = E.request(base, "GET", "/status").json()["pools"]["decode"]
    urls = [d["url"] for d in pool if d["inflight"] > 0]
    if not urls:
        return None
    (url,) = urls
    return two.decode if url == two.decode.url else two.decode_b


def _stream_and_kill(base: str, path: str, body: dict, two, after: int = KILL_AFTER,
                     freeze: bool = False, must: bool = True) -> tuple[list, E.Vllm | None]:
    """The stream's events as they come (parsed; the terminator as the string); after
    ``after`` of them the instance running it is SIGKILLed (``freeze``: SIGSTOPped)."""
    u = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=E.REQUEST_TIMEOUT)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    events: list = []
    victim = None
    frozen = 0.0
    buf = b""
    try:
        while True:
            line = resp.readline()  # the body with its chunking undone: SSE lines as sent
            if not line:
                break
            buf += line
            if not buf.endswith(b"\n\n"):
                continue
            data = buf.strip().rsplit(b"\n", 1)[-1][len(b"data: "):]  # Messages: after its event: line
            buf = b""
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
            if frozen and time.monotonic() - frozen > 1.0:  # the stream came back after a stall: moved
                victim.thaw()  # before the probes eject it (it is back in rotation for the next cut)
                frozen = 0.0
            if events[-1] == "[DONE]" or events[-1].get("type") in ("message_stop", "response.completed"):
                break
            if len(events) == after and victim is None:
                victim = _serving(base, two)
                if victim is None:  # decode had already sent the whole answer
                    if must:
                        break
                    continue
                if freeze:
                    victim.freeze()
                    frozen = time.monotonic()
                else:
                    victim.kill()
    finally:
        conn.close()
        if frozen:
            victim.thaw()
    assert victim is not None or not must, "the stream ended before the kill"
    return events, victim


def _text(events: list, endpoint: str) -> str:
    out = []
    for e in events:
        if isinstance(e, dict):
            for c in e.get("choices") or []:
                out.append((c.get("delta") or {}).get("content") or "" if endpoint == "chat" else c.get("text") or "")
    return "".join(out)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_killed_decode_costs_the_stream_nothing(two, proxy, endpoint, e2e_log_dir):
    prompt = E.unique_prompt()
    body = E.text_body(endpoint, prompt, max_tokens=TOKENS, stream=True,
                       stream_options={"include_usage": True})
    plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    ref = E.post(two.decode.url, E.endpoint_path(endpoint), dict(plain, return_token_ids=True))
    assert ref.status == 200, E.describe(ref)
    choice = ref.json()["choices"][0]
    want = choice["message"]["content"] if endpoint == "chat" else choice["text"]
    ids = choice["token_ids"]
    t0 = time.monotonic()
    events, victim = _stream_and_kill(proxy.url, E.endpoint_path(endpoint), body, two)
    try:
        # One whole stream, where the proxy without migration ended it with an in-band error.
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        data = events[:-1]
        assert not [e for e in data if "error" in e], [e for e in data if "error" in e]
        assert len({e["id"] for e in data}) == 1 and len({e["created"] for e in data}) == 1
        usage = data[-1]["usage"]
        assert usage["completion_tokens"] == TOKENS
        got = _text(events, endpoint)
        before = _text(events[:KILL_AFTER], endpoint)  # streamed by the killed decode
        assert got.startswith(before) and want.startswith(before)
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        # Where the text continuation cannot be exact: the answer so far re-tokenized is not the
        # ids that made it (the tiny model's random weights emit byte pieces that merge anew).
        k = len([e for e in events[:KILL_AFTER] for c in e["choices"]
                 if ((c.get("delta") or {}).get("content") if endpoint == "chat" else c.get("text"))])
        alive = two.decode_b if victim is two.decode else two.decode
        again = E.post(alive.url, "/tokenize", {"model": E.MODEL_NAME, "prompt": "".join(want)[:len(before)],
                                                "add_special_tokens": False}).json()["tokens"]
        print(f"\n[e2e] {endpoint}: stream moved off {victim.url} after {KILL_AFTER} events in "
              f"{time.monotonic() - t0:.1f}s; {same} of {len(want)} characters equal to the uninterrupted answer "
              f"({'exact' if got == want else 'differs from there'}); the {k} tokens before the break "
              f"re-tokenize {'to the same ids' if again == ids[:k] else f'differently ({len(again)} ids)'}; "
              f"usage {usage}", file=sys.stderr)
        if again == ids[:k]:  # the continuation's premise holds: it must be exact
            assert got == want
        else:
            assert same >= len(before)
    finally:
        victim.restart(e2e_log_dir)


GENERATE = "/inference/v1/generate"


def _ids(events: list) -> list[int]:
    return [t for e in events if isinstance(e, dict) for c in e.get("choices") or [] for t in c.get("token_ids") or []]


def _generate_body(two, tokens: int) -> dict:
    tok = E.post(two.decode.url, "/tokenize", {"model": E.MODEL_NAME, "prompt": E.unique_prompt()})
    assert tok.status == 200, E.describe(tok)
    return {"model": E.MODEL_NAME, "token_ids": tok.json()["tokens"], "stream": True,
            "stream_options": {"include_usage": True},
            "sampling_params": {"max_tokens": tokens, "temperature": 0, "ignore_eos": True}}


def test_a_killed_decode_costs_the_generate_stream_nothing_and_its_answer_is_exact(two, proxy, e2e_log_dir):
    """Token in: the continuation is the prompt's ids and the ids streamed, so at temperature 0
    the client's ids are the uninterrupted answer's, token for token."""
    body = _generate_body(two, TOKENS)
    plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    ref = E.post(two.decode.url, GENERATE, plain)
    assert ref.status == 200, E.describe(ref)
    want = ref.json()["choices"][0]["token_ids"]
    events, victim = _stream_and_kill(proxy.url, GENERATE, body, two)
    try:
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        data = events[:-1]
        assert not [e for e in data if "error" in e], [e for e in data if "error" in e]
        assert len({e["request_id"] for e in data}) == 1
        usage = data[-1]["usage"]
        assert usage["completion_tokens"] == TOKENS and usage["prompt_tokens"] == len(body["token_ids"])
        got = _ids(events)
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        print(f"\n[e2e] generate: stream moved off {victim.url} after {KILL_AFTER} events; {same} of {len(want)} "
              f"ids equal to the uninterrupted answer; usage {usage}", file=sys.stderr)
        assert got == want
    finally:
        victim.restart(e2e_log_dir)


CUTS = int(os.environ.get("EPD_E2E_MIGRATION_CUTS", "3"))
SWEEP_TOKENS = 1000  # long enough that the cut lands mid-answer: the tiny model is fast
_BROKE = re.compile(r"broke off \((\w+)\) after (\d+) tokens")


def _both_healthy(base: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pool = E.request(base, "GET", "/status").json()["pools"]["decode"]
        if all(d["healthy"] and d["inflight"] == 0 for d in pool):
            return
        time.sleep(0.2)
    raise AssertionError(f"the decodes did not come back: {pool}")


MESSAGES = "/v1/messages"


def _message_text(events: list) -> str:
    return "".join(e["delta"]["text"] for e in events if isinstance(e, dict) and e.get("type") == "content_block_delta")


def test_a_killed_decode_costs_the_messages_stream_nothing(two, proxy, e2e_log_dir):
    """A Messages stream continued through vLLM's chat endpoint (its Messages endpoint does not
    continue a final assistant message): one message, its text block going on at its index, one
    message_delta with the whole answer's output tokens, one message_stop."""
    body = {"model": E.MODEL_NAME, "max_tokens": TOKENS, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": E.unique_prompt()}]}
    ref = E.post(two.decode.url, MESSAGES, dict(body, stream=False))
    assert ref.status == 200, E.describe(ref)
    want = "".join(b["text"] for b in ref.json()["content"] if b["type"] == "text")
    events, victim = _stream_and_kill(proxy.url, MESSAGES, body, two)
    try:
        types = [e["type"] for e in events]
        assert types[0] == "message_start" and types.count("message_start") == 1, types
        assert types[-2:] == ["message_delta", "message_stop"] and types.count("message_stop") == 1, types
        assert "error" not in types and types.count("content_block_stop") == 1
        assert {e["index"] for e in events if e["type"] == "content_block_delta"} == {0}
        assert events[-2]["usage"]["output_tokens"] == ref.json()["usage"]["output_tokens"]
        assert events[-2]["usage"]["input_tokens"] == events[0]["message"]["usage"]["input_tokens"]
        got = _message_text(events)
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        print(f"\n[e2e] messages: stream moved off {victim.url} after {KILL_AFTER} events; {same} of {len(want)} "
              f"characters equal to the uninterrupted answer ({'exact' if got == want else 'differs from there'}); "
              f"usage {events[-2]['usage']}", file=sys.stderr)
        assert got.startswith(_message_text(events[:KILL_AFTER]))
    finally:
        victim.restart(e2e_log_dir)


RESPONSES = "/v1/responses"


def _response_text(events: list) -> str:
    return "".join(e["delta"] for e in events if isinstance(e, dict) and e.get("type") == "response.output_text.delta")


def test_a_killed_decode_costs_the_responses_stream_nothing(two, proxy, e2e_log_dir):
    """A ``store: false`` Responses stream continued with the text so far as a partial assistant
    message, which vLLM continues: one response, sequence numbers counting on, the completed
    response holding the whole text and the whole answer's output tokens."""
    body = {"model": E.MODEL_NAME, "max_output_tokens": TOKENS, "temperature": 0, "stream": True, "store": False,
            "input": [{"role": "user", "content": E.unique_prompt()}]}
    ref = E.post(two.decode.url, RESPONSES, dict(body, stream=False))
    assert ref.status == 200, E.describe(ref)
    want = "".join(c["text"] for o in ref.json()["output"] if o["type"] == "message" for c in o["content"])
    events, victim = _stream_and_kill(proxy.url, RESPONSES, body, two)
    try:
        types = [e["type"] for e in events]
        assert types[0] == "response.created" and types.count("response.created") == 1, types
        assert types[-1] == "response.completed" and "error" not in types, types[-3:]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        done = events[-1]["response"]
        assert done["id"] == events[0]["response"]["id"]
        assert done["usage"]["output_tokens"] == ref.json()["usage"]["output_tokens"]
        got = _response_text(events)
        assert done["output"][-1]["content"][0]["text"] == got
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        print(f"\n[e2e] responses: stream moved off {victim.url} after {KILL_AFTER} events; {same} of {len(want)} "
              f"characters equal to the uninterrupted answer ({'exact' if got == want else 'differs from there'}); "
              f"usage {done['usage']}", file=sys.stderr)
    finally:
        victim.restart(e2e_log_dir)


@pytest.mark.parametrize("endpoint", ["chat", "completions", "generate", "messages", "responses"])
def test_exactness_over_cut_points(two, proxy, endpoint):
    """For k = 1..CUTS: the decode serving the stream is wedged (SIGSTOP) after k events; the
    stall rule moves the stream; the answer is compared with the uninterrupted one. Generate must
    be exact at every cut; the text continuations' share is reported (docs/benchmarks.md)."""
    if endpoint == "generate":
        body = _generate_body(two, SWEEP_TOKENS)
        path = GENERATE
        plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        want: object = E.post(two.decode.url, GENERATE, plain).json()["choices"][0]["token_ids"]
    elif endpoint == "messages":
        body = {"model": E.MODEL_NAME, "max_tokens": SWEEP_TOKENS, "temperature": 0, "stream": True,
                "messages": [{"role": "user", "content": E.unique_prompt()}]}
        path = MESSAGES
        content = E.post(two.decode.url, MESSAGES, dict(body, stream=False)).json()["content"]
        want = "".join(b["text"] for b in content if b["type"] == "text")
    elif endpoint == "responses":
        body = {"model": E.MODEL_NAME, "max_output_tokens": SWEEP_TOKENS, "temperature": 0, "stream": True,
                "store": False, "input": [{"role": "user", "content": E.unique_prompt()}]}
        path = RESPONSES
        output = E.post(two.decode.url, RESPONSES, dict(body, stream=False)).json()["output"]
        want = "".join(c["text"] for o in output if o["type"] == "message" for c in o["content"])
    else:
        body = E.text_body(endpoint, E.unique_prompt(), max_tokens=SWEEP_TOKENS, stream=True,
                           stream_options={"include_usage": True})
        path = E.endpoint_path(endpoint)
        plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        choice = E.post(two.decode.url, path, plain).json()["choices"][0]
        want = choice["message"]["content"] if endpoint == "chat" else choice["text"]
    exact, moved, rows = 0, 0, []
    for k in range(1, CUTS + 1):
        _both_healthy(proxy.url)
        log_at = len(proxy.proc.log_text())
        lead = {"chat": 1, "messages": 2, "responses": 4}.get(endpoint, 0)  # events before the first token's
        events, victim = _stream_and_kill(proxy.url, path, body, two, after=k + lead, freeze=True, must=False)
        if endpoint == "messages":
            assert events[-1]["type"] == "message_stop" and not [e for e in events if e["type"] == "error"]
            used = events[-2]["usage"]["output_tokens"]
            got = _message_text(events)
        elif endpoint == "responses":
            assert events[-1]["type"] == "response.completed" and not [e for e in events if e["type"] == "error"]
            used = events[-1]["response"]["usage"]["output_tokens"]
            got = _response_text(events)
        else:
            assert events[-1] == "[DONE]" and not [e for e in events[:-1] if "error" in e], events[-3:]
            used = events[-2]["usage"]["completion_tokens"]
            got = _ids(events) if endpoint == "generate" else _text(events, endpoint)
        # The uninterrupted answer runs to the budget; a text continuation that is not exact is
        # another answer from the cut on, which may end sooner (the model's end of text).
        assert used == SWEEP_TOKENS if got == want or endpoint == "generate" else 0 < used <= SWEEP_TOKENS, used
        broke = _BROKE.findall(proxy.proc.log_text()[log_at:])
        if victim is None or not broke:  # the answer was whole before the cut: nothing moved
            rows.append((k, None, None, got == want))
            continue
        moved += 1
        exact += got == want
        rows.append((k, int(broke[0][1]), broke[0][0], got == want))
    print(f"\n[e2e] {endpoint}: {exact} of {moved} continued answers equal to the uninterrupted one "
          f"({SWEEP_TOKENS} tokens, temperature 0; {CUTS - moved} streams whole before the cut); "
          f"(k, tokens before the break, reason, exact): {rows}", file=sys.stderr)
    assert moved >= CUTS // 2, rows
    if endpoint == "generate":
        assert exact == moved, rows
