"""Each instance's own load, as read from its ``/metrics`` (pure; ``load_scraper.py`` reads it
in the background).

The proxy's in-flight counts see only its own requests; with several proxy
replicas (or ``--workers``) each sees a share. vLLM exports the whole queue
(``vllm:num_requests_running`` + ``vllm:num_requests_waiting``) and the KV
cache's fill (``vllm:kv_cache_usage_perc``), so a loop per pool scrapes them
every ``--scrape-interval`` and keeps, per instance, the part of that queue
which is not this proxy's (:class:`LoadSignals`). Routing reads those numbers;
no request ever waits on a scrape.

A failed scrape is **not** a health signal: ``/metrics`` may be disabled,
filtered by a sidecar or slow for reasons unrelated to serving, and the health
probe already asks the instance whether it serves. It only makes the
instance's signals unknown (``forget``): routing then counts this proxy's
in-flight requests alone for it, never old numbers.
"""

from __future__ import annotations

_RUNNING = b"vllm:num_requests_running"
_WAITING = b"vllm:num_requests_waiting"
_WAITING_BY_REASON = b"vllm:num_requests_waiting_by_reason{"
_FOR_CAPACITY = b'reason="capacity"'
_KV_USAGE = b"vllm:kv_cache_usage_perc"
_LORA_INFO = b"vllm:lora_requests_info{"
_CACHE_INFO = b"vllm:cache_config_info{"
_GPU_BLOCKS = b'num_gpu_blocks="'
_BLOCK_SIZE = b'block_size="'


class LoadSignals:
    """What an instance's ``/metrics`` said last, as this proxy can use it.

    ``others``: requests on the instance that are not this proxy's (its running +
    waiting at the scrape, minus this proxy's in-flight during it; 0 when unknown or stale).
    ``kv_usage``: ``vllm:kv_cache_usage_perc`` (0..1).
    ``adapters``: the LoRA adapters running or waiting there (``vllm:lora_requests_info``).
    ``kv_blocks``: its KV cache's size in blocks (``vllm:cache_config_info``'s ``num_gpu_blocks``,
    over its engines; None: not exported), so a small usage reads as blocks, not as 0 %.
    ``block_size``: tokens per block (the same gauge's ``block_size``; None: not exported).
    ``running``: ``vllm:num_requests_running``; ``waiting_for_room``: the waiting requests that
    wait for room, not for a KV transfer (``update``); ``stalled_since``: since when its scrapes
    show requests waiting for room and none running (None: it runs, or nothing waits), see
    :func:`wedged`;
    ``wedged_kv``: its KV usage when it was taken out for that (:func:`running_again`).
    """

    __slots__ = ("others", "kv_usage", "waiting", "load", "scraped_at", "adapters", "kv_blocks", "block_size",
                 "running", "waiting_for_room", "stalled_since", "wedged_kv")

    def __init__(self) -> None:
        self.others = 0.0
        self.kv_usage = 0.0
        self.waiting = 0.0
        self.load = 0.0  # what the load-aware score adds to the in-flight count (routing/policies.py)
        self.scraped_at: float | None = None
        self.adapters: frozenset[str] = frozenset()
        self.kv_blocks: int | None = None
        self.block_size: int | None = None
        self.running = 0.0
        self.waiting_for_room = 0.0  # the waiting ones that wait for room (``update``)
        self.stalled_since: float | None = None
        self.wedged_kv: float | None = None  # its KV usage when it was taken out for standing still

    def update(self, running: float, waiting: float, kv_usage: float, own_inflight: int, now: float,
               for_capacity: float | None = None) -> None:
        """``for_capacity``: the waiting requests that wait for room (vLLM's
        ``vllm:num_requests_waiting_by_reason{reason="capacity"}``; None where it is not exported:
        then every waiting one counts). Only they make a queue that stands still: a request
        deferred for its KV transfer (a pull from a prefill) waits on that transfer, which fails
        or finishes on its own, not on the decode's room."""
        self.others = max(0.0, running + waiting - own_inflight)
        self.waiting = waiting
        self.running = running
        self.waiting_for_room = room = waiting if for_capacity is None else for_capacity
        if room > 0 and running <= 0:
            if self.stalled_since is None:
                self.stalled_since = now
        else:
            self.stalled_since = None
        self.kv_usage = kv_usage
        self.load = self.others + kv_penalty(kv_usage)
        self.scraped_at = now

    def forget(self) -> None:
        """No fresh scrape: route on this proxy's own counts only."""
        self.others = 0.0
        self.kv_usage = 0.0
        self.waiting = 0.0
        self.load = 0.0
        self.scraped_at = None
        self.adapters = frozenset()
        self.running = 0.0
        self.waiting_for_room = 0.0
        self.stalled_since = None


