"""The health rules alone: plain data and a clock passed in."""

from epd_proxy.instances.health import (
    BY_PROBE,
    BY_RATE,
    BY_WEDGED,
    EJECTED,
    HALF_OPEN,
    HEALTHY,
    Health,
    OutlierRules,
    OutlierSettings,
)


def rules(**kw):
    return OutlierRules(OutlierSettings(**kw))


def fail(r, h, now, n=1, *, size=2, out=0, probe=False, kind="connection"):
    verdict = None
    for _ in range(n):
        verdict = r.instance_failure(h, now, kind=kind, size=size, out=out, probe=probe)
    return verdict


def test_consecutive_instance_signals_eject_and_a_success_resets_the_count():
    r, h = rules(fail_threshold=3), Health()
    assert fail(r, h, 0.0, 2) is None
    r.success(h, 0.0)
    assert fail(r, h, 0.0, 2) is None and h.state is HEALTHY
    verdict = fail(r, h, 1.0)
    assert h.state is EJECTED and verdict.until == 1.0 + 10.0 and not verdict.stalled


def test_a_timeout_ejection_is_marked_stalled():
    r, h = rules(fail_threshold=1), Health()
    assert fail(r, h, 0.0, kind="timeout").stalled


def test_passive_signals_never_eject_more_than_the_cap():
    r = rules(fail_threshold=1)
    assert [r.max_ejected(n) for n in (1, 2, 3, 4, 5)] == [0, 1, 1, 2, 2]
    alone = Health()
    assert fail(r, alone, 0.0, 5, size=1) is None and alone.state is HEALTHY
    second = Health()
    assert fail(r, second, 0.0, size=2, out=1) is None and second.state is HEALTHY
    # A failed probe is the instance's own answer: not capped.
    assert fail(r, alone, 0.0, size=1, probe=True) is not None and alone.cause is BY_PROBE


def test_request_failures_feed_only_the_rate_detector():
    r, h = rules(fail_threshold=1, failure_percent=50, min_requests=4, interval=10), Health()
    h.window_requests = 0
    for _ in range(3):
        assert r.request_failure(h, 1.0, size=2, out=0) is None
    assert h.failures == 0 and h.state is HEALTHY  # never the consecutive count
    verdict = r.request_failure(h, 2.0, size=2, out=0)
    assert verdict is not None and h.cause is BY_RATE


def test_rate_needs_the_share_and_the_minimum_within_the_interval():
    r, h = rules(failure_percent=50, min_requests=4, interval=10), Health()
    assert r.request_failure(h, 100.0, size=2, out=0) is None
    h.window_requests += 5  # five answered requests in the window
    assert r.request_failure(h, 101.0, size=2, out=0) is None  # 2 of 7
    assert r.request_failure(h, 102.0, size=2, out=0) is None  # 3 of 8
    # The window starts again at the first failure after the interval.
    assert r.request_failure(h, 200.0, size=2, out=0) is None
    assert (h.window_requests, h.window_failures) == (1, 1)
    # A role's only instance: never ejected by request failures.
    alone = Health()
    for t in range(10):
        assert rules(min_requests=1).request_failure(alone, float(t), size=1, out=0) is None


def test_ejection_time_grows_with_ejections_in_a_row_and_is_capped():
    r, h = rules(fail_threshold=1, ejection_time=10, max_ejection_time=25), Health()
    times = []
    now = 0.0
    for _ in range(4):
        v = fail(r, h, now)
        times.append(v.until - now)
        now = v.until
        assert r.expire(h, now) and h.state is HALF_OPEN
    assert times == [10, 20, 25, 25]
    assert h.ejections == 4


def test_a_long_healthy_spell_forgives_earlier_ejections():
    r, h = rules(fail_threshold=1, ejection_time=10), Health()
    v = fail(r, h, 0.0)
    r.expire(h, v.until)
    r.success(h, v.until)  # a live success in half-open
    assert h.state is HEALTHY
    assert fail(r, h, v.until + 100).until == v.until + 100 + 10


def test_half_open_success_restores_and_failure_re_ejects_for_longer():
    r, h = rules(fail_threshold=3, ejection_time=10), Health()
    fail(r, h, 0.0, 3)
    assert not r.expire(h, 9.9) and h.state is EJECTED
    assert r.expire(h, 10.0) and h.state is HALF_OPEN
    v = fail(r, h, 10.5)  # one failure is enough in half-open
    assert h.state is EJECTED and v.until == 10.5 + 20
    r.expire(h, v.until)
    assert r.success(h, v.until) and h.state is HEALTHY and h.failures == 0


def test_what_ends_an_ejection_early():
    r = rules(fail_threshold=1, min_requests=1, failure_percent=50)
    passive = Health()
    fail(r, passive, 0.0)
    assert not r.success(passive, 1.0, probe=True)  # passive ejections run their time ...
    fail(r, passive, 1.0, probe=True)  # ... unless probes confirm it is down:
    assert passive.cause is BY_PROBE
    assert r.success(passive, 2.0, probe=True) and passive.state is HEALTHY
    rate = Health()
    r.request_failure(rate, 0.0, size=2, out=0)
    assert rate.state is EJECTED
    r.expire(rate, rate.ejected_until)
    assert not r.success(rate, rate.ejected_until, probe=True)  # its probes were fine all along
    assert r.success(rate, rate.ejected_until) and rate.state is HEALTHY


def test_never_seen_healthy_until_a_probe_answers():
    r, h = rules(), Health()
    assert h.state is HEALTHY and not h.seen_healthy
    r.success(h, 0.0)
    assert not h.seen_healthy
    r.success(h, 0.0, probe=True)
    assert h.seen_healthy


