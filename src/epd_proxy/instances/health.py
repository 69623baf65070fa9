"""Per-instance health: the states an instance moves through and the rules that move it.

Pure logic over plain data, with the clock passed in (``now``: seconds on any
monotonic clock), so every rule is testable without sockets or sleeps. The
outlier detector (``outliers.py``) is the I/O shell: it feeds in what probes and
requests observe and acts on the verdicts (the host set's lists rebuilt, the
re-admission timer, failing the pending requests of an instance that stopped
answering).

What an answer says is kept apart from what it says about the request:

* **instance signals** (connection refused/reset, connect and first-byte
  timeouts, a hedge won against it (``stalled``), HTTP 502/503/504, a failed probe) feed a *consecutive* counter,
  ``fail_threshold`` in a row eject;
* **request signals** (an HTTP 500 or an in-band error: vLLM failing one
  request) feed a *rate* detector: the failure share among the requests an
  instance got in ``interval`` seconds from the first failure, once it has had
  ``min_requests``;
* a 4xx says nothing bad about the instance: it answered.

Passive signals (what requests saw) never take out more than
``max_ejection_percent`` of a role (rounded down: a role's only instance is
never ejected by them). A failed probe is the instance's own answer and ejects
regardless, and so does a queue that stands still (``wedged``: its own gauges);
routing covers the case where every instance is out (panic routing, in the
pool, over every one not draining and not standing still).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

HEALTHY = "healthy"
EJECTED = "ejected"
HALF_OPEN = "half-open"  # an ejection ran out: a share of live traffic decides
DRAINING = "draining"  # an operator asked it to leave (set by membership.py; it gets no new requests)

# Why an instance was ejected: it decides what may end the ejection early.
BY_PROBE = "probe"  # probes failed (or kept failing): a probe or request success ends it
BY_INSTANCE = "instance"  # requests saw instance signals: out for the ejection time
BY_RATE = "rate"  # too many request failures: out for the ejection time, back on a live success
# Its /metrics showed requests waiting and none running for longer than a short hold (a decode
# whose KV cache is full of blocks pinned for a later turn: vLLM hangs them without an error,
# its /health stays 200). Out until a scrape shows it running again (``unwedged``), or half-open
# after the ejection time like any passive ejection.
BY_WEDGED = "wedged"
# Its failure kind (``epd_proxy_instance_failures_total{kind="wedged"}``), counted per ejection.
WEDGED = BY_WEDGED

# The failure kind of a stage or probe timeout: an instance signal of its own (the
# instance stopped answering), never a request signal; an ejection for it also fails
# the instance's pending requests.
TIMEOUT = "timeout"
# An instance that did not answer within a hedge delay while another answered the same work
# (request/legs/hedged.py): an instance signal like a timeout, found in a fraction of the
# stage timeout; a wedged instance (connection open, no bytes) shows nothing else.
STALLED = "stalled"
# The failure kinds every instance shows from the start (0 until one happens), so that
# dashboards and alerts read 0 rather than nothing: the transport's (http/transport.py),
# the gateway and engine statuses, an in-band error, a probe's non-200, a hedge won against it
# (``stalled``), a queue that stood still (``wedged``). A rarer status (``http_501``, ...) gets
# its series when it first happens.
FAILURE_KINDS = ("connect", "connection", TIMEOUT, STALLED, "protocol", "ejected", "http_500", "http_502",
                 "http_503", "http_504", "in_band", "probe_status", WEDGED)


@dataclass(frozen=True, slots=True)
class OutlierSettings:
    """The knobs (``--fail-threshold``, ``--outlier-*``, ``--ejection-time``, ...)."""

    fail_threshold: int = 3
    failure_percent: float = 85.0
    min_requests: int = 20
    interval: float = 10.0
    ejection_time: float = 10.0
    max_ejection_time: float = 300.0
    max_ejection_percent: int = 50

    @classmethod
    def from_config(cls, config) -> "OutlierSettings":
        """From a :class:`~epd_proxy.config.ProxyConfig`."""
        return cls(fail_threshold=max(1, config.fail_threshold), failure_percent=config.outlier_failure_percent,
                   min_requests=config.outlier_min_requests, interval=config.outlier_interval,
                   ejection_time=config.ejection_time, max_ejection_time=config.max_ejection_time,
                   max_ejection_percent=config.max_ejection_percent)


class Health:
    """What is known about one instance's health (plain data)."""

    __slots__ = ("state", "failures", "ejections", "streak", "ejected_until", "cause", "seen_healthy",
                 "healthy_since", "window_start", "window_requests", "window_failures", "last_error",
                 "errors")

    def __init__(self) -> None:
        self.state = HEALTHY
        self.failures = 0  # consecutive instance signals
        self.ejections = 0  # in total
        self.streak = 0  # ejections without a clean spell between them: the time multiplier
        self.ejected_until = 0.0
        self.cause: str | None = None
        # Never answered a probe yet: probed at the fast interval until it does.
        self.seen_healthy = False
        self.healthy_since = 0.0
        self.window_start = 0.0
        self.window_requests = 0
        self.window_failures = 0
        self.last_error: str | None = None
        self.errors: dict[str, int] = {}  # by kind

    @property
    def out(self) -> bool:
        return self.state is EJECTED or self.state is HALF_OPEN


class Ejection(NamedTuple):
    """A verdict: the instance is out until ``until``; ``stalled`` when it stopped
    answering (its pending requests will not be answered either)."""

    until: float
    stalled: bool


