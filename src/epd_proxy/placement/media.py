"""The encoders of a request's media items: each item's encoder, or why none (a step of the
placement, ``decision.py``, made again for the items an encoder failed).

The candidates are the encode role's (``instances/pool.py``: in rotation, else half-open, else
panic), never one that failed these items or timed out on this request, and, with
``--encoder-max-outstanding``, only those with room; the role's policy places each item among
them (``cache-aware``: new media level by work, repeats where they went,
``routing/encoders.py``). Items whose encoder has no room left (their own earlier items filled
it) wait for room.
"""

from __future__ import annotations

from typing import Collection, Mapping, Sequence

from epd_proxy.encode.encoder_plan import within_bound
from epd_proxy.encode.multimodal import MediaItem
from epd_proxy.instances.instance import Instance
from epd_proxy.instances.models import ModelKey
from epd_proxy.instances.pool import InstancePool

# No encoder left that has not failed these items (or the role has none).
NONE_LEFT = None


def place_items(pool: InstancePool, items: Sequence[MediaItem], *, exclude: Collection[Instance] = (),
                failed: Collection[Instance] = (), timed_out: Collection[Instance] = (),
                outstanding: Mapping[str, int] | None = None, bound: int = 0, model: ModelKey | None = None
                ) -> tuple[list[MediaItem], list[Instance]] | None:
    """The items that fit now and their encoders (in the items' order; ([], []) when no encoder
    has room), or None when no encoder is left that has not failed these items. Raises the
    role's 503 when it has no instance at all (``pool.candidates``)."""
    live = pool.candidates(exclude, model)
    if failed or timed_out:  # never back to an encoder that failed these items or timed out on the request
        live = [c for c in live if c not in failed and c not in timed_out]
        if not live:
            return NONE_LEFT
    if bound:
        out = outstanding or {}
        live = [c for c in live if out.get(c.url, 0) < bound]
        if not live:
            return [], []
    placed = pool.policy.assign(live, items)
    if not bound:
        return list(items), placed
    fits = within_bound([c.url for c in placed], outstanding or {}, bound)
    return [i for i, ok in zip(items, fits) if ok], [c for c, ok in zip(placed, fits) if ok]
