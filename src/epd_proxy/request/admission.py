"""Admission control: how many client requests one proxy process works on at once.

Past ``limit`` requests in progress, a request waits in a bounded queue for a
slot; past the queue (or after ``queue_timeout`` in it) it is shed with 429.
The decision is made before the body is parsed and before any upstream work,
so a shed request costs one comparison and one prebuilt response. A freed slot
is handed straight to a waiter, so a newcomer cannot overtake the queue.

Which waiter: the queue is a fair queue (tenants/fair_queue.py): the highest
priority class first, and within a class the client keys in weighted fair
order; with no tenants configured every request is one flow of one class, a
plain FIFO. A request of a sheddable class never waits (no free slot: 429 at
once), a full queue gives up its lowest-class waiter for a newcomer of a
higher class, and ``reserve`` slots are kept for the top class (the others use
at most ``limit - reserve``), so its requests need not wait for one to free.

``limit == 0`` means unlimited: the fast path is then one comparison.
"""

from __future__ import annotations

import asyncio

from epd_proxy.observe.metrics import Buckets, Collector
from epd_proxy.tenants.fair_queue import FairQueue
from epd_proxy.wire.errors import ProxyError

# The outcomes of :func:`decide`.
ADMIT, QUEUE, SHED = 0, 1, 2


def decide(active: int, waiting: int, limit: int, queue_size: int, sheddable: bool = False,
           displaces: bool = False, ahead: int | None = None) -> int:
    """What happens to a request arriving now (pure: the whole policy). ``sheddable``: its
    class never waits; ``displaces``: a full queue holds a waiter of a lower class, which it
    gives up for this request; ``ahead``: the waiters it may not overtake (default: all)."""
    if limit <= 0 or (active < limit and not (waiting if ahead is None else ahead)):
        return ADMIT
    if sheddable:
        return SHED
    if waiting < queue_size or displaces:
        return QUEUE
    return SHED


# A refusal for the proxy's own capacity: shaped as a key's 429 (tenants/limiter.py), its code a
# string that tells the two apart; its message says what to do, never how the proxy is configured.
OVERLOADED = "overloaded"


def overloaded(what: str) -> ProxyError:
    """429: ``what`` (the proxy, a stage, the encoders) has no room now."""
    return ProxyError(429, f"{what} at capacity; retry later", code=OVERLOADED)


def shed_error() -> ProxyError:
    return overloaded("the proxy is")


