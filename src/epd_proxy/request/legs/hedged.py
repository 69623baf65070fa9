"""A prefill, or an encoder sub-request, that has not answered within its hedge delay gets a
second attempt (the shell of ``placement/hedge.py``'s rules): the first answer wins, the other
is aborted. The encoders' part is :class:`EncoderHedging`, at the end; the prefill's first.

The first attempt runs in the request's own task, as an unhedged prefill does. A request that
needs no hedge pays a clock read, a dict entry put and taken, and an answer time written: the
prefills in flight share one loop timer, aimed lazily at the earliest hedge due (as
``http/timers.py`` does for connections), so a request arms no timer of its own. When a hedge
is due and the budget, the per-instance bound and the placement's alternatives allow, the hedge
starts as a task of its own on the next alternative. Whichever answers first wins:

* the first attempt: the hedge is cancelled (its connection closed, so vLLM aborts it);
* the hedge: the request's task is cancelled out of the first attempt's call (its connection
  closed the same way), the cancellation taken back, and the hedge's answer used. The first
  attempt's instance gets an instance signal (``stalled``: it did not answer within the delay
  while another did), so a wedged one (connection open, no bytes) is ejected after
  ``--fail-threshold`` such requests, without waiting for the probe cycle; and the placement
  says where the prefill went instead, and why.

A first attempt that fails while the hedge runs leaves the answer to the hedge. Only the pull
connector hedges its prefill (``NixlPull``): there decode starts from the winner's
``kv_transfer_params``, so nothing of the loser is read. With push and Mooncake, decode is
started at once against one prefill's engine id: a second prefill would need a second decode,
and a hedge never duplicates a decode; those connectors do not hedge.

vLLM frees an aborted request's blocks itself (an abort before the prefill finished releases
them at once; NIXL's delayed free applies only to a finished request whose parameters went
out). A loser that finished in the same moment as the winner (its parameters read but never
sent to a decode) holds its blocks until vLLM's lease ends: counted as stranded on it
(``epd_proxy_kv_stranded_total``).
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import Any, Callable, Coroutine, TypeVar

import msgspec

from epd_proxy.encode.encoder_plan import SubRequest
from epd_proxy.instances.health import STALLED
from epd_proxy.instances.instance import Instance
from epd_proxy.instances.pool import InstancePool
from epd_proxy.placement.decision import Placement
from epd_proxy.placement.hedge import (
    BUDGET_EXHAUSTED,
    FAILED,
    INSTANCE_BOUND,
    LOST,
    NO_ALTERNATIVE,
    RESULTS,
    WON,
    HedgeBudget,
    Latencies,
    hedge_target,
)
from epd_proxy.request.context import RequestContext
from epd_proxy.request.legs.stages import PrefillStage

log = logging.getLogger("epd_proxy.hedging")

ROLE = "prefill"
T = TypeVar("T")


class _Race:
    """One prefill whose hedge delay ran out: the hedge (None: none was sent), and who won."""

    __slots__ = ("ctx", "placement", "delay", "task", "start", "latencies", "hedge", "target", "started",
                 "winner", "settled")

    def __init__(self, ctx: RequestContext, entry: tuple) -> None:
        due, self.placement, _, self.latencies, self.task, self.start = entry
        self.ctx = ctx
        self.delay = due - self.start
        self.hedge: asyncio.Task | None = None
        self.target: Instance | None = None
        self.started = 0.0
        self.winner = False  # the hedge answered first (the request's task is being cancelled for it)
        self.settled = False  # one side's answer was taken: the other's no longer matters


class PrefillHedging:
    """Hedged prefills for one prefill stage: the latencies per model the delay comes from, the
    budget, the prefills in flight and their one timer, the hedges in flight per instance, and
    the counts (``epd_proxy_hedges_total``).

    The pull connector calls :meth:`enter` before its prefill call, then :meth:`leave` after its
    answer, or :meth:`instead` with its failure (which may be the hedge's cancellation)."""

    def __init__(self, stage: PrefillStage, counts: dict[tuple[str, str], int], budget_percent: float,
                 min_delay: float, max_delay: float, per_instance: int) -> None:
        self.stage = stage
        self.pool = stage.pool
        self.budget = HedgeBudget(budget_percent)
        self.min_delay = min_delay
        self.max_delay = max_delay
        self.per_instance = per_instance
        self.latencies: dict[object, Latencies] = {}  # per model the prefill is asked for
        # Per request in its prefill: (due, placement, body, latencies, task, start), a _Race once due.
        self.pending: dict[RequestContext, tuple | _Race] = {}
        self.in_flight: dict[Instance, int] = {}  # hedges per instance
        self.counts = counts
        self._timer: asyncio.TimerHandle | None = None
        for result in RESULTS:
            counts.setdefault((ROLE, result), 0)

    def _count(self, result: str) -> None:
        key = (ROLE, result)
        self.counts[key] = self.counts.get(key, 0) + 1

    # -- the request's side -----------------------------------------------------------------
    def enter(self, ctx: RequestContext, placement: Placement, body: dict) -> None:
        """The first attempt of ``placement``'s prefill, with ``body``, starts now."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        budget = self.budget
        if now - budget.start >= budget.window:  # HedgeBudget.note, inline: every request passes here
            budget.note(now)
        else:
            budget.requests += 1
        model = body.get("model")
        latencies = self.latencies.get(model)
        if latencies is None:
            latencies = self.latencies[model] = Latencies(self.min_delay, self.max_delay)
        due = now + latencies.delay
        self.pending[ctx] = (due, placement, body, latencies, asyncio.current_task(), now)
        timer = self._timer
        if timer is None:
            self._timer = loop.call_at(due, self._sweep)
        elif timer.when() > due:
            timer.cancel()
            self._timer = loop.call_at(due, self._sweep)

    def leave(self, ctx: RequestContext) -> None:
        """The first attempt answered: its time noted, a hedge still running aborted."""
        entry = self.pending.pop(ctx)
        if type(entry) is tuple:
            entry[3].add(asyncio.get_running_loop().time() - entry[5])
            return
        assert isinstance(entry, _Race)
        entry.settled = True
        entry.latencies.add(asyncio.get_running_loop().time() - entry.start)
        hedge = entry.hedge
        if hedge is None:
            return
        if entry.winner:  # the first attempt's answer came with the hedge's cancellation, and was kept
            entry.task.uncancel()
        if not hedge.done():
            hedge.cancel()  # its connection closes: vLLM aborts it
            self._count(LOST)
        elif hedge.cancelled() or hedge.exception() is not None:
            self._count(FAILED)
        else:  # both answered in the same moment: the hedge's blocks are held for no decode
            self._count(LOST)
            if entry.target is not None:
                entry.target.stranded += 1
        ctx.timing("hedge", asyncio.get_running_loop().time() - entry.started)

    async def instead(self, ctx: RequestContext, failure: BaseException) -> tuple[msgspec.Raw | None, Instance]:
        """The first attempt ended with ``failure``: the hedge's answer in its place (its
        ``kv_transfer_params`` and instance), or ``failure`` raised again."""
        race = self.pending.pop(ctx, None)
        if not isinstance(race, _Race) or race.hedge is None:
            raise failure
        hedge = race.hedge
        if isinstance(failure, asyncio.CancelledError):
            if race.winner:
                race.task.uncancel()
                if not race.task.cancelling():  # not cancelled for another reason too (client, deadline)
                    return self._won(race, f"{race.placement.prefill.url if race.placement.prefill else '-'} "
                                           f"had not answered in {race.delay * 1000:.0f} ms", blame=True)
                if race.target is not None:  # the request ends: the hedge's blocks go to no decode
                    race.target.stranded += 1
            elif not hedge.done():
                hedge.cancel()
            raise failure
        if hedge.done() and (hedge.cancelled() or hedge.exception() is not None):
            self._count(FAILED)
            raise failure
        race.settled = True  # the first attempt failed: the hedge's answer is the attempt's
        try:
            await hedge
        except BaseException:
            self._count(FAILED)
            raise
        return self._won(race, "the first prefill failed", blame=False)

    # -- the timer and the hedge ------------------------------------------------------------
    def _sweep(self) -> None:
        """The shared timer: every prefill whose hedge is due gets one (if allowed); aimed again
        at the next due."""
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        nearest = None
        pending = self.pending
        for ctx, entry in list(pending.items()):
            if type(entry) is not tuple:
                continue
            due = entry[0]
            if due <= now:
                pending[ctx] = race = _Race(ctx, entry)
                self._fire(race, entry[2], now)
            elif nearest is None or due < nearest:
                nearest = due
        if nearest is not None:
            self._timer = loop.call_at(nearest, self._sweep)

    def _fire(self, race: _Race, body: dict, now: float) -> None:
        """A hedge for ``race``, if the budget, the bound and the placement allow."""
        if not self.budget.allows(now):
            self._count(BUDGET_EXHAUSTED)
            return
        ctx = race.ctx
        failed = ctx.excluded | ctx.timed_out
        target, bounded = hedge_target(race.placement.alternatives(ROLE), failed, self.in_flight, self.per_instance)
        if target is None:
            self._count(INSTANCE_BOUND if bounded else NO_ALTERNATIVE)
            return
        self.budget.spend()
        self.in_flight[target] = self.in_flight.get(target, 0) + 1
        race.target, race.started = target, now
        first = race.placement.prefill
        log.info("request %s: prefill %s has not answered in %.0f ms; hedging on %s", ctx.request_id,
                 first.url if first is not None else "-", race.delay * 1000, target.url)
        race.hedge = hedge = asyncio.get_running_loop().create_task(self._hedge(race, target, body))
        hedge.add_done_callback(partial(self._hedge_done, race))

    async def _hedge(self, race: _Race, target: Instance, body: dict) -> tuple[msgspec.Raw | None, object]:
        try:
            kv = await self.stage.run(race.ctx, target, body)
            return kv, race.ctx.prefill_report  # set by this run, in the same step
        finally:
            n = self.in_flight.get(target, 1) - 1
            if n > 0:
                self.in_flight[target] = n
            else:
                self.in_flight.pop(target, None)

    @staticmethod
    def _hedge_done(race: _Race, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is not None:  # retrieved; the first attempt goes on
            return
        if race.settled:
            return
        race.settled = race.winner = True
        race.task.cancel()  # out of the first attempt's call: its connection closes

    def _won(self, race: _Race, why: str, blame: bool) -> tuple[msgspec.Raw | None, Instance]:
        """The hedge's answer taken: the placement says where the prefill went and why; with
        ``blame``, the first attempt's instance is told it stalled."""
        hedge = race.hedge
        target = race.target
        assert hedge is not None and target is not None
        ctx = race.ctx
        kv, ctx.prefill_report = hedge.result()
        self._count(WON)
        placed = race.placement
        first = placed.prefill
        if blame and first is not None:
            ctx.timed_out_on(first)
            self.pool.outliers.record_failure(first, f"no answer within the hedge delay ({race.delay * 1000:.0f} ms) "
                                                     f"while {target.url} answered", STALLED, ctx)
        placed.prefill, placed.prefill_why, placed.hedged = target, f"hedge: {why}", first
        ctx.timing("hedge", asyncio.get_running_loop().time() - race.started)
        return kv, target


