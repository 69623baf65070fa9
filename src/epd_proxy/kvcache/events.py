"""vLLM's KV cache event messages, as its ZMQ publisher sends them (vLLM 0.32,
``vllm/distributed/kv_events.py``).

A message is three frames: the topic, the sequence number (8 bytes, big-endian), and a
msgpack payload ``[timestamp, [event, ...], data_parallel_rank]``. Each event is a map
tagged by ``type``: ``BlockStored`` (``block_hashes``, ``parent_block_hash``,
``token_ids``, ``block_size``, ``lora_name``, ``medium``, ``extra_keys``, ``group_idx``,
...), ``BlockRemoved`` (``block_hashes``, ``medium``, ``group_idx``) or
``AllBlocksCleared``. The replay socket (ROUTER) answers a request ``[b"", start]``
(8 bytes, big-endian) with ``[b"", topic, seq, payload]`` per buffered step from
``start`` on, then ``[b"", b"", -1, b""]``.

Only what the index reads is taken; unknown fields and event types are ignored, so a
later vLLM's additions pass. Pure.
"""

from __future__ import annotations

from typing import Any

import msgspec

from epd_proxy.kvcache.index import BlockIndex

# The replay socket's end marker (a signed -1).
END_SEQ = -1
_decoder = msgspec.msgpack.Decoder()


class WireError(ValueError):
    """A message that is not vLLM's event batch."""


def sequence(frame: bytes) -> int:
    """A sequence frame's number (signed: the replay's end marker is -1)."""
    if len(frame) != 8:
        raise WireError(f"sequence frame of {len(frame)} bytes, not 8")
    return int.from_bytes(frame, "big", signed=True)


def replay_request(start: int) -> list[bytes]:
    """The frames a DEALER sends the replay ROUTER: everything buffered from ``start`` on."""
    return [b"", start.to_bytes(8, "big")]


def decode_batch(payload: bytes) -> list[dict[str, Any]]:
    """The events of one payload."""
    try:
        batch = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise WireError(f"payload is not msgpack: {exc}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise WireError("payload is not [ts, [events], dp_rank]")
    return [e for e in batch[1] if isinstance(e, dict)]


def apply(index: BlockIndex, source: str, events: list[dict[str, Any]]) -> int:
    """One batch's events into ``index`` as ``source``'s; returns the blocks stored. Events
    of another KV cache group than the first (hybrid models) and of another medium than
    the GPU's (offloading tiers) are left out: a prefix is cached where its first group's
    blocks are, on the device."""
    stored = 0
    for event in events:
        kind = event.get("type")
        if event.get("group_idx") not in (None, 0) or event.get("medium") not in (None, "GPU"):
            continue
        if kind == "BlockStored":
            hashes = event.get("block_hashes")
            tokens = event.get("token_ids")
            size = event.get("block_size")
            if not isinstance(hashes, list) or not isinstance(tokens, list) or type(size) is not int or size < 1:
                continue
            lora = event.get("lora_name")
            stored += index.stored(source, [_hashable(h) for h in hashes], _hashable(event.get("parent_block_hash")),
                                   tokens, size, lora if isinstance(lora, str) else None, event.get("extra_keys"))
        elif kind == "BlockRemoved":
            hashes = event.get("block_hashes")
            if isinstance(hashes, list):
                index.removed(source, [_hashable(h) for h in hashes])
        elif kind == "AllBlocksCleared":
            index.clear(source)
    return stored


def _hashable(value):
    """An engine block hash: an int, or bytes (vLLM's sha256 hashes); lists made tuples."""
    if isinstance(value, list):
        return tuple(value)
    return value
