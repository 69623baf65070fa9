"""Finding the media items in a chat body, and the keys they are cached under.

The encoder fan-out, the matching of encoder output and the rewrite to
``*_embeds`` (``ec_match.py``) all
address items by one global order: messages in order, then each list-typed
``content`` in order (docs/protocol.md §4.1). :func:`collect_media` defines that order
once and everything downstream indexes into its result, so the three stages
cannot disagree about which item is which.

Pure functions over plain dicts; the client's body is never mutated.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import replace as _replace
from typing import TYPE_CHECKING

from blake3 import blake3

from epd_proxy.wire.blobs import URL_MEDIA_TYPES, encode_json_sorted, is_text, text_bytes
from epd_proxy.wire.errors import bad_request

if TYPE_CHECKING:  # pragma: no cover - typing only
    from epd_proxy.wire.blobs import Blob

MEDIA_TYPES = ("image_url", "audio_url", "input_audio", "video_url")

# What each media type becomes once the encoder has produced it (docs/protocol.md §4.1).
EMBEDS_TYPES = {
    "image_url": "image_embeds",
    "audio_url": "audio_embeds",
    "input_audio": "audio_embeds",
    "video_url": "video_embeds",
}

# Parts that reference an item by ``uuid`` without carrying the media itself.
_EMBEDS_PART_TYPES = frozenset(("image_embeds", "audio_embeds", "video_embeds"))

# Media whose identity is a URL; the rest are hashed by their JSON (docs/protocol.md §4.2).
_URL_TYPES = frozenset(URL_MEDIA_TYPES)

# Part types vLLM's chat parser knows. Anything else would be rejected by the
# engine after the encoders already ran, so we reject it up front with a
# clear ``param``.
KNOWN_PART_TYPES = frozenset(
    (
        "text",
        "image_url",
        "audio_url",
        "input_audio",
        "video_url",
        "image_embeds",
        "audio_embeds",
        "video_embeds",
        "file",
        "refusal",
        "input_text",
        "thinking",
    )
)


@dataclass(frozen=True, slots=True)
class MediaItem:
    """One media part of the request, located by its global position.

    ``part`` is the client's own dict (not a copy): it is only ever read.
    """

    index: int
    message_index: int
    part_index: int
    type: str
    part: dict
    uuid: str


def _digest_hex(data: bytes | memoryview) -> str:
    """BLAKE3 in hex (64 digits): collision-resistant as sha256 is, and about three times
    faster on a 150 KiB data URL (docs/benchmarks.md, "The media content key"); it is also
    the hash vLLM's own multimodal hasher uses."""
    return blake3(data).hexdigest()


def media_url(part: dict) -> str | Blob | None:
    """The URL of a URL-typed media part, or None.

    Accepts both ``{"url": ...}`` and the bare-string form some OpenAI clients
    send for ``image_url``.
    """
    kind = part.get("type")
    if kind not in _URL_TYPES:
        return None
    payload = part.get(kind)
    if isinstance(payload, dict):
        url = payload.get("url")
        return url if is_text(url) else None
    if kind == "image_url" and is_text(payload):
        return payload
    return None


def content_uuid(part: dict) -> str:
    """A content-derived cache key for a media part (docs/protocol.md §4.2).

    It must depend on the content, never on the request, or the EC cache and
    the engine's multimodal hash would miss on every request. URL media hash
    the URL; the rest hash their sorted-key JSON. A ``uuid`` key in the part
    is left out of the JSON so that ``"uuid": null`` / ``""`` does not change
    the key.
    """
    url = media_url(part)
    if url is not None:
        return _digest_hex(text_bytes(url))
    if "uuid" in part:
        part = {k: v for k, v in part.items() if k != "uuid"}
    return _digest_hex(encode_json_sorted(part))


# A client's uuid becomes this prefix plus its BLAKE3 digest, so it can never equal a key the
# proxy derives from content (64 hex digits) nor the engine's own content hash, is the
# same on encoder and consumer, and is a safe file name for connectors that store items
# under their key (ECExampleConnector), whatever the client wrote.
CLIENT_KEY_PREFIX = "client-"


def client_key(uuid: str, scope: bytes | None = None) -> str:
    """The cache key for a client-chosen ``uuid``: namespaced, never a content key. With
    client keys, ``scope`` is the request's key's (tenants/key_scope.py, 16 bytes): two keys
    sending the same uuid never name the same item, so neither can plant the features the
    other's request reads, nor read the other's by naming its uuid."""
    data = uuid.encode("utf-8", "surrogatepass")
    return CLIENT_KEY_PREFIX + _digest_hex(data if scope is None else scope + data)