ENCODE = "encode"


def hedge_failure(failure: BaseException) -> tuple[Instance, BaseException] | None:
    """The hedge's own failure, when a hedged encoder sub-request failed on both encoders: the
    encode stage counts it too (two encoders failing the same items alike: the items' fault)."""
    return getattr(failure, "_hedge_failure", None)


def size_class(items: int) -> int:
    """An encoder sub-request's size class for its latencies: 1, 2, 3-4, 5-8, 9-16, more."""
    return min(items, 32).bit_length()


class EncoderHedging:
    """Hedged encoder sub-requests: one that has not answered within its hedge delay (the p95
    of the role's recent sub-requests of its size class) is sent, with the same items and
    fresh transfer ids, to the encoder the media placement (``placement/media.py``) gives
    them without the first one; the first answer's embeddings are the items', the other call
    is cancelled (vLLM aborts it). Only with an encoder cache read from shared storage: with a
    push EC connector the encoders push into the consumer, and two pushes of one item are not
    sound. A sub-request already runs in a task of its own or not, so the encode stage pays
    one more task and a timer only when hedging applies (two encoders or more)."""

    def __init__(self, pool: InstancePool, counts: dict[tuple[str, str], int], budget_percent: float,
                 min_delay: float, max_delay: float, per_instance: int) -> None:
        self.pool = pool
        self.budget = HedgeBudget(budget_percent)
        self.min_delay = min_delay
        self.max_delay = max_delay
        self.per_instance = per_instance
        self.latencies: dict[int, Latencies] = {}  # per size class
        self.in_flight: dict[Instance, int] = {}
        self.counts = counts
        for result in RESULTS:
            counts.setdefault((ENCODE, result), 0)

    def _count(self, result: str) -> None:
        key = (ENCODE, result)
        self.counts[key] = self.counts.get(key, 0) + 1

    async def run(self, ctx: RequestContext, sub: SubRequest, attempt: Callable[[SubRequest], Coroutine[Any, Any, T]],
                  target: Callable[[SubRequest], Instance | None]) -> T:
        """``attempt(sub)``'s answer, hedged: ``target(sub)`` is where a hedge would go (None:
        nowhere now)."""
        loop = asyncio.get_running_loop()
        latencies = self.latencies.get(size := size_class(len(sub.items)))
        if latencies is None:
            latencies = self.latencies[size] = Latencies(self.min_delay, self.max_delay)
        start = loop.time()
        self.budget.note(start)
        first: asyncio.Task[T] = loop.create_task(attempt(sub))
        hedge: asyncio.Task[T] | None = None
        other: Instance | None = None
        try:
            await asyncio.wait((first,), timeout=latencies.delay)
            if first.done():
                result = first.result()
                latencies.add(loop.time() - start)
                return result
            now = loop.time()
            if not self.budget.allows(now):
                self._count(BUDGET_EXHAUSTED)
            else:
                other = target(sub)
                if other is None:
                    self._count(NO_ALTERNATIVE)
                elif self.per_instance and self.in_flight.get(other, 0) >= self.per_instance:
                    self._count(INSTANCE_BOUND)
                    other = None
            if other is None:
                result = await first
                latencies.add(loop.time() - start)
                return result
            self.budget.spend()
            self.in_flight[other] = self.in_flight.get(other, 0) + 1
            log.info("request %s: encoder %s has not answered %d item(s) in %.0f ms; hedging on %s",
                     ctx.request_id, sub.encoder.url, len(sub.items), latencies.delay * 1000, other.url)
            hedge = loop.create_task(attempt(SubRequest(other, sub.items)))
            racing = {first, hedge}
            while racing:
                done, racing = await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
                for task in (first, hedge):
                    if task in done and task.exception() is None:
                        ctx.timing("hedge_encode", loop.time() - now)
                        if task is first:
                            latencies.add(loop.time() - start)
                            self._count(LOST if not hedge.done() or hedge.exception() is None else FAILED)
                            return task.result()
                        self._count(WON)
                        if not first.done():  # slower than the hedge on the same items: the encoder stalled
                            ctx.timed_out_on(sub.encoder)
                            self.pool.outliers.record_failure(sub.encoder, f"no answer within the hedge delay "
                                                              f"({latencies.delay * 1000:.0f} ms) while {other.url} "
                                                              f"answered the same items", STALLED, ctx)
                        return task.result()
            self._count(FAILED)
            failure = first.exception()
            if failure is not None and not hedge.cancelled():  # both failed: the first one's failure,
                failure._hedge_failure = (other, hedge.exception())  # type: ignore[attr-defined]  # the hedge's with it
            return first.result()
        finally:
            legs = [first] if hedge is None else [first, hedge]
            waiting = [t for t in legs if not t.done()]
            for leg in waiting:
                leg.cancel()  # its connection closes: vLLM aborts it
            if waiting:
                await asyncio.wait(waiting)
            for leg in legs:  # retrieved: the answer or the failure that matters was taken above
                if not leg.cancelled():
                    leg.exception()
            if other is not None:
                n = self.in_flight.get(other, 1) - 1
                if n > 0:
                    self.in_flight[other] = n
                else:
                    self.in_flight.pop(other, None)
