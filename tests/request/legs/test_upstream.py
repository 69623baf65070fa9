"""upstream.py's mapping of upstream statuses and transport failures (pure parts: no socket).

The calls themselves run over real sockets in test_pipeline.py, test_failure_isolation.py
and test_recovery.py; here each answer the mapping can give is checked on its own.
"""

import pytest

from epd_proxy.config import InstanceSpec
from epd_proxy.http.transport import UpstreamError, UpstreamTimeout
from epd_proxy.instances.health import OutlierSettings
from epd_proxy.instances.pool import InstancePool
from epd_proxy.request.context import RequestContext
from epd_proxy.request.legs.upstream import status_error, transport_error, upstream_message


def setup(n=2):
    """A pool of two prefills (its connection pools need the running loop), and a request."""
    pool = InstancePool("prefill", [InstanceSpec(f"http://10.0.0.{i}:8100", "prefill") for i in range(n)],
                        outlier=OutlierSettings(fail_threshold=3))
    return pool, pool.instances[0], RequestContext("r1", "/v1/chat/completions", [])


@pytest.mark.parametrize("body, message", [
    (b'{"error": {"message": "bad image", "type": "BadRequestError"}}', "bad image"),
    (b'{"error": "plain"}', "plain"),
    (b'{"detail": "Not Found"}', "Not Found"),
    (b"  upstream text \n", "upstream text"),
    (b"", "(empty body)"),
])
def test_upstream_message_takes_the_human_part(body, message):
    assert upstream_message(body) == message


async def test_a_4xx_is_relayed_as_received_and_blames_nobody():
    pool, inst, ctx = setup()
    body = b'{"error": {"message": "too long", "type": "BadRequestError", "param": null, "code": 400}}'
    err = status_error(pool, inst, ctx, "prefill", 400, body, None)
    assert (err.status, err.retryable, err.body(), err.content_type()) == (400, False, body, b"application/json")
    assert inst.errors == 0 and not ctx.excluded


@pytest.mark.parametrize("status, kind", [(503, "http_503"), (500, "http_500")])
async def test_a_5xx_is_a_retryable_502_naming_the_role_and_excludes_the_instance(status, kind):
    pool, inst, ctx = setup()
    err = status_error(pool, inst, ctx, "prefill", status, b'{"error": {"message": "boom"}}', None)
    assert (err.status, err.retryable) == (502, True)
    assert err.message == f"prefill instance failed with HTTP {status}: boom"
    assert inst in ctx.excluded and inst.health.errors == {kind: 1}
    # A gateway status is an instance signal (consecutive failures); vLLM's 500 is not.
    assert inst.failures == (1 if status == 503 else 0)


# The failures are built in the test, not at collection: an exception object held by the
# parametrisation would live all session long (test_request_cycles counts the live ones).
FAILURES = {
    "timeout": lambda: UpstreamTimeout("no answer within 5 s"),
    "reset": lambda: UpstreamError("reset by peer"),
    "ejected": lambda: UpstreamError("stalled", kind="ejected"),
}


@pytest.mark.parametrize("failure, status, message", [
    ("timeout", 504, "prefill instance timed out: no answer within 5 s"),
    ("reset", 502, "prefill instance broke off the connection while reading its answer"),
    ("ejected", 502, "prefill instance stopped answering and was taken out of rotation"),
])
async def test_transport_failures_name_the_role_never_the_address(failure, status, message):
    pool, inst, ctx = setup()
    exc = FAILURES[failure]()
    err = transport_error(pool, inst, ctx, "prefill", exc, "reading its answer")
    assert (err.status, err.retryable, err.message) == (status, True, message)
    assert "10.0.0." not in err.message and inst in ctx.excluded


async def test_a_refused_connection_is_a_503_once_no_instance_in_rotation_is_left():
    pool, inst, ctx = setup()
    refused = UpstreamError("connect to 10.0.0.0:8100: Connection refused", kind="connect")
    err = transport_error(pool, inst, ctx, "prefill", refused, "sending the request")
    assert (err.status, err.message) == (502, "prefill instance unreachable")
    other = pool.instances[1]
    err = transport_error(pool, other, ctx, "prefill", refused, "sending the request")
    assert (err.status, err.retryable) == (503, True)
    assert err.message == "no prefill instance available: none accepts connections"


async def test_the_proxys_own_shortage_is_a_503_and_not_the_instances_fault():
    pool, inst, ctx = setup()
    err = transport_error(pool, inst, ctx, "prefill",
                          UpstreamError("connect to 10.0.0.0:8100: Too many open files", kind="local"),
                          "sending the request")
    assert (err.status, err.retryable) == (503, False)
    assert err.message == "the proxy is short of local resources (Too many open files); retry later"
    assert pool.outliers.local_errors == 1 and inst.errors == 0 and not ctx.excluded


async def test_a_held_timeout_or_500_excludes_the_instance_and_blames_it_only_on_the_verdict():
    from epd_proxy.request.legs.upstream import HeldFailure

    pool, inst, ctx = setup()
    timeout = transport_error(pool, inst, ctx, "encode", UpstreamTimeout("no answer within 5 s"), "sending",
                              hold=True)
    assert isinstance(timeout, HeldFailure) and (timeout.status, timeout.retryable) == (504, True)
    assert inst in ctx.excluded and inst in ctx.timed_out
    assert inst.errors == 0 and inst.health.failures == 0  # nothing recorded yet
    timeout.settle(pool, blame=True)
    assert inst.health.errors == {"timeout": 1} and inst.health.failures == 1
    timeout.settle(pool, blame=True)  # once
    assert inst.health.failures == 1

    other = pool.instances[1]
    error = status_error(pool, other, ctx, "encode", 500, b'{"error": {"message": "boom"}}', None, hold=True)
    assert isinstance(error, HeldFailure) and (error.status, error.retryable) == (502, True)
    error.settle(pool, blame=False)  # the item's fault: nothing on the instance
    assert other.errors == 0 and not other.health.errors and other in ctx.excluded

    # An instance this request already blamed holds nothing: a signal counts once per request.
    again = transport_error(pool, inst, ctx, "encode", UpstreamTimeout("again"), "sending", hold=True)
    again.settle(pool, blame=True)
    assert inst.health.failures == 1
