"""The roster shared between ``--workers`` processes: what one worker's API changes, the
others apply (the parent relays the messages, ``runtime/workers.py``)."""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Callable, Protocol

from epd_proxy.config import InstanceSpec

if TYPE_CHECKING:  # pragma: no cover
    from epd_proxy.instances.membership import Membership

log = logging.getLogger("epd_proxy.workers")


class Link(Protocol):
    """A message channel to the other workers (``runtime.workers.PeerLink``)."""

    def start(self, on_message: Callable[[dict], None]) -> None: ...

    def send(self, message: dict) -> None: ...


# Roster changes shared with the other workers. Health verdicts (``forgotten``) and
# their consequences (``left``) stay per worker: each one probes for itself.
SHARED_EVENTS = frozenset({"registered", "refreshed", "updated", "draining", "removed"})


class SharedRoster:
    """Keeps this worker's roster in step with the others': changes made through
    this worker's API go out over ``link``; changes from the others are applied here.

    Changes every worker makes by itself — a reload (each worker gets the SIGHUP),
    DNS discovery (each worker resolves), and those received from another worker —
    are made inside ``local()`` and not sent."""

    def __init__(self, membership: Membership, link: Link) -> None:
        self.membership = membership
        self.link = link
        self._local = 0
        self._draining: set[str] = set()  # URLs draining here
        self.applied = 0  # changes received and applied (tests wait on it)
        membership.subscribe(self._changed)
        link.start(self._received)

    @contextlib.contextmanager
    def local(self):
        self._local += 1
        try:
            yield
        finally:
            self._local -= 1

    def _changed(self, change) -> None:
        url = change.spec.url
        if change.event == "draining":
            self._draining.add(url)
        elif change.event == "removed" and url in self._draining:
            # A drained instance leaving: every worker that drained it sees it leave by
            # itself (and one that did not, e.g. whose DNS answer still lists it, keeps it).
            self._draining.discard(url)
            return
        elif change.event == "registered":
            self._draining.discard(url)
        if self._local or change.event not in SHARED_EVENTS:
            return
        spec = {f: getattr(change.spec, f) for f in change.spec.__slots__}
        self.link.send({"event": change.event, "source": change.source, "spec": spec})

    def _received(self, message: dict) -> None:
        fields = dict(message["spec"])
        fields["ec_zmq_addrs"] = tuple(fields.get("ec_zmq_addrs") or ())
        fields["models"] = tuple(fields.get("models") or ())
        spec = InstanceSpec(**fields)
        event, m = message["event"], self.membership
        with self.local():
            try:
                if event in ("registered", "refreshed", "updated"):
                    m.register(spec, source=message["source"])
                elif event == "draining":
                    m.drain(spec.url)
                elif event == "removed":
                    m.unregister(spec.url)
            except ValueError as exc:  # e.g. a conflicting registration made here meanwhile
                log.warning("roster change from another worker not applied (%s %s): %s", event, spec.url, exc)
                return
        self.applied += 1
