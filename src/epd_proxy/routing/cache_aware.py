"""``cache-aware``: rendezvous hashing of the conversation's anchor, bounded by load, with
a conversation kept where this proxy sent its previous turn and opening turns spread level
(the class docstring has the rules); media items are placed by ``encoders.py``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from epd_proxy.routing.candidate import C
from epd_proxy.routing.encoders import EncoderPlacement
from epd_proxy.routing.policies import LoadAware
from epd_proxy.routing.view import EMPTY_VIEW, M64, RequestView, instance_seed, mix64

if TYPE_CHECKING:  # pragma: no cover - typing only
    from epd_proxy.encode.multimodal import MediaItem


class CacheAware:
    """Rendezvous affinity bounded by load.

    The preferred instance for a key is the candidate with the highest ``mix64(key ^
    seed(url))``; it is passed over, in rendezvous order, while its load exceeds both
    ``min_load + balance_abs`` and ``min_load * balance_rel`` (``min_load`` that of the
    least-loaded candidate): a hot prefix spills to its second instance, and so on. The
    least-loaded candidate always qualifies, so a pick always exists. A request without an
    anchor goes to the load-aware choice.

    The slack scales with what staying can gain: the request's ``reuse`` share (its
    history, which only the preferred instance is likely to hold). A conversation's
    opening turn has nothing there yet, so it goes to the least-loaded candidate (the
    preferred one among equals) instead of queueing behind another's long prefill; its
    next turn still finds the preferred instance, and loses at most the opening's own
    text. A long history keeps the full slack.

    Openings also keep the instances' shares level: among the least-loaded candidates only
    those whose recent openings are within ``OPEN_SLACK_REL`` (at least ``OPEN_SLACK_MIN``)
    of the fewest qualify. Rendezvous alone spreads n conversations over k instances with
    a spread of about sqrt(n/k), which on traffic of single prompts is the whole load.

    A conversation stays where this proxy sent its previous turn (its *home*, within the
    same load bound), so the level shares of openings stay level for the conversations'
    lives. The home counts only when the turn before the request was this proxy's own
    (``RequestView.previous`` equals the mark it kept): a turn another replica or
    ``--workers`` process served, or a restart, hands the conversation back to the
    rendezvous order that every replica computes alike, so replicas agree from the first
    turn any of them could not see (the same turn sent again keeps its home too). The
    homes are bounded (``HOMES``, oldest forgotten).

    With a shared state store, what one replica placed where the rendezvous order would not
    (an opening on the least-loaded instance, a turn spilled for load) is told to ``learned``
    (``placement/shared_homes.py`` writes it to the store), and a turn whose previous turn
    another replica routed reads it back (``RequestView.recalled``) and takes it as its home,
    within the same load bound: replicas agree on where a conversation's prefix lives, not
    only on where the rendezvous order says it should.

    With KV events (the view's ``held``, exact for every candidate), what an instance
    holds replaces the guess: the candidate where the prompt waits least goes first, what it
    computes there and the queue ahead of it counted in prompt tokens, within the same load
    bound (``_exact``); none holding anything is an opening turn.

    Encoders (``assign``) place media items per item: new content level by estimated work,
    repeats on the encoder that holds them (``routing.encoders.EncoderPlacement``).
    """

    name = "cache-aware"
    uses_view = True
    uses_signals = True

    def __init__(self, balance_abs: float = 4, balance_rel: float = 1.5) -> None:
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self._seeds: dict[str, int] = {}
        self._fallback = LoadAware()
        self._openings: dict[str, int] = {}  # recent opening turns per URL (halved as they grow)
        self._homes: dict[int, tuple[str, int]] = {}  # anchor -> (URL, mark) of the last turn routed
        self.spills = 0  # picks that passed over the preferred instance (for load, or an opening's count)
        self.encoders: EncoderPlacement | None = None  # media items' placement, on first assign
        self.exact = 0  # picks made on the block index (KV events)
        # With a shared store: told (anchor, mark, URL) of each turn placed off the rendezvous
        # order's first instance, what another replica could not compute (shared_homes.py).
        self.learned: Callable[[int, int, str], None] | None = None

    def seed(self, url: str) -> int:
        seed = self._seeds.get(url)
        if seed is None:
            seed = self._seeds[url] = instance_seed(url)
        return seed

    def choose(self, candidates: list[C], view: RequestView = EMPTY_VIEW) -> C:
        if len(candidates) == 1:
            return candidates[0]
        if view.held is not None and view.exact([c.url for c in candidates]):
            inst = candidates[self._exact(candidates, view)]
            self._home(view, inst)
            return inst
        key = view.anchor
        if not key:
            return self._fallback.choose(candidates)
        loads = [c.inflight + c.signals.others for c in candidates]
        reuse = view.reuse
        mark = view.mark
        if not reuse:
            inst = candidates[self._open(candidates, key, loads)]
        else:
            home = self._homes.get(key) if mark else None
            if home is not None and home[1] != view.previous and home[1] != mark:
                home = None  # another turn came between (not this proxy's): rendezvous, as any replica
            url = home[0] if home is not None else None
            if url is None and view.recalled:  # where another replica sent it (the shared store)
                url = _first_candidate(candidates, view.recalled)
            inst = candidates[self._pick(candidates, key, loads, reuse, url)]
        self._home(view, inst)
        if self.learned is not None and mark:
            self._tell(candidates, key, mark, inst)
        return inst

    def unknown_home(self, view: RequestView) -> bool:
        """Whether a later turn's previous turn was not routed here (or long forgotten): only
        the shared store can say where it went. Openings, requests without an anchor and
        those the block index speaks for (KV events) need no store."""
        key = view.anchor
        if not key or view.held is not None or not view.previous:
            return False
        home = self._homes.get(key)
        return home is None or (home[1] != view.previous and home[1] != view.mark)

    def _tell(self, candidates: list[C], key: int, mark: int, inst: C) -> None:
        """A turn placed off the rendezvous order's first instance: ``learned`` is told."""
        seed = self.seed
        top = max(candidates, key=lambda c: mix64(key ^ seed(c.url)))
        if top is not inst:
            self.learned(key, mark, inst.url)  # type: ignore[misc]  # only called when set

    def _home(self, view: RequestView, inst: C) -> None:
        """The conversation's last turn went to ``inst`` (kept for its next turn)."""
        mark = view.mark
        key = view.anchor if mark else 0
        if key:
            homes = self._homes
            homes.pop(key, None)  # re-inserted last: the dict's order is the turns' recency
            homes[key] = (inst.url, mark)
            if len(homes) > HOMES:
                del homes[next(iter(homes))]

    def _exact(self, candidates: list[C], view: RequestView) -> int:
        """The index of the candidate where the prompt waits least, in prompt tokens: what it
        must compute of it there (the block index says what is held) plus what is queued ahead
        (this proxy's requests' own backlog; another client's requests at this proxy's mean
        there), within today's load bound; ties to the longest prefix held, then in rendezvous
        order. Nothing held anywhere: an opening turn.

        Taking the longest prefix alone piles a shared prefix's conversations (a system prompt
        every opening turn shares) onto its first holder until the load bound stops them: the
        others never come to hold it, and that one queues. Weighed in tokens, a holder keeps
        them while its queue is shorter than what they would compute elsewhere; then another
        computes the prefix once and holds it too (as Dynamo's KV router weighs overlap against
        its workers' active blocks)."""
        self.exact += 1
        held = view.held
        assert held is not None
        loads = [c.inflight + c.signals.others for c in candidates]
        tokens = [held.get(c.url, 0) for c in candidates]
        most = max(tokens)
        key = view.anchor
        if not most:
            if key:
                return self._open(candidates, key, loads)
            return candidates.index(self._fallback.choose(candidates))
        prompt = max(view.tokens, most)
        low = min(loads)
        bound = low + max(self.balance_abs, low * (self.balance_rel - 1.0))
        best, top = -1, (0.0, -1, -1)
        for i, c in enumerate(candidates):
            if loads[i] > bound:
                continue
            queued: float = c.backlog
            others = c.signals.others
            if others:
                queued += others * (c.backlog / c.inflight if c.inflight else prompt - tokens[i])
            score = (-(prompt - tokens[i] + queued), tokens[i], mix64(key ^ self.seed(c.url)))
            if best < 0 or score > top:
                best, top = i, score
        if tokens[best] < most:
            self.spills += 1  # the instance holding the most was passed over for its queue
        return best

    def assign(self, candidates: list[C], items: Sequence[MediaItem]) -> list[C]:
        """Encoders: new content level by work, repeats where they went
        (:class:`~epd_proxy.routing.encoders.EncoderPlacement`)."""
        placement = self.encoders
        if placement is None:
            placement = self.encoders = EncoderPlacement(self.seed, self.balance_abs, self.balance_rel)
        return placement.assign(candidates, items)

    def _pick(self, candidates: list[C], key: int, loads: list[float], reuse: float = 1.0,
              home: str | None = None) -> int:
        """The index of ``home`` if it is a candidate within the bound, else of the highest
        rendezvous score among those (``mix64`` inlined: this runs per candidate per
        request)."""
        low = min(loads)
        bound = low + reuse * max(self.balance_abs, low * (self.balance_rel - 1.0))
        seeds = self._seeds
        best = top = -1
        over = False
        for i, c in enumerate(candidates):
            if loads[i] <= bound:
                if c.url == home:
                    return i
                x = key ^ (seeds.get(c.url) or self.seed(c.url))
                x = ((x ^ (x >> 33)) * 0xFF51AFD7ED558CCD) & M64
                x = ((x ^ (x >> 33)) * 0xC4CEB9FE1A85EC53) & M64
                x ^= x >> 33
                if x > top:
                    best, top = i, x
            else:
                over = True
        if over and any(mix64(key ^ self.seed(c.url)) > top
                        for i, c in enumerate(candidates) if loads[i] > bound):
            self.spills += 1  # the preferred instance was passed over for its load
        return best


    def _open(self, candidates: list[C], key: int, loads: list[float]) -> int:
        """The index for an opening turn: the preferred (rendezvous) candidate among the
        least-loaded ones whose recent openings are within the slack of the fewest.

        An instance new to the counts, or back after a while, is counted from twice the
        slack below the most: it catches up by at most one slack of openings, no flood."""
        counts = self._openings
        cs = [counts.get(c.url, 0) for c in candidates]
        top = max(cs)
        slack = max(OPEN_SLACK_MIN, OPEN_SLACK_REL * top)
        floor = top - 2 * slack
        low = min(loads)
        fewest = min(max(cs[i], floor) for i in range(len(candidates)) if loads[i] <= low)
        seeds = self._seeds
        best = -1
        top_score = first_score = -1
        for i, c in enumerate(candidates):
            x = key ^ (seeds.get(c.url) or self.seed(c.url))  # mix64, inlined as in _pick
            x = ((x ^ (x >> 33)) * 0xFF51AFD7ED558CCD) & M64
            x = ((x ^ (x >> 33)) * 0xC4CEB9FE1A85EC53) & M64
            x ^= x >> 33
            if x > first_score:
                first_score = x
            if loads[i] <= low and max(cs[i], floor) <= fewest + slack and x > top_score:
                best, top_score = i, x
        if top_score < first_score:
            self.spills += 1
        url = candidates[best].url
        n = counts[url] = max(cs[best], int(floor)) + 1
        if n >= OPEN_WINDOW:  # keep the counts recent: halve them, and forget instances not here
            self._openings = {c.url: counts.get(c.url, 0) // 2 for c in candidates}
        return best


# Opening turns (``CacheAware._open``): the counts an instance's share may run ahead of the
# fewest, relative and at least; the counts are halved when one reaches the window, so they
# cover the last few hundred openings.
OPEN_SLACK_REL = 0.1
OPEN_SLACK_MIN = 4
OPEN_WINDOW = 512
# Conversations whose last turn's instance ``CacheAware`` keeps (about 130 bytes each, so
# under 10 MB when full, measured with tracemalloc).
HOMES = 65536


def _first_candidate(candidates: list[C], urls: tuple[str, ...]) -> str | None:
    """The first of ``urls`` that is a candidate (the store's answer may name another pool's)."""
    here = {c.url for c in candidates}
    return next((u for u in urls if u in here), None)
