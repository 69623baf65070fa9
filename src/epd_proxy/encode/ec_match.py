"""Matching an encoder's ``ec_transfer_params`` to the items it was sent, and what
the consumer gets from the matched results: its body with media rewritten to
``*_embeds`` references (:func:`rewrite_media`) and its ``ec_transfer_params``
(:func:`consumer_ec_params`). The results (:class:`ItemResult`) are made and read here, so
media discovery (``multimodal.py``) needs nothing from this module.

The encoder keys its reply by the *engine's* mm hash, which may differ from
the uuid the proxy sent (processing options make the engine rehash), so
items are matched by position through ``item_indices`` first, and by key
only as a fallback (docs/protocol.md §4.4). Anything ambiguous is a 502: guessing would put
one image's grid on another image.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from epd_proxy.encode.encoder_plan import SubRequest
from epd_proxy.encode.multimodal import EMBEDS_TYPES, MediaItem
from epd_proxy.wire.errors import ProxyError


@dataclass(slots=True)
class ItemResult:
    """What the encoder reported for one item.

    ``metadata`` may be empty: the entry still carries a handle, but the item
    is not rewritten (docs/protocol.md §4.4 step 3).
    """

    metadata: dict
    mm_hash: str  # the proxy uuid
    ec_mm_hash: str  # the engine-reported hash, the key consumers look up
    transfer_id: str


def _is_index(value: object) -> bool:
    # bool is an int subclass, but ``true`` is not an item position.
    return isinstance(value, int) and not isinstance(value, bool)


def _claims_by_index(entries: dict, k: int) -> dict[int, str]:
    """Local index -> engine hash, from each entry's ``item_indices``."""
    claims: dict[int, str] = {}
    for engine_hash, entry in entries.items():
        indices = entry.get("item_indices")
        if indices is None:
            continue
        if not isinstance(indices, list):
            raise ProxyError(
                502, f"Invalid encoder item index list {indices!r} for {engine_hash!r}"
            )
        for idx in indices:
            if not _is_index(idx) or not 0 <= idx < k:
                raise ProxyError(
                    502, f"Invalid encoder item index {idx!r} for {engine_hash!r}"
                )
            if idx in claims:
                raise ProxyError(502, f"Duplicate encoder item index {idx}")
            claims[idx] = engine_hash
    return claims


def match_encoder_output(
    sub: SubRequest, transfer_ids: Sequence[str], ec_params: object
) -> tuple[list[ItemResult | None], dict]:
    """Per-item results for one sub-request, and the handles to forward.

    Returns ``(results, handles)``: ``results`` is aligned with ``sub.items``
    (None when the encoder reported nothing for that item) and ``handles``
    maps each matched engine hash to its entire entry.

    A missing, malformed or empty ``ec_transfer_params`` yields all None and
    no handles: the caller logs it and the consumer encodes locally. Non-dict
    entries are ignored. The reply's entry order never matters.
    """
    k = len(sub.items)
    if len(transfer_ids) != k:
        raise ValueError("one transfer id per sub-request item is required")
    if not isinstance(ec_params, dict):
        return [None] * k, {}
    entries = {
        h: e for h, e in ec_params.items() if isinstance(h, str) and isinstance(e, dict)
    }
    if not entries:
        return [None] * k, {}

    claims = _claims_by_index(entries, k) if k > 1 else {}

    results: list[ItemResult | None] = []
    handles: dict = {}
    for pos, item in enumerate(sub.items):
        engine_hash = claims.get(pos)
        if engine_hash is None:
            if item.uuid in entries:
                engine_hash = item.uuid
            elif k == 1 and len(entries) == 1:
                engine_hash = next(iter(entries))
            else:
                raise ProxyError(
                    502,
                    f"Encoder metadata cannot be matched to item {item.index} "
                    f"(position {pos} of {k})",
                )
        entry = entries[engine_hash]
        metadata = entry.get("metadata")
        results.append(
            ItemResult(
                metadata=metadata if isinstance(metadata, dict) else {},
                mm_hash=item.uuid or engine_hash,
                ec_mm_hash=engine_hash,
                transfer_id=transfer_ids[pos],
            )
        )
        handles[engine_hash] = dict(entry)
    return results, handles


