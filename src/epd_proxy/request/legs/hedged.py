"""A prefill that has not answered within its hedge delay gets a second attempt (the shell of
``placement/hedge.py``'s rules): the first answer wins, the other is aborted.

The first attempt runs in the request's own task, as an unhedged prefill does, under one timer
(the only cost of a request that needs no hedge). When the timer fires and the budget, the
per-instance bound and the placement's alternatives allow, the hedge starts as a task of its
own on the next alternative. Whichever answers first wins:

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

import msgspec

from epd_proxy.instances.health import STALLED
from epd_proxy.instances.instance import Instance
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


class _Race:
    """One hedged prefill's state, shared by the request's task, the timer and the hedge."""

    __slots__ = ("ctx", "placement", "body", "delay", "task", "hedge", "target", "started", "winner", "settled")

    def __init__(self, ctx: RequestContext, placement: Placement, body: dict, delay: float,
                 task: asyncio.Task) -> None:
        self.ctx = ctx
        self.placement = placement
        self.body = body
        self.delay = delay
        self.task = task  # the request's, running the first attempt
        self.hedge: asyncio.Task | None = None
        self.target: Instance | None = None
        self.started = 0.0
        self.winner = False  # the hedge answered first (the request's task is being cancelled for it)
        self.settled = False  # one side's answer was taken: the other's no longer matters


class PrefillHedging:
    """Hedged prefills for one prefill stage: the latencies per model the delay comes from, the
    budget, the hedges in flight per instance, and the counts (``epd_proxy_hedges_total``)."""

    def __init__(self, stage: PrefillStage, counts: dict[tuple[str, str], int], *, budget_percent: float,
                 min_delay: float, max_delay: float, per_instance: int) -> None:
        self.stage = stage
        self.pool = stage.pool
        self.budget = HedgeBudget(budget_percent)
        self.min_delay = min_delay
        self.max_delay = max_delay
        self.per_instance = per_instance
        self.latencies: dict[object, Latencies] = {}  # per model the prefill is asked for
        self.in_flight: dict[Instance, int] = {}  # hedges per instance
        self.counts = counts
        for result in RESULTS:
            counts.setdefault((ROLE, result), 0)

    def _count(self, result: str) -> None:
        key = (ROLE, result)
        self.counts[key] = self.counts.get(key, 0) + 1

    async def run(self, ctx: RequestContext, placement: Placement, body: dict) -> tuple[msgspec.Raw | None, Instance]:
        """The prefill of ``placement`` with ``body``, hedged: its ``kv_transfer_params`` and the
        instance that answered (the placement's prefill, or the hedge's)."""
        loop = asyncio.get_running_loop()
        model = body.get("model")
        latencies = self.latencies.get(model)
        if latencies is None:
            latencies = self.latencies[model] = Latencies(self.min_delay, self.max_delay)
        start = loop.time()
        self.budget.note(start)
        first = placement.prefill
        assert first is not None
        race = _Race(ctx, placement, body, latencies.delay, asyncio.current_task())  # type: ignore[arg-type]
        timer = loop.call_later(race.delay, self._fire, race)
        try:
            kv = await self.stage.run(ctx, first, body)
        except asyncio.CancelledError:
            if not race.winner:
                raise
            race.task.uncancel()
            if race.task.cancelling():  # cancelled for another reason too (the client, the deadline)
                raise
            return self._won(race, first)
        except BaseException:
            hedge = race.hedge
            if hedge is None or (hedge.done() and (hedge.cancelled() or hedge.exception() is not None)):
                raise
            race.settled = True  # the first attempt failed: the hedge's answer is the attempt's
            report = ctx.prefill_report
            try:
                kv, ctx.prefill_report = await hedge
            except BaseException:
                ctx.prefill_report = report
                self._count(FAILED)
                raise
            self._count(WON)
            self._moved(race, first, "the first prefill failed")
            return kv, race.target  # type: ignore[return-value]  # set with the hedge
        finally:
            timer.cancel()
            hedge = race.hedge
            if hedge is not None and not hedge.done() and not race.winner:
                hedge.cancel()  # its connection closes: vLLM aborts it
        race.settled = True
        latencies.add(loop.time() - start)
        hedge = race.hedge
        if hedge is not None:
            self._lost(race, hedge)
        return kv, first

    # -- the hedge (timer and task callbacks) -----------------------------------------------
    def _fire(self, race: _Race) -> None:
        """The hedge delay ran out: a hedge, if the budget, the bound and the placement allow."""
        if race.settled:
            return
        ctx = race.ctx
        loop = asyncio.get_running_loop()
        now = loop.time()
        if not self.budget.allows(now):
            self._count(BUDGET_EXHAUSTED)
            return
        failed = ctx.excluded | ctx.timed_out
        target, bounded = hedge_target(race.placement.alternatives(ROLE), failed, self.in_flight, self.per_instance)
        if target is None:
            self._count(INSTANCE_BOUND if bounded else NO_ALTERNATIVE)
            return
        self.budget.spend()
        self.in_flight[target] = self.in_flight.get(target, 0) + 1
        race.target, race.started = target, now
        log.info("request %s: prefill %s has not answered in %.0f ms; hedging on %s", ctx.request_id,
                 race.placement.prefill.url if race.placement.prefill is not None else "-", race.delay * 1000,
                 target.url)
        race.hedge = hedge = loop.create_task(self._hedge(race, target))
        hedge.add_done_callback(lambda task: self._hedge_done(race, task))

    async def _hedge(self, race: _Race, target: Instance) -> tuple[msgspec.Raw | None, object]:
        try:
            kv = await self.stage.run(race.ctx, target, race.body)
            return kv, race.ctx.prefill_report  # set by this run, in the same step
        finally:
            n = self.in_flight.get(target, 1) - 1
            if n > 0:
                self.in_flight[target] = n
            else:
                self.in_flight.pop(target, None)

    def _hedge_done(self, race: _Race, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is not None:  # retrieved; the first attempt goes on
            return
        if race.settled:
            return
        race.settled = race.winner = True
        race.task.cancel()  # out of the first attempt's call: its connection closes

    # -- how it ended ---------------------------------------------------------------------
    def _won(self, race: _Race, first: Instance) -> tuple[msgspec.Raw | None, Instance]:
        """The hedge answered first: its answer, the first attempt's instance told it stalled."""
        hedge = race.hedge
        assert hedge is not None and race.target is not None
        kv, race.ctx.prefill_report = hedge.result()
        self._count(WON)
        ctx = race.ctx
        ctx.timed_out_on(first)
        self.pool.record_failure(first, f"no answer within the hedge delay ({race.delay * 1000:.0f} ms) while "
                                        f"{race.target.url} answered", STALLED, ctx)
        self._moved(race, first, f"{first.url} had not answered in {race.delay * 1000:.0f} ms")
        return kv, race.target

    def _lost(self, race: _Race, hedge: asyncio.Task) -> None:
        """The first attempt answered while a hedge ran: the hedge aborted (cancelled in the
        ``finally`` above), or, if it had answered too, its KV left to vLLM's lease."""
        if hedge.cancelled() or not hedge.done():
            self._count(LOST)
        elif hedge.exception() is not None:
            self._count(FAILED)
        else:  # both answered in the same moment: the hedge's blocks are held for no decode
            self._count(LOST)
            if race.target is not None:
                race.target.stranded += 1
        race.ctx.timing("hedge", asyncio.get_running_loop().time() - race.started)

    @staticmethod
    def _moved(race: _Race, first: Instance, why: str) -> None:
        placed = race.placement
        placed.prefill, placed.prefill_why = race.target, f"hedge: {why}"
        placed.hedged = first
        race.ctx.timing("hedge", asyncio.get_running_loop().time() - race.started)
