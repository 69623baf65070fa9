"""How much of a decode's KV cache the proxy's kept turns may pin (pure; ``kv_guard.py`` is the
shell that carries the verdicts out).

With vLLM 0.32's bidirectional transfer a decode pins *every* finished request's blocks for
``decoder_kv_blocks_ttl`` (480 s by default): the turns this proxy keeps for a next turn, but
also streams' answers (their parameters never reach the proxy), other replicas' turns and
answers nobody continues. A cache full of them admits nothing: requests wait, none run, and
``/health`` stays 200. The proxy can free only what it kept (``TurnReuse.release``), so it keeps
that well below the decode's capacity, counting what it cannot free by estimate from the usage
gauge:

* ``budget`` = the smaller of ``SHARE`` of the capacity and what is left below ``TARGET`` once
  the blocks the proxy cannot free (``usage × capacity − held``) are counted;
* under pressure (usage at or above ``HIGH``, or requests waiting while usage is past
  ``TARGET``, or a queue that stood still: waiting, none running, past the wedge hold) the
  oldest kept turns go first, down to what brings usage back to ``TARGET`` (all of them when
  nothing runs);
* past the budget, the oldest go down to it;
* under pressure, when the turns offered for keeping there (tokens per second) times their
  life could not fit the budget either, the proxy stops keeping there: a new turn's blocks are
  let go at once too, until the pressure ends or the traffic fits (below ``RESUME`` of the
  budget). Past the budget without pressure the oldest go instead: a new turn is likelier to
  be continued than an old one.

Capacity unknown (``vllm:cache_config_info`` not exported): only ``--kv-reuse-max-held-tokens``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

# Of a decode's KV capacity, what the proxy's kept turns may hold at most.
SHARE = 0.5
# The usage the proxy steers a decode back to (counting what it cannot release).
TARGET = 0.75
# The usage at which it releases its oldest turns whether or not requests wait.
HIGH = 0.9
# Having stopped keeping, it keeps again once the offered traffic needs less than this share of
# the budget over a turn's life (a hysteresis: no flapping at the edge).
RESUME = 0.8

KEEP = "keep"
RELEASE = "release"  # the oldest kept turns, ``tokens`` worth
STOP = "stop"  # keep nothing new there; the kept turns down to the budget too

# Reasons (``epd_proxy_kv_reuse_pressure_total{reason}``, ``/status``).
PRESSURE = "pressure"  # usage high, or requests waiting (a new turn let go too: STOP)
SHARE_REASON = "share"  # past the budget
# An answer's result when its turn is not kept for this (``epd_proxy_kv_reuse_answers_total``).
NOT_KEPT = "kv_budget"


@dataclass(frozen=True, slots=True)
class DecodeKV:
    """What is known of one decode, as plain data."""

    capacity: int | None  # tokens: num_gpu_blocks × block_size (None: not exported)
    usage: float  # vllm:kv_cache_usage_perc, 0..1
    waiting: float  # vllm:num_requests_waiting
    running: float  # vllm:num_requests_running
    held: int  # tokens the proxy's kept turns hold there (every process it can count)
    life: float  # seconds a kept turn lives (decode's TTL less the margin)
    rate: float  # tokens per second offered for keeping there
    stopped: bool = False  # the last verdict for it was STOP
    # Its queue has stood still past the hold (load_signals.wedged): requests waiting, none
    # running. A single scrape with none running says little: a P/D decode's requests wait while
    # their KV loads.
    stalled: bool = False


class Verdict(NamedTuple):
    action: str  # KEEP, RELEASE or STOP
    tokens: int  # oldest kept tokens to let go (RELEASE, STOP)
    reason: str  # "" for KEEP
    budget: int | None  # what the proxy may hold there (None: capacity unknown)


def budget(d: DecodeKV) -> int | None:
    """The tokens the proxy's kept turns may hold on ``d``."""
    cap = d.capacity
    if not cap:
        return None
    pinned_by_others = max(0.0, d.usage * cap - d.held)  # streams, other processes, running requests
    return max(0, int(min(SHARE * cap, TARGET * cap - pinned_by_others)))


def decide(d: DecodeKV) -> Verdict:
    """Keep, release the oldest ``tokens`` worth, or stop keeping on ``d``."""
    limit = budget(d)
    if limit is None:
        return Verdict(KEEP, 0, "", None)
    cap = d.capacity or 0
    fits = not _overflows(d, limit)
    if d.stalled or d.usage >= HIGH or (d.waiting > 0 and d.usage > TARGET):
        if d.stalled:
            excess = d.held  # nothing runs: every kept block is in the way
        else:
            excess = min(d.held, int((d.usage - TARGET) * cap) + 1)
        return Verdict(RELEASE if fits else STOP, max(excess, d.held - limit, 0), PRESSURE, limit)
    if d.held > limit:  # the oldest go: a new turn is likelier to be continued than an old one
        return Verdict(RELEASE, d.held - limit, SHARE_REASON, limit)
    return Verdict(KEEP, 0, "", limit)


def _overflows(d: DecodeKV, limit: int) -> bool:
    """Whether the turns offered per second, each kept for its whole life, would pass the budget
    (past RESUME of it while stopped: a hysteresis)."""
    need = d.rate * d.life
    return need > (RESUME * limit if d.stopped else limit)


class KeptRate:
    """Tokens offered for keeping per second, smoothed over ``window`` seconds (an
    exponentially decaying sum over the window); the clock passed in."""

    __slots__ = ("window", "total", "at")

    def __init__(self, window: float = 30.0) -> None:
        self.window = window
        self.total = 0.0
        self.at: float | None = None

    def add(self, tokens: int, now: float) -> None:
        self._decay(now)
        self.total += tokens

    def rate(self, now: float) -> float:
        self._decay(now)
        return self.total / self.window

    def _decay(self, now: float) -> None:
        if self.at is not None and now > self.at:
            self.total *= math.exp((self.at - now) / self.window)
        if self.at is None or now > self.at:
            self.at = now