class Admission:
    """Slots for requests in progress, and the queue of requests waiting for one."""

    __slots__ = ("limit", "queue_size", "queue_timeout", "active", "_waiters", "shed", "queued",
                 "timed_out", "displaced", "shed_by_class", "reserve", "top")

    def __init__(self, limit: int = 0, queue_size: int = 0, queue_timeout: float = 0.0) -> None:
        self.limit = limit
        self.queue_size = queue_size
        self.queue_timeout = queue_timeout
        self.active = 0
        self._waiters = FairQueue()  # of futures, by class and client key
        self.shed = 0  # requests answered 429 (queue full or queue timeout)
        self.queued = 0  # requests that had to wait
        self.timed_out = 0  # of those, shed after queue_timeout
        self.displaced = 0  # of those, given up for a newcomer of a higher class
        self.shed_by_class: dict[str, int] = {}  # class name -> shed (with tenants)
        self.reserve = 0  # slots only the top class's requests may take (tenants' reserved_slots)
        self.top = 0  # that class's rank

    def reserve_for(self, top: int, slots: int) -> None:
        """Keep ``slots`` of the limit for requests of rank ``top`` (0: none kept)."""
        self.top, self.reserve = top, max(0, min(slots, self.limit - 1)) if self.limit > 0 else 0

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def try_enter(self, rank: int = 0, sheddable: bool = False, traffic: str | None = None) -> int:
        """ADMIT (a slot is taken), QUEUE (call :meth:`wait`) or SHED (counted). ``rank``,
        ``sheddable``: the request's class (``traffic``: its name, for the count of sheds)."""
        waiting = len(self._waiters)
        displaces = waiting >= self.queue_size and waiting > 0 and self._waiters.lowest_below(rank) is not None
        limit, ahead = self.limit, None
        if self.reserve:  # the top class may use the reserved slots, and overtakes the classes below it
            limit = limit if rank >= self.top else limit - self.reserve
            ahead = self._waiters.waiting_from(rank)
        verdict = decide(self.active, waiting, limit, self.queue_size, sheddable, displaces, ahead)
        if verdict == ADMIT:
            self.active += 1
        elif verdict == SHED:
            self.shed += 1
            if traffic is not None:
                self.shed_by_class[traffic] = self.shed_by_class.get(traffic, 0) + 1
        elif displaces and waiting >= self.queue_size:
            self._displace(rank)
        return verdict

    def _displace(self, rank: int) -> None:
        """A full queue gives up its lowest-class waiter (it is answered 429) for a higher class."""
        found = self._waiters.lowest_below(rank)
        if found is None:
            return
        fut, flow, low = found
        self._waiters.remove(fut, flow, low)
        self.displaced += 1
        self.shed += 1
        if not fut.done():
            fut.set_result(False)

    async def wait(self, flow: str = "", rank: int = 0, weight: float = 1.0) -> bool:
        """Wait in the queue (``flow``: the client key, ``rank`` and ``weight``: its class and
        share); True once a slot was handed over, False after the queue timeout, when given
        up for a higher class, or when the queue is closed (shutdown)."""
        self.queued += 1
        fut = asyncio.get_running_loop().create_future()
        self._waiters.push(fut, flow, rank, weight)
        try:
            if self.queue_timeout > 0:
                async with asyncio.timeout(self.queue_timeout):
                    await fut
            else:
                await fut
            return fut.result()
        except TimeoutError:
            if fut.done() and not fut.cancelled():
                return fut.result()  # the slot arrived as the clock ran out: use it
            self.shed += 1
            self.timed_out += 1
            return False
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.result():
                self.leave()  # handed a slot, but the client left: pass it on
            raise
        finally:
            if not fut.done():
                fut.cancel()
            self._waiters.remove(fut, flow, rank)

    def leave(self) -> None:
        """A request is over: its slot goes to the next live waiter (fair_queue.py), or is freed."""
        waiters = self._waiters
        while waiters:
            if self.reserve and self.active > self.limit - self.reserve and (waiters.top_rank() or 0) < self.top:
                break  # a reserved slot: the classes below the top one wait for another
            fut = waiters.pop()
            if not fut.done():
                fut.set_result(True)  # the slot changes hands; ``active`` is unchanged
                return
        self.active -= 1

    def close(self) -> None:
        """Send every waiter away without a slot (the proxy is shutting down)."""
        for fut in self._waiters.drain():
            if not fut.done():
                fut.set_result(False)


def admission_collector(admission: Admission, role_caps: dict[str, Admission], queue_wait: Buckets) -> Collector:
    """The front door's slots, queue and sheds (``--max-inflight``), the stages' caps
    (``--max-inflight-per-role``), and ``queue_wait``, the time queued requests waited."""
    def collect(f: dict[str, list]) -> None:
        f["epd_proxy_shed_requests"] = [[admission.shed]]
        f["epd_proxy_queue_depth"] = [[admission.waiting]]
        f["epd_proxy_admitted_requests"] = [[admission.active]]
        f["epd_proxy_queue_wait_seconds"] = [[queue_wait.counts, queue_wait.sum]]
        f["epd_proxy_tenant_shed_requests"] = [[c, n] for c, n in admission.shed_by_class.items()]
        f["epd_proxy_tenant_displaced_requests"] = [[admission.displaced]]
        for role, cap in role_caps.items():
            f["epd_proxy_stage_shed_requests"].append([role, cap.shed])
            f["epd_proxy_stage_queue_depth"].append([role, cap.waiting])
    return collect
