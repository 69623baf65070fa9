"""Outlier detection: what requests and probes say of one role's instances, and the ejection
and re-admission timers (Envoy's outlier detector, beside the host set ``pool.py`` keeps and
the active health checks ``probes.py`` runs).

Each signal goes through the pure health machine (``health.py``: ``OutlierRules``); this is its
shell. It counts the signal (by kind, once per client request with the request's ``ctx``, which
it also marks failed, so a retry prefers another instance), tells the host set to rebuild the
lists a pick reads when a state changes, arms the timer that makes an ejected instance
half-open when its ejection time is over, and fails the pending requests of an instance ejected
for not answering. The request path holds this object itself (``UpstreamStage.outliers``), so a
success costs what it did when the pool recorded it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol, Sequence

from epd_proxy.http.transport import UpstreamError
from epd_proxy.instances.health import BY_WEDGED, EJECTED, HEALTHY, WEDGED, Ejection, OutlierRules
from epd_proxy.instances.instance import Instance
from epd_proxy.instances.instance import now as _now  # the instances' one clock
from epd_proxy.instances.load_signals import running_again

# The pool's logger: operators filter on it (docs/architecture.md, "Modules").
log = logging.getLogger("epd_proxy.pool")


class Hosts(Protocol):
    """The host set, as far as the detector reads and tells it (``pool.InstancePool``)."""

    @property
    def role(self) -> str: ...
    @property
    def instances(self) -> Sequence[Instance]: ...
    @property
    def out(self) -> int: ...

    def refresh(self) -> None: ...


class OutlierDetector:
    """The outlier signals of one role's instances and their ejection timers."""

    def __init__(self, hosts: Hosts, rules: OutlierRules) -> None:
        self.hosts = hosts
        self.role = hosts.role
        self.rules = rules  # every ejection knob (health.py)
        self.local_errors = 0  # the proxy's own resource failures (never blamed on an instance)

    # -- what requests observe -----------------------------------------------------------
    def record_success(self, inst: Instance) -> None:
        """The instance answered (a 200, or a 4xx: the request's fault, not its)."""
        h = inst.health
        h.failures = 0
        h.window_requests += 1
        if h.state is not HEALTHY:
            own = self._own(inst)
            if own.rules.success(h, _now()):
                own._changed(inst, "answered again")

    def record_failure(self, inst: Instance, reason: str, kind: str = "connection", ctx=None) -> None:
        """An instance signal (connection failure, timeout, gateway status). With ``ctx``
        (the request's context) it counts once per client request."""
        own = inst.detector
        if own is not self and own is not None:  # another role's instance (a prefill answering alone)
            own.record_failure(inst, reason, kind, ctx)
            return
        if self._note(inst, kind, reason, ctx):
            return
        hosts = self.hosts
        verdict = self.rules.instance_failure(inst.health, _now(), kind=kind, size=len(hosts.instances),
                                              out=hosts.out)
        if verdict is not None:
            self._ejected(inst, verdict, reason)

    def record_request_failure(self, inst: Instance, reason: str, kind: str = "http_500", ctx=None) -> None:
        """A request signal (vLLM failed this one request): feeds the rate detector only."""
        own = inst.detector
        if own is not self and own is not None:  # another role's instance (a prefill answering alone)
            own.record_request_failure(inst, reason, kind, ctx)
            return
        if self._note(inst, kind, reason, ctx):
            return
        hosts = self.hosts
        verdict = self.rules.request_failure(inst.health, _now(), size=len(hosts.instances), out=hosts.out)
        if verdict is not None:
            self._ejected(inst, verdict, f"{inst.health.window_failures} of {inst.health.window_requests} "
                                         f"requests failed; last: {reason}")

    def standing(self, inst: Instance, why: str | None) -> None:
        """What the load scrape says of the instance's queue (load_signals.py, ``wedged``):
        standing still (``why``), it leaves routing at once; running again, it is back."""
        h = inst.health
        if why is None:
            # Back only when the scrape shows it running, or nothing waiting and some of its KV
            # cache freed since (load_signals.running_again): a queue still standing (within the
            # hold again after a lost scrape), or one emptied by failing its requests over while
            # its pinned blocks hold on, is no sign it admits anything. Else the ejection time
            # runs out to a trial.
            if running_again(inst.signals) and self.rules.unwedged(h, _now()):
                self._changed(inst, "running again")
            return
        verdict = self.rules.wedged(h, _now())
        if verdict is not None:
            inst.signals.wedged_kv = inst.signals.kv_usage
        if verdict is not None:
            h.errors[WEDGED] = h.errors.get(WEDGED, 0) + 1
            h.last_error = why
            self._ejected(inst, verdict, why)

    def _own(self, inst: Instance) -> OutlierDetector:
        """The detector of the instance's own role (its host set's lists are the ones to rebuild)."""
        own = inst.detector
        return self if own is None else own

    def record_local_error(self) -> None:
        """The proxy itself ran out of something (descriptors, buffers, memory)."""
        self.local_errors += 1

    # -- what probes observe (probes.py) --------------------------------------------------
    def probe_answered(self, inst: Instance) -> None:
        """A health probe answered 200: the instance may come back at once."""
        if self.rules.success(inst.health, _now(), probe=True):
            self._changed(inst, "health probe answered")

    def probe_failed(self, inst: Instance, kind: str, reason: str) -> None:
        """A health probe failed: an instance signal, never capped."""
        self._note(inst, kind, reason, None)
        hosts = self.hosts
        verdict = self.rules.instance_failure(inst.health, _now(), kind=kind, size=len(hosts.instances),
                                              out=hosts.out, probe=True)
        if verdict is not None:
            self._ejected(inst, verdict, reason)

    # -- an operator's --------------------------------------------------------------------
    def drain(self, inst: Instance) -> None:
        """Take an instance out of rotation for good (an operator's decision, through
        ``Membership.drain``): no rule moves it back."""
        self.rules.drain(inst.health)
        self.forget(inst)
        self.hosts.refresh()

    def forget(self, inst: Instance) -> None:
        """Its ejection timer cancelled (it drains, or leaves the host set)."""
        if inst.expiry is not None:
            inst.expiry.cancel()
            inst.expiry = None

    # -- the I/O side of a verdict ---------------------------------------------------------
    def _note(self, inst: Instance, kind: str, reason: str, ctx) -> bool:
        """Count the error; True if this request already blamed the instance."""
        inst.errors += 1
        h = inst.health
        h.errors[kind] = h.errors.get(kind, 0) + 1
        if kind != "ejected":  # a request failed over from it keeps the reason it was taken out
            h.last_error = reason
        if ctx is None:
            return False
        if inst in ctx.excluded:
            return True
        ctx.failed(inst)
        return False

    def _ejected(self, inst: Instance, verdict: Ejection, reason: str) -> None:
        self.hosts.refresh()
        h = inst.health
        log.warning("%s instance %s ejected for %.1f s (ejection %d, %s): %s", self.role, inst.url,
                    verdict.until - _now(), h.ejections, h.cause, reason)
        self.forget(inst)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (pure use): re-admission on the next signal
            loop = None
        if loop is not None:
            inst.expiry = loop.call_at(verdict.until, self._expire, inst)
        if verdict.stalled:
            # It stopped answering (or its queue stands still): what it has not answered yet
            # will not be answered either. Fail it now, so those requests are retried elsewhere.
            why = "its queue stands still" if h.cause is BY_WEDGED else "it stopped answering"
            n = inst.connections.fail_pending(lambda: UpstreamError(
                f"instance taken out of rotation: {why}", kind="ejected"))
            if n:
                log.warning("%s instance %s: failed over %d pending request(s)", self.role, inst.url, n)

    def _expire(self, inst: Instance) -> None:
        inst.expiry = None
        h = inst.health
        # Its last scrape still shows it unable to take requests (its queue standing, or its
        # pinned KV not freed yet): a trial would wait there. Scrapes lost: a trial decides.
        signals = inst.signals
        standing = h.cause is BY_WEDGED and signals.scraped_at is not None and not running_again(signals)
        if self.rules.expire(h, _now(), standing):
            log.info("%s instance %s half-open: trying it again", self.role, inst.url)
            self.hosts.refresh()
        elif h.state is EJECTED and h.ejected_until > _now():
            try:
                inst.expiry = asyncio.get_running_loop().call_at(h.ejected_until, self._expire, inst)
            except RuntimeError:  # no loop (pure use)
                pass

    def _changed(self, inst: Instance, why: str) -> None:
        self.forget(inst)
        self.hosts.refresh()
        log.info("%s instance %s is back in rotation (%s)", self.role, inst.url, why)
