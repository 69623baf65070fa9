"""The pure limit decisions: windows, room, settlement, the SDKs' headers."""

import calendar

from epd_proxy.tenants.limits import (
    duration_text,
    estimate_input_tokens,
    fits,
    hits,
    rate_headers,
    refused_by,
    retry_after,
    settlement,
    window,
)
from epd_proxy.tenants.table import KeyPolicy

NOW = 1_767_225_600.0 + 30.5  # 2026-01-01 00:00:30.5 UTC


def test_windows_are_aligned_to_the_clock():
    assert window("second", NOW) == (int(NOW), int(NOW) + 1)
    n, end = window("minute", NOW)
    assert end == 1_767_225_660.0 and n == int(NOW // 60)
    assert window("day", NOW)[1] == 1_767_225_600.0 + 86400
    n, end = window("month", NOW)
    assert end == calendar.timegm((2026, 2, 1, 0, 0, 0)) and n == 2026 * 12
    assert window("month", calendar.timegm((2026, 12, 31, 23, 0, 0)))[1] == calendar.timegm((2027, 1, 1, 0, 0, 0))


def test_room():
    assert fits(0, 1, 1) and not fits(1, 1, 1)
    assert fits(9, 0, 10) and not fits(10, 0, 10)  # output: let in while below the limit
    assert fits(0, 500, 100) and not fits(1, 500, 100)  # larger than the window: only into an empty one
    assert estimate_input_tokens(0) == 1 and estimate_input_tokens(401) == 101


def test_hits_settlement_and_the_refusing_counter():
    policy = KeyPolicy("a", {"requests_per_second": 2, "input_tokens_per_minute": 100,
                             "output_tokens_per_minute": 50, "tokens_per_day": 1000})
    hs = hits(policy, "d", 40, NOW)
    assert [h.name for h in hs] == ["requests_per_second", "input_tokens_per_minute", "output_tokens_per_minute",
                                    "tokens_per_day"]
    assert [h.amount for h in hs] == [1, 40, 0, 40]
    assert all("{d}" in h.key for h in hs) and hs[0].key != hits(policy, "d", 40, NOW + 1)[0].key
    assert refused_by(hs, [0, 70, 0, 0]).name == "input_tokens_per_minute"
    assert refused_by(hs, [0, 0, 50, 0]).name == "output_tokens_per_minute"
    assert refused_by(hs, [1, 60, 49, 960]) is None
    assert retry_after(hs[1], NOW) == 30
    adds = {h.name: n for h, n in settlement(hs, 40, (25, 7, None))}
    assert adds == {"input_tokens_per_minute": -15, "output_tokens_per_minute": 7, "tokens_per_day": -8}
    assert settlement(hs, 40, (None, None, None)) == []


def test_headers_openai_and_anthropic():
    policy = KeyPolicy("a", {"requests_per_minute": 10, "requests_per_second": 5, "input_tokens_per_minute": 100})
    hs = hits(policy, "d", 10, NOW)
    values = [3, 9, 10]  # per second, per minute, input
    got = dict(rate_headers(hs, values, NOW, anthropic=False))
    assert got[b"x-ratelimit-limit-requests"] == b"10" and got[b"x-ratelimit-remaining-requests"] == b"1"
    assert got[b"x-ratelimit-reset-requests"] == b"29s"
    assert got[b"x-ratelimit-limit-tokens"] == b"100" and got[b"x-ratelimit-remaining-tokens"] == b"90"
    got = dict(rate_headers(hs, values, NOW, anthropic=True))
    assert got[b"anthropic-ratelimit-requests-remaining"] == b"1"
    assert got[b"anthropic-ratelimit-requests-reset"] == b"2026-01-01T00:01:00Z"
    assert got[b"anthropic-ratelimit-input-tokens-limit"] == b"100"
    assert b"anthropic-ratelimit-output-tokens-limit" not in got
    assert [duration_text(s) for s in (0.02, 1.5, 59, 360, 7380)] == ["20ms", "1.5s", "59s", "6m0s", "2h3m0s"]
