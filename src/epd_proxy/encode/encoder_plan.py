"""Encoder sub-requests: batching the items per encoder, and their bodies.

Which encoder gets which item is the encode pool's routing policy's choice
(``routing/``); its ``round-robin`` is the reference's spread, a cursor
shared by all requests (``routing.policies.assign_round_robin``).
Images that land on the same encoder then travel together, up to
``max_batch`` per sub-request; audio and video travel alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Mapping, Sequence, TypeVar

from epd_proxy.encode.multimodal import MediaItem, media_url
from epd_proxy.wire.blobs import is_text
from epd_proxy.wire.ids import hex_id

# Client fields an encoder needs to process media exactly as the consumer
# will (docs/protocol.md §3.1). Everything else, including all text, is dropped.
H = TypeVar("H", bound=Hashable)

_COPIED_FIELDS = ("mm_processor_kwargs", "media_io_kwargs", "priority", "session_id")



@dataclass(slots=True)
class SubRequest:
    """One encoder call: an encoder (an index, or the instance itself) and the items it
    encodes, in order."""

    encoder: Any  # an index, or the instance itself
    items: list[MediaItem] = field(default_factory=list)


def plan_sub_requests(
    items: Sequence[MediaItem], encoders: Sequence[Hashable], max_batch: int
) -> list[SubRequest]:
    """Group items into encoder sub-requests.

    ``encoders[i]`` is the encoder of ``items[i]``. Images on the same
    encoder share a sub-request, in input order, until it holds ``max_batch``
    images (0 = unlimited); then a new one starts for that encoder. Every
    non-image item gets its own sub-request.

    Ordering rule: sub-requests are ordered by the global index of their
    first item, which is the order in which a left-to-right walk opens them.
    For ``[A,A,C,D,A,F]`` on two encoders this gives ``[0,2,4],[1,3,5]`` for
    max_batch 0, the six items in order for 1, and ``[0,2],[1,3],[4],[5]``
    for 2, as the reference tests require.
    """
    if max_batch < 0:
        raise ValueError("max_batch must be >= 0 (0 means unlimited)")
    if len(items) != len(encoders):
        raise ValueError("items and encoders must have the same length")

    subs: list[SubRequest] = []
    open_image_group: dict[Hashable, SubRequest] = {}
    for item, encoder in zip(items, encoders):
        if item.type != "image_url":
            subs.append(SubRequest(encoder, [item]))
            continue
        group = open_image_group.get(encoder)
        if group is None or (max_batch and len(group.items) >= max_batch):
            group = SubRequest(encoder, [])
            open_image_group[encoder] = group
            subs.append(group)
        group.items.append(item)
    return subs


def within_bound(encoders: Sequence[H], outstanding: Mapping[H, int], bound: int) -> list[bool]:
    """Which items fit on their encoder (``--encoder-max-outstanding``).

    ``encoders[i]`` is the encoder placed for item ``i``; ``outstanding`` counts the items
    already in flight to each. In input order, an item fits while its encoder's count, with
    the items of this call that fit before it, is below ``bound`` (0 = no bound), so the
    first items of a request go first and the rest wait for room or go elsewhere.
    """
    if bound <= 0:
        return [True] * len(encoders)
    taken: dict[H, int] = {}
    out = []
    for encoder in encoders:
        n = taken.get(encoder)
        if n is None:
            n = outstanding.get(encoder, 0)
        fits = n < bound
        if fits:
            taken[encoder] = n + 1
        out.append(fits)
    return out


def _encoder_part(item: MediaItem, rewrite: bool) -> dict:
    part = dict(item.part)
    # The bare-string image form is normalised so the engine's parser, which
    # expects ``{"url": ...}``, accepts it; the hash is the same either way.
    if item.type == "image_url" and is_text(part.get("image_url")):
        part["image_url"] = {"url": media_url(part)}
    if rewrite:
        part["uuid"] = item.uuid
    return part


def encoder_body(
    body: dict,
    sub: SubRequest,
    *,
    rewrite: bool,
    transfer_ids: Sequence[str],
    consumer_zmq: str | None,
) -> dict:
    """The chat body for one encoder sub-request (docs/protocol.md §3.1).

    With ``rewrite`` each part carries the proxy ``uuid``, the key the
    consumer will be given in the ``*_embeds`` reference. Without it the part
    is sent as the client wrote it (a client ``uuid`` included, no proxy
    uuid), so the encoder hashes the item exactly as the consumer will hash
    the raw part it receives (docs/protocol.md §4.2).

    No ``max_tokens``: current encoders finish right after encoding.
    ``ec_transfer_params`` is added only for push EC (a ``consumer_zmq``),
    with one ``transfer_id`` per item in sub-request order (docs/protocol.md §2.5).
    """
    out: dict = {}
    if "model" in body:
        out["model"] = body.get("model")
    out["messages"] = [
        {"role": "user", "content": [_encoder_part(i, rewrite) for i in sub.items]}
    ]
    out["stream"] = False
    for key in _COPIED_FIELDS:
        if key in body:
            out[key] = body[key]
    if consumer_zmq:
        if len(transfer_ids) != len(sub.items):
            raise ValueError("one transfer id per sub-request item is required")
        out["ec_transfer_params"] = {
            "consumer_zmq": consumer_zmq,
            "ec_items": [{"transfer_id": t} for t in transfer_ids],
        }
    return out


def encoder_request_id(request_id: str, first_index: int, rand6: str) -> str:
    """``<rid>:<global index of the first item>:<6 random hex>`` (docs/protocol.md §2.2).

    The random tail keeps a retry's sub-requests distinct on the engine.
    """
    return f"{request_id}:{first_index}:{rand6}"


def new_transfer_id() -> str:
    """A fresh 32-hex transfer id; one per item occurrence and attempt (docs/protocol.md §4.6)."""
    return hex_id()


# How long a sub-request may take, in ``--encode-timeout`` units, by the kind of its items
# (docs/architecture.md, "The encode stage"). vLLM fetches a URL's media within its own limits
# before it encodes it (VLLM_IMAGE_FETCH_TIMEOUT 5 s, VLLM_AUDIO_FETCH_TIMEOUT 10 s,
# VLLM_VIDEO_FETCH_TIMEOUT 30 s) and a video's frames are many images' work; an image after the
# first of a batch adds its encoding, well under a second on a GPU.
KIND_UNITS = {"image_url": 1.0, "audio_url": 2.0, "input_audio": 2.0, "video_url": 4.0}
BATCHED_IMAGE_UNITS = 0.1


def sub_request_timeout(items: Sequence[MediaItem], unit: float) -> float:
    """The timeout of one encoder sub-request of ``items`` (one audio or video item, or a
    batch of images), ``unit`` being ``--encode-timeout``: one image's."""
    kind = max(KIND_UNITS.get(i.type, 1.0) for i in items)
    return unit * (kind + BATCHED_IMAGE_UNITS * (len(items) - 1))