def test_draining_is_left_alone_by_signals():
    r, h = rules(fail_threshold=1), Health()
    r.drain(h)
    assert fail(r, h, 0.0) is None and not r.success(h, 0.0, probe=True)
    assert h.state == "draining"


def test_settings_come_from_the_command_line_with_the_dataclass_defaults():
    from epd_proxy.cli import build_parser
    from epd_proxy.cli.serve import config_from_args
    from epd_proxy.config import ProxyConfig

    defaults = OutlierSettings.from_config(config_from_args(build_parser().parse_args(
        ["serve", "--decode", "http://d:1"])))
    assert defaults == OutlierSettings.from_config(ProxyConfig()) == OutlierSettings()
    args = build_parser().parse_args(
        ["serve", "--decode", "http://d:1", "--fail-threshold", "4", "--outlier-failure-percent", "60",
         "--outlier-min-requests", "7", "--outlier-interval", "3", "--ejection-time", "2",
         "--max-ejection-time", "9", "--max-ejection-percent", "34"])
    assert OutlierSettings.from_config(config_from_args(args)) == OutlierSettings(
        fail_threshold=4, failure_percent=60, min_requests=7, interval=3, ejection_time=2,
        max_ejection_time=9, max_ejection_percent=34)


def test_out_of_range_settings_are_refused():
    import pytest

    from epd_proxy.config import InstanceSpec, ProxyConfig

    d = [InstanceSpec("http://d:1", "decode")]
    for bad in ({"max_ejection_percent": 101}, {"outlier_failure_percent": 0}, {"outlier_min_requests": 0},
                {"ejection_time": 0}, {"max_ejection_time": 1.0, "ejection_time": 2.0}, {"fail_threshold": 0}):
        with pytest.raises(ValueError):
            ProxyConfig(decode=d, **bad).validate()


def test_passive_signals_alone_never_take_out_more_than_the_cap():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    events = st.lists(st.tuples(st.integers(0, 4), st.sampled_from(["instance", "timeout", "request", "ok", "tick"])),
                      max_size=200)

    @settings(max_examples=200, deadline=None)
    @given(n=st.integers(1, 5), events=events, percent=st.sampled_from([0, 34, 50, 100]))
    def check(n, events, percent):
        r = rules(fail_threshold=2, min_requests=2, failure_percent=50, max_ejection_percent=percent,
                  ejection_time=1.0)
        hs = [Health() for _ in range(n)]
        now = 0.0
        for i, what in events:
            h = hs[i % n]
            out = sum(x.out for x in hs)
            now += 0.25
            if what in ("instance", "timeout"):
                r.instance_failure(h, now, kind=what, size=n, out=out)
            elif what == "request":
                r.request_failure(h, now, size=n, out=out)
            elif what == "ok":
                r.success(h, now)
            else:
                for x in hs:
                    r.expire(x, now)
            assert sum(x.out for x in hs) <= r.max_ejected(n)

    check()


def test_a_wedged_instance_is_out_at_once_whatever_the_cap_and_back_when_it_runs():
    """Its queue standing still is its own gauges: no passive cap keeps it in rotation (two of
    two decodes may be out this way), and it stays out while its scrape says so."""
    r, h, other = rules(max_ejection_percent=50), Health(), Health()
    assert r.wedged(other, 0.0) is not None  # one of two out already: the cap does not apply
    verdict = r.wedged(h, 0.0)
    # stalled: its requests waiting there are failed over (none runs; they would wait for the pins)
    assert verdict is not None and h.state is EJECTED and h.cause is BY_WEDGED and verdict.stalled
    assert other.out and h.out
    assert r.wedged(h, 1.0) is None  # already out
    assert not r.success(h, 1.0, probe=True)  # its probes were fine all along
    assert not r.success(h, 1.5)  # nor does a request it finally finished bring it back
    # the ejection time over while its scrape still shows it standing: out another term
    assert not r.expire(h, 10.0, standing=True) and h.state is EJECTED and h.ejected_until == 20.0
    assert r.expire(h, 20.0) and h.state is HALF_OPEN  # the scrape lost: a trial decides
    assert not r.success(h, 20.5, probe=True) and h.state is HALF_OPEN
    assert r.wedged(h, 20.6) is not None and h.state is EJECTED  # half-open, still standing: out again
    assert r.unwedged(h, 21.0) and h.state is HEALTHY
    assert not r.unwedged(h, 22.0)
    # another cause is not ended by a running queue, nor kept out by a standing one
    fail(r, h, 30.0, 3)
    assert h.state is EJECTED and not r.unwedged(h, 31.0)
    assert r.expire(h, h.ejected_until, standing=True) and h.state is HALF_OPEN
    # a half-open instance out for another cause (a probe lost under load, say) whose scrape shows
    # its queue standing is out again too: a trial there would wait until the pins expire (the
    # soak at vLLM's default TTL: 16 requests waited 60 s when its trial decided)
    assert r.wedged(h, 60.0) is not None and h.state is EJECTED and h.cause is BY_WEDGED


def test_stalled_signals_eject_like_timeouts_and_half_open_brings_it_back():
    """A hedge won against an instance (request/legs/hedged.py): an instance signal, so
    ``fail_threshold`` in a row eject it, its pending requests failed over (stalled); the
    ejection runs out to half-open, and one live success restores it."""
    r, h = rules(fail_threshold=3), Health()
    assert fail(r, h, 0.0, 2, kind="stalled") is None
    verdict = fail(r, h, 0.1, kind="stalled")
    assert h.state is EJECTED and verdict.stalled
    assert r.expire(h, verdict.until) and h.state is HALF_OPEN
    assert r.success(h, verdict.until + 0.1) and h.state is HEALTHY