class OutlierRules:
    """The state machine; every method takes the instance's :class:`Health` and the clock."""

    def __init__(self, settings: OutlierSettings | None = None) -> None:
        self.s = settings or OutlierSettings()

    def max_ejected(self, size: int) -> int:
        """How many of a role of ``size`` passive signals may have out at once."""
        return size * max(0, min(100, self.s.max_ejection_percent)) // 100

    def ejection_time(self, streak: int) -> float:
        return min(self.s.ejection_time * streak, max(self.s.max_ejection_time, self.s.ejection_time))

    # -- signals ------------------------------------------------------------------------
    def instance_failure(self, h: Health, now: float, *, kind: str, size: int, out: int,
                         probe: bool = False) -> Ejection | None:
        """A connection failure, timeout, gateway status or failed probe.

        ``size`` is the role's instance count and ``out`` how many are ejected or
        half-open now (the cap for passive signals)."""
        h.failures += 1
        stalled = kind == TIMEOUT or kind == STALLED
        if h.state is HALF_OPEN:
            return self._eject(h, now, BY_PROBE if probe else BY_INSTANCE, stalled)
        if h.state is EJECTED:
            if probe:
                h.cause = BY_PROBE  # probes confirm it is down: a probe success will end it
            return None
        if h.state is not HEALTHY or h.failures < max(1, self.s.fail_threshold):
            return None
        if not probe and out >= self.max_ejected(size):
            return None
        return self._eject(h, now, BY_PROBE if probe else BY_INSTANCE, stalled)

    def request_failure(self, h: Health, now: float, *, size: int, out: int) -> Ejection | None:
        """vLLM failed one request (HTTP 500, in-band error): counted once per client request."""
        s = self.s
        if now - h.window_start >= s.interval:
            h.window_start = now
            h.window_requests = 0
            h.window_failures = 0
        h.window_requests += 1
        h.window_failures += 1
        if h.state is HALF_OPEN:
            return self._eject(h, now, BY_RATE, False)
        if h.state is not HEALTHY or h.window_requests < max(1, s.min_requests):
            return None
        if h.window_failures * 100 < s.failure_percent * h.window_requests:
            return None
        if out >= self.max_ejected(size):
            return None
        return self._eject(h, now, BY_RATE, False)

    def wedged(self, h: Health, now: float) -> Ejection | None:
        """Its queue stands still (requests waiting, none running, past the hold): out of
        routing at once, **whatever the passive cap**. The cap keeps a doubtful signal from
        emptying a role, where panic routing would still find an instance that answers; this
        one is the instance's own gauges (as a failed probe is its own answer), and a decode
        that admits nothing answers no one, in rotation or in panic. When every decode stands
        still the placement answers elsewhere (``placement/decision.py``). A half-open one whose
        scrape says it stands still goes out again, whatever took it out before (a probe lost under
        load, say). ``stalled``: none of its requests
        runs, and those waiting are admitted only when pinned blocks expire (minutes): the ones
        not yet answered are failed over to be placed again, as for an instance that stopped
        answering; a stream already relayed moves by the stall rule (``request/migration.py``)."""
        if h.state is HEALTHY or h.state is HALF_OPEN:  # half-open for whatever cause: a trial waits there
            return self._eject(h, now, BY_WEDGED, True)
        return None

    def unwedged(self, h: Health, now: float) -> bool:
        """A scrape shows it running again (or nothing waiting): back in rotation, if it was
        out for standing still. True if the state changed."""
        if h.out and h.cause is BY_WEDGED:
            self._restore(h, now)
            return True
        return False

    def success(self, h: Health, now: float, *, probe: bool = False) -> bool:
        """A probe answered 200, or a request was answered; True if the state changed."""
        h.failures = 0
        if probe:
            h.seen_healthy = True
        state = h.state
        if state is HEALTHY or state is DRAINING:
            return False
        if state is EJECTED and h.cause is not BY_PROBE:
            return False  # passive ejections run their time
        if state is HALF_OPEN and probe and (h.cause is BY_RATE or h.cause is BY_WEDGED):
            return False  # its probes were fine all along: only a live success counts
        self._restore(h, now)
        return True

    def expire(self, h: Health, now: float, standing: bool = False) -> bool:
        """The ejection time is over: half-open. True if the state changed. ``standing``: the
        last scrape still shows it unable to take requests (its queue standing, or its pinned
        KV not freed yet); one out for standing still stays out another term (a trial request
        would wait in that queue until its pinned blocks expire)."""
        if h.state is EJECTED and now >= h.ejected_until:
            if standing and h.cause is BY_WEDGED:
                h.ejected_until = now + self.ejection_time(h.streak)
                return False
            h.state = HALF_OPEN
            return True
        return False

    def drain(self, h: Health) -> None:
        h.state = DRAINING

    # -- transitions --------------------------------------------------------------------
    def _eject(self, h: Health, now: float, cause: str, stalled: bool) -> Ejection:
        if h.streak and h.state is HEALTHY and now - h.healthy_since >= self.ejection_time(h.streak):
            h.streak = 0  # healthy for longer than its last ejection lasted: forgiven
        h.streak += 1
        h.ejections += 1
        h.state = EJECTED
        h.cause = cause
        h.ejected_until = now + self.ejection_time(h.streak)
        return Ejection(h.ejected_until, stalled)

    def _restore(self, h: Health, now: float) -> None:
        h.state = HEALTHY
        h.cause = None
        h.failures = 0
        h.ejected_until = 0.0
        h.healthy_since = now
        h.window_start = now
        h.window_requests = 0
        h.window_failures = 0