def _client_uuid(part: dict, param: str) -> str | None:
    """The client's own ``uuid`` on a part, if it set a usable one."""
    value = part.get("uuid")
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise bad_request("'uuid' must be a string", f"{param}.uuid")
    return value


def _item_uuid(part: dict, param: str, ignore_client_uuids: bool, scope: bytes | None) -> str:
    client = _client_uuid(part, param)
    if client is not None and not ignore_client_uuids:
        return client_key(client, scope)
    return content_uuid(part)


def _check_media_payload(part: dict, kind: str, param: str) -> None:
    payload = part.get(kind)
    if kind == "input_audio":
        if not isinstance(payload, dict) or not is_text(payload.get("data")):
            raise bad_request(
                "input_audio content part needs an object with a string 'data'",
                param,
            )
        return
    if kind == "image_url" and is_text(payload):
        return
    if not isinstance(payload, dict) or not is_text(payload.get("url")):
        raise bad_request(
            f"{kind} content part needs an object with a string 'url'", param
        )


def _scan(body: dict, ignore_client_uuids: bool, scope: bytes | None = None
          ) -> tuple[list[MediaItem], list[tuple[int, int]]]:
    """The media items, and where a part (media or ``*_embeds``) carries a ``uuid`` key."""
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")

    items: list[MediaItem] = []
    with_uuid: list[tuple[int, int]] = []
    for mi, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request("each message must be an object", f"messages[{mi}]")
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise bad_request(
                "message content must be a string, a list of parts or null",
                f"messages[{mi}].content",
            )
        for pi, part in enumerate(content):
            param = f"messages[{mi}].content[{pi}]"
            if not isinstance(part, dict):
                raise bad_request("each content part must be an object", param)
            kind = part.get("type")
            if not isinstance(kind, str):
                raise bad_request("content part needs a string 'type'", param)
            if kind not in KNOWN_PART_TYPES:
                raise bad_request(f"unknown content part type {kind!r}", param)
            if "uuid" in part and (kind in EMBEDS_TYPES or kind in _EMBEDS_PART_TYPES):
                with_uuid.append((mi, pi))
            if kind not in EMBEDS_TYPES:
                continue
            _check_media_payload(part, kind, param)
            items.append(
                MediaItem(
                    index=len(items),
                    message_index=mi,
                    part_index=pi,
                    type=kind,
                    part=part,
                    uuid=_item_uuid(part, param, ignore_client_uuids, scope),
                )
            )
    return items, with_uuid


def collect_media(body: dict, *, ignore_client_uuids: bool = False) -> list[MediaItem]:
    """Every media item of a chat body, in global order, validated.

    Raises a 400 :class:`~epd_proxy.wire.errors.ProxyError` naming the offending
    ``param`` for shapes that would otherwise fail later, inside an encoder
    or the decoder, with a less useful error. An item's ``uuid`` is the
    namespaced :func:`client_key` of the client's own ``uuid`` if it sent one
    (and client uuids are not ignored), else its :func:`content_uuid`.
    """
    return _scan(body, ignore_client_uuids)[0]


def own_media(body: dict, *, ignore_client_uuids: bool = False, scope: bytes | None = None
              ) -> tuple[dict, list[MediaItem]]:
    """:func:`collect_media`, and the body every stage gets in place of the client's.

    No client ``uuid`` reaches an engine as written: on media and ``*_embeds``
    parts it is replaced by its :func:`client_key` (or removed when client
    uuids are ignored, so encoder and consumer both key the item by its
    content). Otherwise a client could name the key of someone else's image
    and poison, or read, the encoder cache. With client keys the key is the
    request's key's too (``scope``): an ``*_embeds`` part carrying only a uuid (vLLM
    then looks the item up by it in its caches) reaches only what a request of the
    same key sent under that uuid. Without any ``uuid`` in the body (the usual case)
    the body and items are returned as they are.
    """
    items, with_uuid = _scan(body, ignore_client_uuids, scope)
    if not with_uuid:
        return body, items
    messages = list(body["messages"])
    new_parts: dict[tuple[int, int], dict] = {}
    for mi, pi in with_uuid:
        message = messages[mi]
        if message is body["messages"][mi]:
            message = messages[mi] = {**message, "content": list(message["content"])}
        part = {k: v for k, v in message["content"][pi].items() if k != "uuid"}
        client = _client_uuid(message["content"][pi], f"messages[{mi}].content[{pi}]")
        if client is not None and not ignore_client_uuids:
            part["uuid"] = client_key(client, scope)
        message["content"][pi] = new_parts[(mi, pi)] = part
    items = [
        _replace(item, part=new_parts[(item.message_index, item.part_index)])
        if (item.message_index, item.part_index) in new_parts else item
        for item in items
    ]
    return {**body, "messages": messages}, items