def consumer_ec_params(
    items: Sequence[MediaItem],
    results: Sequence[ItemResult | None],
    handles: dict,
    *,
    rewrite: bool = True,
) -> dict | None:
    """The ``ec_transfer_params`` for the consumer (decode, or P in E+P+D).

    ``{"ec_items": [...], <engine hash>: <entry>, ...}`` (docs/protocol.md §2.5).
    ``ec_items`` lists, in global item order, every matched item: rewritten
    ones and those kept raw (which carry the same ``uuid`` and so resolve to
    the same engine hash on the consumer). A ``transfer_id`` is included when
    the item has one. Returns None when there is neither an item nor a handle,
    so no stale key is ever sent. ``rewrite`` is accepted for symmetry; both
    modes list the same items.
    """
    if len(items) != len(results):
        raise ValueError("items and results must have the same length")
    ec_items = []
    for _item, result in zip(items, results):
        if result is None:
            continue
        entry = {"mm_hash": result.ec_mm_hash}
        if result.transfer_id:
            entry["transfer_id"] = result.transfer_id
        ec_items.append(entry)
    if not ec_items and not handles:
        return None
    out: dict = {}
    if ec_items:
        out["ec_items"] = ec_items
    for key, value in handles.items():
        if key != "ec_items":
            out[key] = value
    return out


def flatten_metadata(metadata: dict) -> dict:
    """Each value flattened one level.

    The encoder reports per-item grids batched, e.g. ``[[1, 36, 52]]``; the
    decoder's ``*_embeds`` part wants ``[1, 36, 52]``. Within a list, nested
    lists are spliced in and scalars stay in place; a scalar value or an
    already flat list is returned as is.
    """
    out = {}
    for key, value in metadata.items():
        if isinstance(value, list) and any(isinstance(v, list) for v in value):
            flat: list[Any] = []
            for v in value:
                if isinstance(v, list):
                    flat.extend(v)
                else:
                    flat.append(v)
            value = flat
        out[key] = value
    return out


def embeds_part(item: MediaItem, metadata: dict) -> dict:
    """The metadata-only reference that replaces a media part on the consumer."""
    kind = EMBEDS_TYPES[item.type]
    return {"type": kind, kind: flatten_metadata(metadata), "uuid": item.uuid}


def _usable(item: MediaItem, result: ItemResult | None) -> bool:
    if result is None or not item.uuid:
        return False
    metadata = result.metadata
    return isinstance(metadata, dict) and bool(metadata)


def rewrite_media(
    body: dict,
    items: Sequence[MediaItem],
    results: Sequence[ItemResult | None],
) -> dict:
    """A new body with each encoded item replaced by its ``*_embeds`` reference.

    ``results`` is aligned with ``items``. Items without usable metadata (or
    not encoded at all, ``None``: ``--encoder-fallback local``), and every item
    of their modality, keep the client's raw part, but carry the ``uuid`` the encoder was given: the
    consumer then hashes the item exactly as the encoder did and finds the
    encoder's cache entry (ECExampleConnector reports empty metadata, so this
    is its normal path), instead of hashing the content and encoding again.
    Only messages and content lists that change are copied; everything else is
    shared with ``body``, which is never mutated.
    """
    if len(items) != len(results):
        raise ValueError("items and results must have the same length")
    # vLLM refuses a request that mixes raw media and ``*_embeds`` of one modality ("Mixing
    # raw image and embedding inputs is not allowed"): an item left raw (not encoded, or
    # without metadata) keeps its whole modality raw, with uuids, found in the encoder cache.
    raw_kinds = {EMBEDS_TYPES[i.type] for i, r in zip(items, results) if not _usable(i, r)}
    replacements: dict[int, dict[int, dict]] = {}
    for item, result in zip(items, results):
        if result is not None and EMBEDS_TYPES[item.type] not in raw_kinds and _usable(item, result):
            new_part = embeds_part(item, result.metadata)
        elif item.uuid and item.part.get("uuid") != item.uuid:
            new_part = {**item.part, "uuid": item.uuid}
        else:
            continue
        replacements.setdefault(item.message_index, {})[item.part_index] = new_part

    new_body = dict(body)
    if not replacements:
        return new_body
    messages = list(body["messages"])
    for mi, parts in replacements.items():
        message = dict(messages[mi])
        content = list(message["content"])
        for pi, new_part in parts.items():
            content[pi] = new_part
        message["content"] = content
        messages[mi] = message
    new_body["messages"] = messages
    return new_body