# The KV cache weighs in only as it nears full: from KV_FULL_FROM to full it counts as up to
# KV_USAGE_WEIGHT queued requests (a decode near its limit would preempt the next long
# stream). Below that, usage says little about the next request, and weighing it would send
# every tie between idle instances to whichever looked emptiest at the last scrape, for a
# whole scrape interval.
KV_FULL_FROM = 0.75
KV_USAGE_WEIGHT = 8.0


# A queue that stands still this long (requests waiting, none running, over consecutive scrapes)
# is a wedged instance, not a busy one: a busy engine admits something within a step. vLLM's
# decode with bidirectional KV transfer stands still while its cache is full of blocks pinned
# for later turns (their TTL is minutes); see docs/operations.md, "A decode starved by kept KV".
WEDGED_HOLD = 2.0
# A KV cache this full with requests waiting counts as full of pinned blocks (said in the reason).
KV_FULL = 0.98


def wedged(signals: LoadSignals, now: float, hold: float = WEDGED_HOLD) -> str | None:
    """Why an instance's last scrapes say it stands still (requests waiting, none running for
    ``hold`` seconds or more), or None while it runs."""
    since = signals.stalled_since
    if since is None or signals.scraped_at is None or now - since < hold:
        return None
    what = (f"KV cache {signals.kv_usage:.1%} full" if signals.kv_usage >= KV_FULL
            else "none admitted")
    return f"{signals.waiting_for_room:g} requests waiting, none running for {now - since:.1f} s ({what})"


# The share of its KV cache a decode taken out for standing still must have freed since (its
# pinned blocks expiring) before a scrape that shows nothing waiting brings it back: its
# waiting requests were failed over, so "nothing waiting" alone says nothing of its room.
KV_FREED = 0.05
# A cache at most this full is not one full of pinned blocks: nothing waiting is enough there.
KV_LOW = 0.5


def running_again(signals: LoadSignals) -> bool:
    """Whether the last scrape shows an instance out for standing still able to take requests:
    requests running, or nothing waiting and ``KV_FREED`` of its cache freed since it stood
    (``wedged_kv``), or its cache at most ``KV_LOW`` full."""
    if signals.running > 0:
        return True
    if signals.waiting_for_room > 0:
        return False
    at = signals.wedged_kv
    return at is None or signals.kv_usage <= max(at - KV_FREED, KV_LOW)


def kv_penalty(kv_usage: float) -> float:
    return KV_USAGE_WEIGHT * (kv_usage - KV_FULL_FROM) / (1.0 - KV_FULL_FROM) if kv_usage > KV_FULL_FROM else 0.0


def gauge_samples(text: bytes, name: bytes) -> list[float]:
    """The samples of a gauge in Prometheus text, one per label set (one per engine with
    data parallelism); NaN samples are left out."""
    out: list[float] = []
    pos = 0
    n = len(name)
    size = len(text)
    while True:
        pos = text.find(name, pos)
        if pos < 0:
            return out
        end = pos + n
        # A sample line starts with the exact name: not a comment, not a longer name.
        if (pos == 0 or text[pos - 1] == 10) and end < size and text[end] in b"{ ":
            eol = text.find(b"\n", end)
            line = text[end:eol if eol >= 0 else size]
            if line[:1] == b"{":
                line = line[line.rfind(b"}") + 1:]
            try:
                value = float(line.split()[0])
            except (ValueError, IndexError):
                value = float("nan")
            if value == value:
                out.append(value)
        pos = end


def parse_load(text: bytes) -> tuple[float, float, float] | None:
    """(running, waiting, kv_usage) from vLLM's ``/metrics``: queues summed over engines, KV
    usage their mean; None without the queue gauges."""
    running = gauge_samples(text, _RUNNING)
    waiting = gauge_samples(text, _WAITING)
    if not running and not waiting:
        return None
    kv = gauge_samples(text, _KV_USAGE)
    return sum(running), sum(waiting), (sum(kv) / len(kv)) if kv else 0.0


