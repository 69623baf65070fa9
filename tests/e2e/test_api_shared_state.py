"""A Responses follow-up through another proxy replica, against real vLLM: two replicas share
one state store (a real redis-server); the answer is stored by the decode behind replica A,
and a follow-up naming ``previous_response_id`` through replica B goes to that decode (the
store names it) and gives what a single instance gives for its own response."""

from __future__ import annotations

import pytest
import vllm_e2e as E
from redis_server import SERVER, RedisServer

CLUSTER = "api"
ORDER = 20
pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def replicas(api, start_proxy):
    if SERVER is None:
        pytest.skip("redis-server is not installed (scripts/ensure-system-packages.sh installs it)")
    server = RedisServer()
    try:
        yield [start_proxy(name, prefill=[api.prefill.url], decode=[api.decode.url],
                           extra=["--state-store", server.url]) for name in ("api-shared-a", "api-shared-b")]
    finally:
        server.close()


def test_a_responses_follow_up_through_the_other_replica_is_a_single_instances(api, replicas):
    a, b = replicas
    body = {"model": E.MODEL_NAME, "input": E.unique_prompt(), "max_output_tokens": 8, "temperature": 0}
    mine = E.post(a.url, E.RESPONSES, body)
    E.assert_api_ok(mine, False)
    theirs = E.post(api.single.url, E.RESPONSES, body)
    E.assert_api_ok(theirs, False)
    follow = {"model": E.MODEL_NAME, "input": "And then?", "max_output_tokens": 8, "temperature": 0}
    nxt = E.post(b.url, E.RESPONSES, dict(follow, previous_response_id=mine.json()["id"]))
    E.assert_api_ok(nxt, False)
    ref = E.post(api.single.url, E.RESPONSES, dict(follow, previous_response_id=theirs.json()["id"]))
    E.assert_api_ok(ref, False)
    assert E.api_text(E.RESPONSES, nxt) == E.api_text(E.RESPONSES, ref) != ""
    assert b"kv_transfer_params" not in nxt.body or nxt.json().get("kv_transfer_params") is None
