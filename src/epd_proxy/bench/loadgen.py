"""The load generator: closed loop (C workers) or open loop (Poisson arrivals).

A phase sends its requests through the client its caller gives it (one URL, or a
client-side E→P→D: :meth:`epd_proxy.bench.targets.Target.make_client`), on the
running loop (uvloop under ``epd-proxy bench``); how one request is sent and
read is :mod:`epd_proxy.bench.exchange`.

Measurement window: a phase runs ``warmup`` seconds unmeasured, then measures
until ``max_requests`` requests completed or ``duration`` seconds passed,
then stops issuing and lets the requests in flight finish (they are verified
but not counted). Throughput is completions inside the window divided by its
length: steady state, no ramp-up or drain tail. In a closed loop the workers'
first requests are spread over the warm-up (``ramp``): started together, C
requests to a deterministic simulator finish together, every cycle, and the
window would count whole bursts.
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from array import array
from collections import Counter
from typing import Callable, Sequence

from epd_proxy.bench.exchange import Outcome
from epd_proxy.bench.procs import self_cpu_seconds
from epd_proxy.bench.workloads import Prepared
from epd_proxy.http.transport import TransportTimeouts

perf = time.perf_counter


# -- phases -----------------------------------------------------------------------------------
class PhaseStats:
    """Everything measured inside one window, kept compact (arrays of floats)."""

    def __init__(self) -> None:
        self.ok = 0
        self.errors: Counter = Counter()
        self.verify_errors = 0
        self.examples: list[str] = []
        self.ttft = array("d")
        self.e2e = array("d")
        self.itl = array("d")
        self.tokens = 0
        self.nbytes = 0
        self.by_kind: dict[str, array] = {}
        self.outside_ok = 0  # completed outside the window (warm-up, drain)
        self.outside_errors = 0
        self.outside_verify_errors = 0

    @property
    def completed(self) -> int:
        return self.ok + sum(self.errors.values())

    def add(self, o: Outcome, in_window: bool) -> None:
        if not in_window:
            if o.ok:
                self.outside_ok += 1
            else:
                self.outside_errors += 1
                if o.verify_error:
                    self.outside_verify_errors += 1
                    self._example(o)
            return
        if o.ok:
            self.ok += 1
            if o.ttft is not None:
                self.ttft.append(o.ttft)
            self.e2e.append(o.e2e)
            self.by_kind.setdefault(o.kind, array("d")).append(o.e2e)
            if o.itl:
                self.itl.extend(o.itl)
            self.tokens += o.tokens
            self.nbytes += o.nbytes
        else:
            key = o.error.split(":", 1)[0] if o.error else "error"
            self.errors[key] += 1
            if o.verify_error:
                self.verify_errors += 1
            self._example(o)

    def _example(self, o: Outcome) -> None:
        if len(self.examples) < 5:
            self.examples.append(o.error or "?")


class Progress:
    """A one-line progress bar on stderr (plain lines when stderr is not a terminal)."""

    def __init__(self, label: str, total: int | None = None, duration: float | None = None,
                 enabled: bool = True, stream=None) -> None:
        self.label = label
        self.total = total
        self.duration = duration
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()
        self.done = 0
        self.errors = 0
        self.t0 = perf()
        self.t_window: float | None = None
        self.n_window0 = 0
        self.phase = "warm-up"
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.tty:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        try:
            while True:
                self.render()
                await asyncio.sleep(0.25)
        except asyncio.CancelledError:
            pass

    def render(self, final: bool = False) -> None:
        if not self.enabled:
            return
        now = perf()
        width = 24
        if self.t_window is not None:
            n = self.done - self.n_window0
            el = now - self.t_window
            frac_n = n / self.total if self.total else 0.0
            frac_t = el / self.duration if self.duration else 0.0
            frac = min(1.0, max(frac_n, frac_t))
            rate = n / el if el > 0 else 0.0
        else:
            frac = 0.0
            n = 0
            rate = 0.0
        filled = int(frac * width)
        bar = "#" * filled + "-" * (width - filled)
        text = (f"{self.label[:34]:34s} [{bar}] {self.phase:8s} {n:6d} req {rate:8.1f} req/s "
                f"err {self.errors}")
        if self.tty:
            self.stream.write("\r" + text + ("\n" if final else ""))
            self.stream.flush()
        elif final:
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.phase = "done"
        self.render(final=True)


class Phase:
    """One measured run of the load generator against one URL."""

    def __init__(self, url: str, requests: Sequence[Prepared], *, concurrency: int = 1, rate: float | None = None,
                 warmup: float = 0.0, duration: float | None = None, max_requests: int | None = None,
                 seed: int = 0, verify: bool = True, timeout: float = 600.0, drain_timeout: float = 60.0,
                 label: str = "", progress: bool = True,
                 on_window_start: Callable[[], None] | None = None,
                 on_window_end: Callable[[], None] | None = None,
                 start_offset: int = 0, max_outstanding: int | None = None, client,
                 ramp: float | None = None) -> None:
        if not requests:
            raise ValueError("no requests to send")
        if duration is None and max_requests is None:
            raise ValueError("a phase needs a duration or a request count")
        self.url = url
        self.requests = list(requests)
        self.concurrency = max(1, concurrency)
        self.rate = rate
        self.warmup = max(0.0, warmup)
        # Closed loop: the workers' first requests are spread over the warm-up, not sent
        # together. A simulated engine is deterministic, so C requests started at once
        # finish at once, forever: the backends and the proxy then see bursts of C
        # requests per cycle, and a window counts whole bursts (req/s moves in steps of
        # C / window). Real clients do not march in step.
        self.ramp = self.warmup if ramp is None else max(0.0, ramp)
        self.duration = duration
        self.max_requests = max_requests
        self.seed = seed
        self.verify = verify
        self.timeouts = TransportTimeouts(connect=10.0, headers=timeout, idle=timeout)
        self.drain_timeout = drain_timeout
        self.stats = PhaseStats()
        self.progress = Progress(label or url, max_requests, duration, enabled=progress)
        self.on_window_start = on_window_start
        self.on_window_end = on_window_end
        self.max_outstanding = max_outstanding or max(10_000, self.concurrency)
        self._next = start_offset
        self._state = "warmup"
        self._stop = asyncio.Event()  # a fresh one for each run
        self._window_timer: asyncio.TimerHandle | None = None
        self.t_window_start = math.nan
        self.t_window_end = math.nan
        self.cpu_self = 0.0
        self.issued = 0
        self.client = client  # how a request is sent: ``start()``, ``send(prep, timeouts, verify)``, ``close()``

    # -- window ---------------------------------------------------------------------------
    def _begin_window(self) -> None:
        if self._state != "warmup":
            return
        if self.on_window_start is not None:
            self.on_window_start()
        self._cpu0 = self_cpu_seconds()
        self.t_window_start = perf()
        self._state = "measure"
        self.progress.phase = "measure"
        self.progress.t_window = self.t_window_start
        self.progress.n_window0 = self.progress.done
        if self.duration is not None:
            self._window_timer = asyncio.get_running_loop().call_later(self.duration, self._end_window)

    def _end_window(self) -> None:
        if self._state != "measure":
            return
        self.t_window_end = perf()
        self.cpu_self = self_cpu_seconds() - self._cpu0
        if self.on_window_end is not None:
            self.on_window_end()
        self._state = "drain"
        self.progress.phase = "drain"
        if self._window_timer is not None:
            self._window_timer.cancel()
        self._stop.set()

    @property
    def window(self) -> float:
        return self.t_window_end - self.t_window_start

    def _record(self, o: Outcome) -> None:
        in_window = self._state == "measure" and o.t_end >= self.t_window_start
        self.stats.add(o, in_window)
        self.progress.done += 1
        if not o.ok:
            self.progress.errors += 1
        if in_window and self.max_requests is not None and self.stats.completed >= self.max_requests:
            self._end_window()

    def _take(self) -> Prepared:
        prep = self.requests[self._next % len(self.requests)]
        self._next += 1
        self.issued += 1
        return prep

    # -- drivers --------------------------------------------------------------------------
    async def _stopped_within(self, delay: float) -> bool:
        """Wait ``delay`` seconds; True if the phase was stopped meanwhile."""
        if delay <= 0:
            return self._stop.is_set()
        try:
            await asyncio.wait_for(self._stop.wait(), delay)
            return True
        except asyncio.TimeoutError:
            return False

    async def _worker(self, delay: float = 0.0) -> None:
        client = self.client
        if await self._stopped_within(delay):
            return
        while not self._stop.is_set():
            o = await client.send(self._take(), self.timeouts, self.verify)
            self._record(o)

    async def _one(self, prep: Prepared) -> None:
        o = await self.client.send(prep, self.timeouts, self.verify)
        self._record(o)

    async def _open_loop(self) -> None:
        rng = random.Random(self.seed)
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task] = set()
        t_next = perf()
        assert self.rate is not None  # the open loop runs with a rate
        while not self._stop.is_set():
            t_next += rng.expovariate(self.rate)
            if await self._stopped_within(t_next - perf()):
                break
            if len(tasks) >= self.max_outstanding:
                self.stats.errors["dropped (too many outstanding)"] += 1
                continue
            task = loop.create_task(self._one(self._take()))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks, timeout=self.drain_timeout)
            for t in tasks:
                t.cancel()

    async def run(self) -> "Phase":
        self._stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        await self.client.start()
        self.progress.start()
        try:
            if self.warmup > 0:
                loop.call_later(self.warmup, self._begin_window)
            else:
                self._begin_window()
            if self.rate:
                await self._open_loop()
            else:
                rng = random.Random(self.seed)
                workers = [loop.create_task(self._worker(rng.random() * self.ramp if i else 0.0))
                           for i in range(self.concurrency)]
                await self._stop.wait()
                done, pending = await asyncio.wait(workers, timeout=self.drain_timeout)
                for t in pending:
                    t.cancel()
                if pending:
                    await asyncio.wait(pending, timeout=5)
                for t in done:
                    failure = None if t.cancelled() else t.exception()
                    if failure is not None:
                        raise failure
        finally:
            self.progress.close()
            await self.client.close()
        return self

    # -- results ----------------------------------------------------------------------------
    def summary(self) -> dict:
        from epd_proxy.bench.stats import summarize

        s = self.stats
        window = self.window
        n = s.completed
        out = {
            "url": self.url,
            "concurrency": None if self.rate else self.concurrency,
            "rate": self.rate,
            "window_s": window,
            "requests": n,
            "ok": s.ok,
            "errors": sum(s.errors.values()),
            "error_kinds": dict(s.errors),
            "verify_errors": s.verify_errors,
            "outside_window": {"ok": s.outside_ok, "errors": s.outside_errors,
                               "verify_errors": s.outside_verify_errors},
            "error_examples": list(s.examples),
            "req_s": s.ok / window if window > 0 else math.nan,
            "tokens_s": s.tokens / window if window > 0 else math.nan,
            "ttft_ms": summarize(s.ttft, 1000.0),
            "itl_ms": summarize(s.itl, 1000.0),
            "e2e_ms": summarize(s.e2e, 1000.0),
            "e2e_ms_by_kind": {k: summarize(v, 1000.0) for k, v in s.by_kind.items()},
            "ttft_cdf": _cdf_ms(s.ttft),
            "e2e_cdf": _cdf_ms(s.e2e),
            "loadgen_cpu_s": self.cpu_self,
            "loadgen_cpu_ms_per_req": 1000.0 * self.cpu_self / n if n else math.nan,
        }
        return out


def _cdf_ms(values) -> list | None:
    from epd_proxy.bench.stats import cdf_points

    xs, ys = cdf_points(values, 200)
    if not xs:
        return None
    return [[round(x * 1000.0, 4) for x in xs], [round(y, 5) for y in ys]]