def parse_waiting_for_capacity(text: bytes) -> float | None:
    """The requests waiting for room (``vllm:num_requests_waiting_by_reason`` with
    ``reason="capacity"``, summed over engines), as against those deferred (a KV transfer under
    way, a LoRA budget); None where the gauge is not exported (vLLM before it)."""
    total: float | None = None
    pos = 0
    while True:
        pos = text.find(_WAITING_BY_REASON, pos)
        if pos < 0:
            return total
        end = text.find(b"}", pos)
        if end < 0:
            return total
        if (not pos or text[pos - 1] == 10) and text.find(_FOR_CAPACITY, pos, end) >= 0:
            eol = text.find(b"\n", end)
            try:
                value = float(text[end + 1:eol if eol >= 0 else len(text)].split()[0])
            except (ValueError, IndexError):
                value = float("nan")
            if value == value:
                total = (total or 0.0) + value
        pos = end


def parse_adapters(text: bytes) -> frozenset[str]:
    """The LoRA adapters running or waiting on an instance, from vLLM's ``vllm:lora_requests_info``
    gauge: its adapters are label values and its value the time it was set; every label set ever
    set stays exported, so the newest sample is the current one."""
    best, adapters = -1.0, frozenset[str]()
    pos = 0
    while True:
        pos = text.find(_LORA_INFO, pos)
        if pos < 0:
            return adapters
        if pos and text[pos - 1] != 10:
            pos += 1
            continue
        end = text.find(b"}", pos)
        eol = text.find(b"\n", pos)
        if end < 0:
            return adapters
        try:
            value = float(text[end + 1:eol if eol >= 0 else len(text)].split()[0])
        except (ValueError, IndexError):
            value = -1.0
        if value > best:
            best, names = value, set[str]()
            for label in (b'running_lora_adapters="', b'waiting_lora_adapters="'):
                at = text.find(label, pos, end)
                if at >= 0:
                    start = at + len(label)
                    names.update(n for n in text[start:text.find(b'"', start)].decode("utf-8", "replace")
                                 .split(",") if n)
            adapters = frozenset(names)
        pos = end


# While every instance shows only this proxy's own requests and no KV cache near full, a scrape
# adds nothing to what routing already knows: the wait doubles after each such round, up to
# QUIET_STRETCH x the interval, and drops back to the interval at the first round that shows
# anything else. (Envoy's health checks stretch the same way for a cluster without traffic,
# ``no_traffic_interval``.) A single proxy in front of its own cluster then pays a quarter of
# the scrapes; replicas that see each other's load keep the full rate.
QUIET_STRETCH = 4


def parse_block_size(text: bytes) -> int | None:
    """Tokens per KV block: ``block_size`` of vLLM's ``vllm:cache_config_info`` (the first
    engine's; every engine of an instance has the same); None when it is not exported."""
    pos = text.find(_CACHE_INFO)
    while pos >= 0:
        end = text.find(b"}", pos)
        if end < 0:
            return None
        if not pos or text[pos - 1] == 10:
            at = text.find(_BLOCK_SIZE, pos, end)
            if at >= 0:
                start = at + len(_BLOCK_SIZE)
                value = text[start:text.find(b'"', start)]
                return int(value) if value.isdigit() and int(value) > 0 else None
        pos = text.find(_CACHE_INFO, end)
    return None


def parse_kv_blocks(text: bytes) -> int | None:
    """The KV cache's size in blocks: ``num_gpu_blocks`` of vLLM's ``vllm:cache_config_info``
    (one sample per engine, summed); None when it is not exported or not a number yet."""
    total, found = 0, False
    pos = 0
    while True:
        pos = text.find(_CACHE_INFO, pos)
        if pos < 0:
            return total if found else None
        end = text.find(b"}", pos)
        if (pos and text[pos - 1] != 10) or end < 0:
            pos += 1
            continue
        at = text.find(_GPU_BLOCKS, pos, end)
        if at >= 0:
            start = at + len(_GPU_BLOCKS)
            value = text[start:text.find(b'"', start)]
            if value.isdigit():
                total += int(value)
                found = True
        pos = end
