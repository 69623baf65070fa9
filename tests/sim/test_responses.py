"""vLLM's response shapes, as pure functions."""

from epd_proxy.sim.responses import api_error_body, refusal, system_fingerprint


def test_a_refusal_is_typed_by_its_status():
    exc = refusal(503, "busy")
    assert (exc.status, exc.etype, exc.param) == (503, "ServiceUnavailableError", None)
    assert refusal(418, "odd").etype == "BadRequestError" and refusal(599, "odd").etype == "InternalServerError"
    assert api_error_body(refusal(404, "gone", "model")) == (
        b'{"error":{"message":"gone","type":"NotFoundError","param":"model","code":404}}')


def test_system_fingerprint_forms():
    fp = system_fingerprint("auto", ("m", 1), 2, 1)
    assert fp.startswith("vllm-0.32.0-tp2-") and len(fp.rsplit("-", 1)[1]) == 8
    assert fp == system_fingerprint("auto", ("m", 1), 2, 1) != system_fingerprint("auto", ("m", 2), 2, 1)
    assert system_fingerprint("", ("m",), 1, 1) is None
    assert system_fingerprint("fixed", ("m",), 1, 1) == "fixed"
