"""The encoder cache of one simulated cluster: what encoders store and EC consumers load.

It plays the part of ECExampleConnector's shared directory for real vLLM:
an encoder puts each item's output under the item's engine hash, and a
consumer (prefill, pd, or a decode without remote KV) finds it there by that
hash. The functions here are the two sides of that hand-off.
"""

from __future__ import annotations

from dataclasses import dataclass

from epd_proxy.sim.tokens import flatten_metadata, media_tokens


@dataclass(slots=True)
class EcEntry:
    metadata: dict
    size_bytes: int
    producer: str
    peer_host: str
    peer_port: int
    content: str | None = None  # the content key of the item encoded (tokens.content_key)


class EcStore:
    """The encoder cache shared by the encoders and the EC consumers of one cluster
    (what ECExampleConnector's shared directory is for real vLLM)."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._d: dict[str, EcEntry] = {}

    def put(self, key: str, entry: EcEntry) -> None:
        d = self._d
        d.pop(key, None)
        d[key] = entry
        while len(d) > self.capacity:
            del d[next(iter(d))]

    def get(self, key: str | None) -> EcEntry | None:
        return self._d.get(key) if key is not None else None

    def content_of(self, key: str) -> str | None:
        """The content the entry under ``key`` was encoded from (None without one): what an
        ``*_embeds`` reference to it stands for (tokens.analyze)."""
        entry = self._d.get(key)
        return None if entry is None else entry.content

    def __contains__(self, key: object) -> bool:
        return key in self._d

    def __len__(self) -> int:
        return len(self._d)

    def keys(self) -> list[str]:
        return list(self._d)

    def clear(self) -> None:
        self._d.clear()


def encode_groups(media: list) -> dict[str, dict]:
    """The raw items of an encoder's request, grouped by engine hash: identical items in
    one request share one entry (``item_indices``)."""
    groups: dict[str, dict] = {}
    for m in media:
        if not m.raw:
            continue
        g = groups.get(m.mm_hash)
        if g is None:
            groups[m.mm_hash] = {"metadata": m.metadata, "item_indices": [m.index], "family": m.family,
                                 "content": m.content}
        else:
            g["item_indices"].append(m.index)
    return groups


def store_outputs(store: EcStore, groups: dict[str, dict], *, example: bool, hidden_size: int,
                  producer: str, host: str, port: int) -> tuple[dict, int]:
    """Put an encoder's outputs in the store; returns its ``ec_transfer_params`` and the
    number of items encoded. ``example``: ECExampleConnector's form (empty metadata, no
    handle; the cache sits in the shared directory under the hash)."""
    out = {}
    items = 0
    for mm_hash, g in groups.items():
        size = media_tokens(g["family"], g["metadata"]) * hidden_size * 2
        store.put(mm_hash, EcEntry(g["metadata"], size, producer, host, port, g.get("content")))
        items += len(g["item_indices"])
        if example:
            out[mm_hash] = {"item_indices": g["item_indices"], "metadata": {}}
        else:
            out[mm_hash] = {"metadata": g["metadata"], "item_indices": g["item_indices"],
                            "peer_host": host, "peer_port": port, "size_bytes": size}
    return out, items


@dataclass(slots=True)
class ConsumerLoad:
    """What an EC consumer found for a request's media."""

    hits: int = 0  # items loaded from the store
    local_encodes: int = 0  # raw items not in the store, encoded here
    error: str | None = None  # the generation failure, if an ``*_embeds`` reference failed


def load_for_consumer(store: EcStore, media: list, instance: str) -> ConsumerLoad:
    """Resolve a consumer's media against the store, as vLLM's EC consumer does: a raw item
    is loaded when its hash is there (else encoded locally); an ``*_embeds`` reference must
    be there, with the metadata the encoder produced."""
    out = ConsumerLoad()
    for m in media:
        if m.raw:
            if m.mm_hash in store:
                out.hits += 1
            else:
                out.local_encodes += 1
        elif isinstance(m.metadata, dict):
            entry = store.get(m.mm_hash)
            if entry is None:
                out.error = (f"EC load failed on {instance}: no embedding for mm_hash {m.mm_hash!r} "
                             f"({m.type} item {m.index}) in the encoder cache; was it encoded, and with "
                             "the same uuid and mm_processor_kwargs?")
                return out
            if flatten_metadata(entry.metadata) != flatten_metadata(m.metadata):
                out.error = (f"EC metadata mismatch on {instance} for mm_hash {m.mm_hash!r} "
                             f"({m.type} item {m.index}): the request says {m.metadata}, the encoder "
                             f"produced {entry.metadata}")
                return out
            out.hits += 1
    return out


def empty_embeds_refusal(media: list) -> str | None:
    """vLLM's refusal of ``*_embeds`` references without data (an ECExampleConnector
    encoder reports empty metadata, and a model that declares no embedding fields,
    like BLIP-2, has nothing to build the item from)."""
    if not any(not m.raw and m.metadata == {} for m in media):
        return None
    for family in ("image", "audio", "video"):
        items = [m for m in media if m.family == family]
        with_data = [m for m in items if m.raw or m.metadata != {}]
        if len(items) != len(with_data):
            return (f"If given, multi_modal_uuids[{family!r}] must have same length as "
                    f"multi_modal_data[{family!r}], but got {len(items)} vs {len(with_data)}.")
    return None


def mixing_refusal(media: list) -> str | None:
    """vLLM's refusal of a request with raw media and ``*_embeds`` of the same modality
    (its chat parser: "Mixing raw image and embedding inputs is not allowed"; image and
    audio). A consumer given some items raw must be given all of that modality raw."""
    for family in ("image", "audio"):
        kinds = {m.raw for m in media if m.family == family}
        if len(kinds) == 2:
            return f"Mixing raw {family} and embedding inputs is not allowed"
    return None
