"""Admission control: how many client requests one proxy process works on at once.

Past ``limit`` requests in progress, a request waits in a bounded FIFO queue
for a slot; past the queue (or after ``queue_timeout`` in it) it is shed with
429. The decision is made before the body is parsed and before any upstream
work, so a shed request costs one comparison and one prebuilt response. A
freed slot is handed straight to the oldest waiter, so the queue is fair and a
newcomer cannot overtake it.

``limit == 0`` means unlimited: the fast path is then one comparison.
"""

from __future__ import annotations

import asyncio
from collections import deque

from epd_proxy.observe.metrics import Buckets, Collector
from epd_proxy.wire.errors import ProxyError

# The outcomes of :func:`decide`.
ADMIT, QUEUE, SHED = 0, 1, 2


def decide(active: int, waiting: int, limit: int, queue_size: int) -> int:
    """What happens to a request arriving now (pure: the whole policy)."""
    if limit <= 0 or (active < limit and not waiting):
        return ADMIT
    if waiting < queue_size:
        return QUEUE
    return SHED


def shed_error(reason: str) -> ProxyError:
    return ProxyError(429, f"the proxy is at its concurrency limit ({reason}); retry later",
                      type="RateLimitError")


class Admission:
    """Slots for requests in progress, and the queue of requests waiting for one."""

    __slots__ = ("limit", "queue_size", "queue_timeout", "active", "_waiters", "shed", "queued",
                 "timed_out")

    def __init__(self, limit: int = 0, queue_size: int = 0, queue_timeout: float = 0.0) -> None:
        self.limit = limit
        self.queue_size = queue_size
        self.queue_timeout = queue_timeout
        self.active = 0
        self._waiters: deque[asyncio.Future] = deque()
        self.shed = 0  # requests answered 429 (queue full or queue timeout)
        self.queued = 0  # requests that had to wait
        self.timed_out = 0  # of those, shed after queue_timeout

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def try_enter(self) -> int:
        """ADMIT (a slot is taken), QUEUE (call :meth:`wait`) or SHED (counted)."""
        verdict = decide(self.active, len(self._waiters), self.limit, self.queue_size)
        if verdict == ADMIT:
            self.active += 1
        elif verdict == SHED:
            self.shed += 1
        return verdict

    async def wait(self) -> bool:
        """Wait in the queue; True once a slot was handed over, False after the queue timeout
        or when the queue is closed (shutdown)."""
        self.queued += 1
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            if self.queue_timeout > 0:
                async with asyncio.timeout(self.queue_timeout):
                    await fut
            else:
                await fut
            return fut.result()
        except TimeoutError:
            if fut.done() and not fut.cancelled():
                return True  # the slot arrived as the clock ran out: use it
            self.shed += 1
            self.timed_out += 1
            return False
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.leave()  # handed a slot, but the client left: pass it on
            raise
        finally:
            if not fut.done():
                fut.cancel()
            try:
                self._waiters.remove(fut)
            except ValueError:
                pass

    def leave(self) -> None:
        """A request is over: its slot goes to the oldest live waiter, or is freed."""
        waiters = self._waiters
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(True)  # the slot changes hands; ``active`` is unchanged
                return
        self.active -= 1

    def close(self) -> None:
        """Send every waiter away without a slot (the proxy is shutting down)."""
        while self._waiters:
            fut = self._waiters.popleft()
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
        for role, cap in role_caps.items():
            f["epd_proxy_stage_shed_requests"].append([role, cap.shed])
            f["epd_proxy_stage_queue_depth"].append([role, cap.waiting])
    return collect
