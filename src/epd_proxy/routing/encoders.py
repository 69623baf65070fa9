"""Encoder placement for ``cache-aware``: new media spread level by estimated work, repeats
kept on the encoder that holds them (the rules are :class:`EncoderPlacement`'s docstring).

Pure: the only state is the recent work placed per encoder, a bounded map of items' homes
and plain counters; the work of an item is estimated from the request alone, no I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from epd_proxy.encode.image_size import base64_reader, image_size
from epd_proxy.encode.multimodal import media_url
from epd_proxy.routing.candidate import C
from epd_proxy.routing.view import M64, key_of
from epd_proxy.wire.blobs import Blob

if TYPE_CHECKING:  # pragma: no cover - typing only
    from epd_proxy.encode.multimodal import MediaItem

# An item's work, in estimated encoder tokens. A remote URL says nothing of its size: it
# counts as a typical image (a video as several frames' worth). An inline image whose header
# gives its size (``encode/image_size.py``) counts its 28x28-pixel patches (``PIXELS_PER_TOKEN``):
# what the encoder computes, so images of one size are equal work whatever their file sizes.
# Other inline media (``data:`` URLs, ``input_audio``) count their decoded bytes at
# ``BYTES_PER_TOKEN``, about what a JPEG photo takes per patch. Both within
# ``WORK_MIN``..``WORK_MAX`` (a model resizes images within its own pixel bounds, so neither a
# thumbnail nor a huge PNG is unbounded).
WORK_DEFAULT = 1024.0
WORK_REMOTE = {"video_url": 8 * WORK_DEFAULT}
BYTES_PER_TOKEN = 160
PIXELS_PER_TOKEN = 28 * 28
WORK_MIN = 64.0
WORK_MAX = 16384.0
# New items go to an encoder whose recent work is within this share of the most (and at
# least half the item's own work) above the least: with equal items that is the least
# loaded exactly, and among those the rendezvous-preferred one.
LEVEL_SLACK_REL = 0.05
LEVEL_SLACK_ITEM = 0.5
# The recent work is halved when one encoder's reaches this (the last few hundred items).
WORK_WINDOW = 512 * WORK_DEFAULT
# Items whose encoder is remembered (a 64-bit key and a URL reference: about 76 bytes
# each, 5 MB when full, measured with tracemalloc); the least recently routed is forgotten first.
ITEM_HOMES = 65536


def item_work(item: MediaItem) -> float:
    """The estimated encoder work of one item (see ``WORK_DEFAULT``): an inline image's
    patches when its header gives its size, else its decoded bytes for inline media, a
    typical item's for a remote URL. Reads only the part's string lengths and an image's
    header (a ``Blob`` is never copied), so it costs the same for a 10 MB image as a 10 KB one."""
    part = getattr(item, "part", None)
    if not isinstance(part, dict):
        return WORK_DEFAULT
    url = media_url(part)
    if url is None:  # input_audio: base64 data
        payload = part.get("input_audio")
        data = payload.get("data") if isinstance(payload, dict) else None
        return _clamp(len(data) * 3 / 4) if isinstance(data, (str, Blob)) else WORK_DEFAULT
    head = bytes(url.value[:5]) if isinstance(url, Blob) else url[:5].encode()
    if head.lower() != b"data:":
        return WORK_REMOTE.get(part["type"], WORK_DEFAULT)
    lead = bytes(url.value[:256]) if isinstance(url, Blob) else url[:256].encode()
    comma = lead.find(b",")
    if comma < 0:
        return WORK_DEFAULT
    size = len(url) - comma - 1
    if not lead[:comma].endswith(b";base64"):
        return _clamp(size)
    if lead[5:11].lower() == b"image/":
        pixels = image_size(base64_reader(url.value if isinstance(url, Blob) else url, comma + 1))
        if pixels is not None:
            return min(WORK_MAX, max(WORK_MIN, pixels[0] * pixels[1] / PIXELS_PER_TOKEN))
    return _clamp(size * 3 / 4)


def _clamp(nbytes: float) -> float:
    return min(WORK_MAX, max(WORK_MIN, nbytes / BYTES_PER_TOKEN))


class EncoderPlacement:
    """Where each media item is encoded: level for new content, affinity for repeats.

    *New content* (an item uuid, a content hash, that this proxy has not placed) goes
    where it keeps the encoders level by **work**, not by requests: each encoder's recent
    placed work (``item_work`` summed, halved every ``WORK_WINDOW``) is its share, and the
    item goes to the encoder with the highest rendezvous score among those whose share is
    within the level slack of the least (``LEVEL_SLACK_REL`` of the most, at least
    ``LEVEL_SLACK_ITEM`` of the item's own work). So the rendezvous-preferred encoder
    takes the item whenever that keeps the shares level, and only otherwise the
    least-loaded by work: of equal images sent one after another, a round of k goes one
    to each of k encoders, which is round-robin's spread.

    *A repeat* goes where this proxy placed it last (its *home*, in ``ITEM_HOMES``, oldest
    forgotten), as long as the home is a candidate and within the in-flight load bound
    that ``cache-aware`` applies to conversations (``balance_abs``/``balance_rel``);
    otherwise it is placed like new content, and its home moves there. A repeat adds no
    work to the shares: its encoder finds it in its cache.

    *Replicas* (``--workers``, or proxies behind a balancer) each keep their own shares
    and homes. A replica that never saw an item places it as new content, preferring the
    rendezvous-top encoder, which every replica computes alike from the URLs; so a repeat
    finds the same encoder on another replica whenever both placements found the top
    encoder within the slack. The trade-off is the slack: a wider one lets more first
    placements go to the top encoder (more agreement between replicas) and lets the
    shares drift further apart; ``LEVEL_SLACK_REL`` keeps them within 5 %.

    An encoder far behind the most (new, or back after an ejection) is counted from
    ``WORK_MAX`` (or twice the relative slack, if more) below it: it catches up by at most
    that, about sixteen typical images, no flood; one heavy item elsewhere is not enough to
    lift an encoder that is legitimately behind.

    Counters, plain numbers by encoder URL for metrics to read: ``items`` (items placed,
    repeats included; a request's duplicate counted once), ``work`` (estimated work of
    new content placed), ``hits`` (repeats sent to their home); and ``off_top``, new items
    placed off their rendezvous-top encoder to keep the shares level.
    """

    def __init__(self, seed: Callable[[str], int], balance_abs: float = 4, balance_rel: float = 1.5) -> None:
        self._seed = seed
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self._shares: dict[str, float] = {}
        self._homes: dict[int, str] = {}
        self.items: dict[str, int] = {}
        self.work: dict[str, float] = {}
        self.hits: dict[str, int] = {}
        self.off_top = 0

    def assign(self, candidates: list[C], items: Sequence[MediaItem]) -> list[C]:
        """An encoder per item, in the items' order; the same item twice in one request is
        encoded once, on one encoder, and a request's items count against each other."""
        loads = [c.inflight + c.signals.others for c in candidates]
        shares = self._shares
        top = max((shares.get(c.url, 0.0) for c in candidates), default=0.0)
        floor = max(0.0, top - max(WORK_MAX, 2 * LEVEL_SLACK_REL * top))
        level = [max(shares.get(c.url, floor), floor) for c in candidates]
        homes = self._homes
        counts = self.items
        out = []
        seen: dict[str, int] = {}
        for item in items:
            i = seen.get(item.uuid)
            if i is None:
                key = key_of(item.uuid)
                low = min(loads)
                bound = low + max(self.balance_abs, low * (self.balance_rel - 1.0))
                i = self._home(candidates, homes.get(key), loads, bound)
                url = candidates[i].url if i >= 0 else ""
                if i >= 0:
                    self.hits[url] = self.hits.get(url, 0) + 1
                else:
                    w = item_work(item)
                    i = self._level(candidates, key, loads, bound, level, w)
                    url = candidates[i].url
                    level[i] += w
                    self.work[url] = self.work.get(url, 0.0) + w
                    n = shares[url] = level[i]
                    if n >= WORK_WINDOW:  # keep the shares recent, forget encoders not here
                        self._shares = shares = {c.url: level[j] / 2 for j, c in enumerate(candidates)}
                        level = [x / 2 for x in level]
                seen[item.uuid] = i
                loads[i] += 1
                counts[url] = counts.get(url, 0) + 1
                homes.pop(key, None)  # re-inserted last: the dict's order is recency
                homes[key] = url
                if len(homes) > ITEM_HOMES:
                    del homes[next(iter(homes))]
            out.append(candidates[i])
        return out

    @staticmethod
    def _home(candidates: list[C], home: str | None, loads: list[float], bound: float) -> int:
        """The index of the item's home if it is a candidate within the load bound, else -1."""
        if home is not None:
            for i, c in enumerate(candidates):
                if c.url == home:
                    return i if loads[i] <= bound else -1
        return -1

    def _level(self, candidates: list[C], key: int, loads: list[float], bound: float,
               level: list[float], work: float) -> int:
        """The index for new content: the highest rendezvous score among the candidates
        within the load bound whose share is within the slack of the least."""
        within = [i for i in range(len(candidates)) if loads[i] <= bound]
        least = min(level[i] for i in within)
        slack = max(LEVEL_SLACK_ITEM * work, LEVEL_SLACK_REL * max(level))
        seed = self._seed
        best = -1
        best_score = top_score = -1
        for i, c in enumerate(candidates):
            x = key ^ seed(c.url)  # mix64, inlined
            x = ((x ^ (x >> 33)) * 0xFF51AFD7ED558CCD) & M64
            x = ((x ^ (x >> 33)) * 0xC4CEB9FE1A85EC53) & M64
            x ^= x >> 33
            if x > top_score:
                top_score = x
            if loads[i] <= bound and level[i] <= least + slack and x > best_score:
                best, best_score = i, x
        if best_score < top_score:
            self.off_top += 1
        return best
