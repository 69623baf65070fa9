"""The shell of ``kv_budget.py``: keeps what this proxy's kept turns pin on each decode within
its budget, from the decode's load signals (``vllm:cache_config_info``,
``vllm:kv_cache_usage_perc``, the queue gauges, read by the load scraper).

It decides at two moments: when a decode's answer offers a turn for keeping (``admit``: kept,
or let go at once when keeping there has stopped; the oldest let go when past the budget),
and every scrape interval for every decode (``check``: under pressure the oldest kept turns
are let go even when no answer comes, as on a decode that stands still). What is let go is
freed on decode through the early-release path (``TurnReuse.release``), at most as many at
once as that path takes."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Callable

from epd_proxy.instances.load_signals import wedged
from epd_proxy.request.turns.kv_budget import STOP, DecodeKV, KeptRate, Verdict, decide

if TYPE_CHECKING:  # pragma: no cover
    from epd_proxy.instances.instance import Instance
    from epd_proxy.instances.pool import InstancePool
    from epd_proxy.request.turns.multiturn import Entry, TurnStore
    from epd_proxy.request.turns.shared_turns import SharedTurns

log = logging.getLogger("epd_proxy.pipeline")


class KvGuard:
    """Per decode: the traffic offered for keeping, the last verdict, the turns let go."""

    def __init__(self, turns: TurnStore, shared: SharedTurns | None, decode: InstancePool, interval: float,
                 release: Callable[[Entry], None], room: Callable[[], int]) -> None:
        self.turns = turns
        self.shared = shared
        self.decode = decode
        self.interval = interval
        self.release = release
        self.room = room  # how many more releases the early-release path takes now
        self.rates: dict[str, KeptRate] = {}
        self.verdicts: dict[str, Verdict] = {}
        self.shared_held: dict[str, int] = {}  # every replica's held tokens per decode (shared store)
        self.let_go: dict[tuple[str, str], int] = {}  # (url, reason) -> turns let go
        self._task: asyncio.Task | None = None

    def view(self, inst: Instance, now: float) -> DecodeKV:
        s = inst.signals
        url = inst.url
        capacity = s.kv_blocks * s.block_size if s.kv_blocks and s.block_size and s.scraped_at is not None \
            else None
        held = max(self.turns.held.get(url, 0), self.shared_held.get(url, 0))
        rate = self.rates[url].rate(now) if url in self.rates else 0.0
        last = self.verdicts.get(url)
        return DecodeKV(capacity, s.kv_usage, s.waiting, s.running, held, self.turns.life, rate,
                        last is not None and last.action == STOP, wedged(s, s.scraped_at or 0.0) is not None)

    def admit(self, inst: Instance, tokens: int) -> bool:
        """A turn of ``tokens`` offered for keeping on ``inst``: whether to keep it (else it is
        let go at once, counted ``pressure``); past the budget, the oldest go."""
        now = time.monotonic()
        rate = self.rates.get(inst.url)
        if rate is None:
            rate = self.rates[inst.url] = KeptRate()
        rate.add(tokens, now)
        verdict = self._verdict(inst, now)
        if verdict.action == STOP:
            self._count(inst.url, verdict.reason)
            return False
        return True

    def check(self, inst: Instance) -> Verdict:
        """The decode's verdict now, carried out (what it lets go is released)."""
        return self._verdict(inst, time.monotonic())

    def _verdict(self, inst: Instance, now: float) -> Verdict:
        verdict = decide(self.view(inst, now))
        last = self.verdicts.get(inst.url)
        self.verdicts[inst.url] = verdict
        if (last is None or last.action != verdict.action) and (verdict.action == STOP or verdict.tokens > 0):
            log.info("decode %s: kept turns %s (%s; budget %s tokens)", inst.url,
                     "no longer kept" if verdict.action == STOP else "let go, oldest first", verdict.reason,
                     verdict.budget)
        if verdict.tokens > 0 and self.shared is None:
            for entry in self.turns.trim(inst.url, verdict.tokens, verdict.reason, self.room()):
                self._count(inst.url, verdict.reason)
                self.release(entry)
        return verdict

    def _count(self, url: str, reason: str) -> None:
        self.let_go[(url, reason)] = self.let_go.get((url, reason), 0) + 1

    async def _trim_shared(self, shared: SharedTurns, inst: Instance, verdict: Verdict) -> None:
        for entry in await shared.trim(inst.url, verdict.tokens, verdict.reason, self.room(), time.monotonic()):
            self._count(inst.url, verdict.reason)
            self.release(entry)

    def start(self) -> None:
        if self.interval > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.round()
            except Exception:  # never let the loop die
                log.exception("kept KV check failed")

    async def round(self) -> None:
        """Every decode's verdict, carried out (the shared store's held tokens read first)."""
        shared = self.shared
        if not self.turns.active:
            return  # no decode keeps blocks (bidirectional transfer off): nothing to bound
        for inst in list(self.decode.instances):
            if shared is not None:
                self.shared_held[inst.url] = await shared.held(inst.url)
            verdict = self.check(inst)
            if shared is not None and verdict.tokens > 0:
                await self._trim_shared(shared, inst, verdict)

    def status(self, url: str) -> dict | None:
        """``/status``: the decode's KV budget and verdict (None before any)."""
        verdict = self.verdicts.get(url)
        if verdict is None:
            return None
        return {"budget_tokens": verdict.budget, "verdict": verdict.action, "reason": verdict.reason or None,
                "let_go": {r: n for (u, r), n in self.let_go.items() if u == url}}

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
