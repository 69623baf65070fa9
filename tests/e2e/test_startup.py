"""The proxy and vLLM started together, as the pods of a cluster start: the proxy is up in a
second, vLLM loads for tens of seconds, and the first requests arrive as soon as vLLM answers
``/health`` (what a readiness gate in front of the instances lets through).

Runs first (ORDER 0 of the first cluster), so the P/D cluster is launched by this test and is not
yet loading a model when the proxy starts; the later P/D modules reuse it.
"""

from __future__ import annotations

import pytest
import vllm_e2e as E

CLUSTER = "pd"
ORDER = 0
pytestmark = pytest.mark.vllm


def test_proxy_started_with_vllm_serves_the_first_requests(clusters, start_proxy):
    cluster = clusters.launch("pd")
    proxy = start_proxy("startup", prefill=[cluster.prefill.url], decode=[cluster.decode.url])
    # The proxy is live at once, and ready: /ready is about the proxy, and its roster has an
    # instance for every role even though none of them answers yet.
    assert E.request(proxy.url, "GET", "/health", timeout=10).status == 200
    ready = E.request(proxy.url, "GET", "/ready", timeout=10)
    assert ready.status == 200, E.describe(ready)
    assert cluster.prefill.proc is not None and cluster.decode.proc is not None
    try:
        E.request(cluster.decode.url, "GET", "/health", timeout=2)
        loading = False
    except OSError:
        loading = True
    assert loading, "vLLM answered before the proxy was up: the test did not start them together"

    cluster.wait_ready()  # both instances answer /health: send at once, no grace period
    cases = [(endpoint, stream) for endpoint in ("completions", "chat") for stream in (False, True)]
    cases += [("completions", False), ("chat", True)]
    sent = []
    for endpoint, stream in cases:
        body = E.text_body(endpoint, E.unique_prompt(), stream=stream)
        sent.append((endpoint, stream, body, E.post(proxy.url, E.endpoint_path(endpoint), body)))
    failed = [f"{endpoint} stream={stream}: {E.describe(r, 300)}"
              for endpoint, stream, _, r in sent if r.status != 200]
    assert not failed, f"{len(failed)} of {len(sent)} first requests failed:\n" + "\n".join(failed)
    for endpoint, stream, body, r in sent:
        E.assert_ok(r, stream)
        assert E.text_of(r, endpoint) == E.text_of(E.reference(cluster, endpoint, body), endpoint)
