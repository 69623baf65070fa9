"""Deterministic prompts and outputs for the simulator.

Everything here is a pure function of the request body, so a test (or the
benchmark) can compute what a simulated instance will answer without asking
it, and compare a response relayed by the proxy byte for byte.

Prompt analysis
    A prompt is reduced to a *fingerprint* (sha256 over the roles, the text and,
    for each media item, its modality and content key) and a *token count*:

    * chat: per message 1 token + the whitespace-separated words of its text
      parts, plus per media item ``t*h*w // 4`` for an image/video grid and
      ``length // 4`` for audio (the grid is what the encoder reports, see
      :func:`media_metadata`);
    * completions: the whitespace-separated words of ``prompt`` (a list of token
      ids counts its length); at least 1.

    A media item's content key is its content hash (BLAKE3 of the URL, or of the
    part's JSON), whatever ``uuid`` the item carries: a ``uuid`` only names the
    item in vLLM's caches, the model sees the media. An ``*_embeds`` metadata
    reference stands for the item its EC cache entry was encoded from, so an
    instance resolves it through the encoder cache (``analyze``'s
    ``content_of``). A raw item and the reference a proxy rewrites it to (under
    any ``uuid``: the proxy's own content key, or vLLM's EPD proxy's sha256)
    have the same content key and the same grid, so the fingerprint, the token
    count and therefore the output are the same whether a request reaches an
    instance directly or through a proxy (rewritten or not).

Output
    ``n`` tokens drawn from :data:`VOCAB` by a PRNG seeded with the prompt
    fingerprint, the request's ``seed`` and the choice index. ``n`` is
    ``max_completion_tokens`` (chat; it wins) or ``max_tokens`` when given
    (a completions request without it has vLLM's default cap of 16), else
    ``max(default_max_tokens, min_tokens)``; never more than the context left
    after the prompt. A shorter response is a prefix of a longer one.
"""

from __future__ import annotations

import hashlib
import random
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from blake3 import blake3

from epd_proxy.sim.validation import output_cap, plan_output

DEFAULT_MAX_TOKENS = 16

# ASCII words (with JSON-significant characters), accented Latin, CJK, Hangul,
# 3-byte symbols and 4-byte emoji (some of them several code points long).
VOCAB: tuple[str, ...] = (
    " the", " model", " data", " token", " cache", " prefill", " decode", " stream",
    " fast", " and", " of", " to", " in", " is", " a", ",", ".", "\n",
    ' "quoted"', " back\\slash", " tab\there", " 42", " x<y>&z", " ok",
    " café", " naïve", " résumé", " über", " señor", " Ångström", " façade", " élan",
    "你好", "世界", "模型", "数据", "東京", "日本語", "缓存", "解码",
    "안녕", "한국어", " €", " —", " ∑", " →", " ½", " ©",
    " 🙂", "🚀", "👍🏽", "🇫🇷", " 🎉", "🧪", "👩‍💻", " 😀",
    " Straße", " ξένος", " мир", " שלום", " مرحبا", " ñandú", " Øre", " Œuvre",
)
VOCAB_BYTES: tuple[bytes, ...] = tuple(t.encode("utf-8") for t in VOCAB)
# Each token as a JSON string literal (quotes included, UTF-8 unescaped like vLLM).
VOCAB_JSON: tuple[bytes, ...] = tuple(msgspec.json.encode(t) for t in VOCAB)


def _split_offset(encoded: bytes) -> int:
    """An offset inside the first multibyte UTF-8 character, or -1 if all ASCII."""
    for i, b in enumerate(encoded):
        if b >= 0xC0:
            return i + 1
    return -1


# Where to cut a token's JSON literal so that the cut falls inside a character.
VOCAB_SPLIT: tuple[int, ...] = tuple(_split_offset(j) for j in VOCAB_JSON)
_VOCAB_RANGE = range(len(VOCAB))

MEDIA_FAMILY = {
    "image_url": "image", "image_embeds": "image",
    "audio_url": "audio", "input_audio": "audio", "audio_embeds": "audio",
    "video_url": "video", "video_embeds": "video",
}
RAW_MEDIA_TYPES = frozenset(("image_url", "audio_url", "input_audio", "video_url"))
EMBEDS_TYPES = frozenset(("image_embeds", "audio_embeds", "video_embeds"))
_URL_TYPES = frozenset(("image_url", "audio_url", "video_url"))


class PromptError(ValueError):
    """The prompt is malformed (the instance answers 400)."""


# ---------------------------------------------------------------------------------
# Media

_METADATA_SAMPLE = 4096  # characters of a long URL's head and tail that set its metadata


def _media_url(part: dict) -> str | None:
    """The URL of a URL-typed media part (a ``data:`` URL carries the media itself)."""
    kind = part.get("type")
    if kind not in _URL_TYPES:
        return None
    payload = part.get(kind)
    if isinstance(payload, dict) and isinstance(payload.get("url"), str):
        return payload["url"]
    if isinstance(payload, str):
        return payload
    raise PromptError(f"{kind} content part needs an object with a string 'url'")


def media_payload(part: dict) -> bytes:
    """The bytes a raw media item stands for: its URL (a ``data:`` URL carries the
    media itself), or the sorted-key JSON of the part without ``uuid``."""
    url = _media_url(part)
    if url is not None:
        return url.encode("utf-8")
    kind = part.get("type")
    if kind == "input_audio":
        payload = part.get("input_audio")
        if not isinstance(payload, dict) or not isinstance(payload.get("data"), str):
            raise PromptError("input_audio content part needs an object with a string 'data'")
    stripped = {k: v for k, v in part.items() if k != "uuid"}
    return msgspec.json.encode(stripped, order="sorted")


def content_hash(part: dict) -> str:
    """BLAKE3 of the media payload: the engine hash of an item sent without ``uuid`` (vLLM's
    multimodal hasher is BLAKE3 too, over the decoded media; here over the part as sent, which
    makes it the key the proxy derives from the same content)."""
    return blake3(media_payload(part)).hexdigest()


def engine_hash(part: dict, processed: bool) -> str | None:
    """The engine's multimodal hash for a media or ``*_embeds`` part.

    The item's ``uuid`` when given (else the content hash for raw media, None
    for an ``*_embeds`` reference), with ``-processed`` appended when the
    request carries ``mm_processor_kwargs``.
    """
    uuid = part.get("uuid")
    if isinstance(uuid, str) and uuid:
        base = uuid
    elif part.get("type") in RAW_MEDIA_TYPES:
        base = content_hash(part)
    else:
        return None
    return base + "-processed" if processed else base


def content_key(part: dict, processed: bool, mm_hash: str) -> str:
    """What a raw item's answer depends on: its content, whatever ``uuid`` names it (a
    ``uuid`` only keys vLLM's caches; the model sees the pixels). ``mm_hash`` is already
    that key when the part has no ``uuid``; else the content is hashed."""
    uuid = part.get("uuid")
    if not (isinstance(uuid, str) and uuid):
        return mm_hash
    base = content_hash(part)
    return base + "-processed" if processed else base


def media_metadata(part: dict) -> dict:
    """The metadata an encoder reports for a raw media item, derived from its bytes.

    A crc32 of the item's length and its first and last 4 KiB, as a real encoder
    takes an image's size from its header. Hashing all of a 200 KB ``data:`` URL
    took 20 % of the simulator's CPU per E+P+D request with a sha256, and 11 % with
    a crc32, on the core the benchmark's simulator shares with its load generator.
    """
    family = MEDIA_FAMILY[part["type"]]
    url = _media_url(part)
    if url is None:
        sample = media_payload(part)
    elif len(url) > 2 * _METADATA_SAMPLE:
        sample = f"{len(url)}/{url[:_METADATA_SAMPLE]}/{url[-_METADATA_SAMPLE:]}".encode("utf-8")
    else:
        sample = url.encode("utf-8")
    d = zlib.crc32(sample).to_bytes(4, "little")
    h = 4 + 2 * (d[0] % 15)
    w = 4 + 2 * (d[1] % 15)
    if family == "image":
        return {"image_grid_thw": [[1, h, w]]}
    if family == "video":
        return {"video_grid_thw": [[1 + d[2] % 4, h, w]]}
    return {"audio_feature_lengths": [64 + ((d[0] << 8 | d[1]) % 960)]}


def flatten_metadata(metadata: dict) -> dict:
    """Each list value flattened one level, as the proxy writes it into ``*_embeds``.

    Written here again on purpose: the simulator checks what the proxy sends
    against its own reading of the wire format, not against the proxy's code.
    """
    out = {}
    for key, value in metadata.items():
        if isinstance(value, list) and any(isinstance(v, list) for v in value):
            flat: list = []
            for v in value:
                if isinstance(v, list):
                    flat.extend(v)
                else:
                    flat.append(v)
            value = flat
        out[key] = value
    return out


def _ints(value: Any) -> list[int]:
    out: list[int] = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, int) and not isinstance(v, bool):
            out.append(v)
    return out


def media_tokens(family: str, metadata: Any) -> int:
    """Placeholder tokens for one media item, from its metadata."""
    if not isinstance(metadata, dict):
        return 1
    if family in ("image", "video"):
        thw = _ints(metadata.get(f"{family}_grid_thw"))
        n = 1
        for v in thw:
            n *= max(v, 1)
        return max(n // 4, 1) if thw else 1
    lengths = _ints(metadata.get("audio_feature_lengths"))
    return max(sum(lengths) // 4, 1) if lengths else 1


@dataclass(slots=True)
class MediaRef:
    """One media item of a chat prompt, in global order."""

    index: int
    type: str  # the part's type: image_url, image_embeds, ...
    family: str  # image / audio / video
    part: dict
    mm_hash: str | None
    metadata: Any  # raw: derived from the bytes; embeds: what the part carries
    raw: bool
    # The content the answer depends on (the fingerprint's key): a raw item's content hash; a
    # reference's, the content its EC entry was encoded from (else its mm_hash)
    content: str | None = None


@dataclass(slots=True)
class Prompt:
    fingerprint: bytes  # sha256 digest of the normalised prompt
    tokens: int
    media: list[MediaRef]
    exact: bool = False  # given as token ids: vLLM knows its exact length even past the context

    @property
    def hash_hex(self) -> str:
        return self.fingerprint.hex()


def analyze(body: dict, chat: bool, content_of: Callable[[str], str | None] | None = None) -> Prompt:
    """Fingerprint, token count and media items of a request body. ``content_of``: an
    instance's view of the encoder cache (mm_hash -> the content its entry was encoded
    from), which resolves an ``*_embeds`` metadata reference to the item it stands for."""
    h = hashlib.sha256()
    media: list[MediaRef] = []
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            h.update(b"P\x00" + prompt.encode("utf-8"))
            return Prompt(h.digest(), max(len(prompt.split()), 1), media)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
            h.update(b"T\x00" + ",".join(map(str, prompt)).encode())
            return Prompt(h.digest(), len(prompt), media, True)
        if isinstance(prompt, list) and len(prompt) > 1:
            raise PromptError("the simulator supports one prompt per completions request")
        raise PromptError("'prompt' must be a string or a list of token ids")

    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise PromptError("'messages' must be a non-empty list")
    processed = bool(body.get("mm_processor_kwargs"))
    tokens = 0
    for mi, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise PromptError(f"messages[{mi}] must be an object")
        role = msg.get("role")
        if not isinstance(role, str):
            raise PromptError(f"messages[{mi}].role must be a string")
        h.update(b"R\x00" + role.encode("utf-8") + b"\x00")
        tokens += 1
        content = msg.get("content")
        if content is None:
            continue
        if isinstance(content, str):
            h.update(b"S\x00" + content.encode("utf-8") + b"\x00")
            tokens += len(content.split())
            continue
        if not isinstance(content, list):
            raise PromptError(f"messages[{mi}].content must be a string, a list of parts or null")
        for pi, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise PromptError(f"messages[{mi}].content[{pi}] must be an object with a 'type'")
            kind = part["type"]
            if kind == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise PromptError(f"messages[{mi}].content[{pi}].text must be a string")
                h.update(b"S\x00" + text.encode("utf-8") + b"\x00")
                tokens += len(text.split())
            elif kind in MEDIA_FAMILY:
                family = MEDIA_FAMILY[kind]
                raw = kind in RAW_MEDIA_TYPES
                mm_hash = engine_hash(part, processed)
                key: str | None
                if raw:
                    metadata: Any = media_metadata(part)
                    key = content_key(part, processed, mm_hash)  # type: ignore[arg-type]  # raw: a hash
                else:
                    metadata = part.get(kind)
                    if isinstance(metadata, dict) and mm_hash is None:
                        raise PromptError(
                            f"messages[{mi}].content[{pi}]: a {kind} metadata reference needs a 'uuid'")
                    if not isinstance(metadata, dict):
                        # Inline embeddings (a base64 tensor): identified by their bytes.
                        mm_hash = mm_hash or hashlib.sha256(
                            msgspec.json.encode(metadata)).hexdigest()
                    key = (content_of and content_of(mm_hash)) or mm_hash  # type: ignore[arg-type]
                tokens += media_tokens(family, metadata)
                h.update(b"M\x00" + family.encode() + b"\x00" + (key or "").encode() + b"\x00")
                media.append(MediaRef(len(media), kind, family, part, mm_hash, metadata, raw, key))
            else:
                h.update(b"O\x00" + msgspec.json.encode(part, order="sorted") + b"\x00")
                tokens += 1
    return Prompt(h.digest(), tokens, media)



def _word_ids(text: str) -> list[int]:
    return [zlib.crc32(w.encode("utf-8")) for w in text.split()]


def prompt_token_ids(body: dict, chat: bool, prompt: Prompt) -> list[int]:
    """Token ids of an analysed prompt, ``prompt.tokens`` of them, for the prefix cache:
    one per word, one per message (its role), and per media item its placeholder tokens,
    derived from the item's engine hash (vLLM adds the hash to the block's key), so two
    prompts share a prefix exactly when their text and media agree up to there. Stable
    across processes (crc32)."""
    if not chat:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1:
            p = p[0]
        if isinstance(p, list):
            return list(p)
        return _word_ids(p) or [0]  # type: ignore[arg-type]  # validated: a string here
    ids: list[int] = []
    media = iter(prompt.media)
    for msg in body["messages"]:
        ids.append(zlib.crc32(b"\x00role:" + msg["role"].encode("utf-8")))
        content = msg.get("content")
        if content is None:
            continue
        if isinstance(content, str):
            ids += _word_ids(content)
            continue
        for part in content:
            kind = part["type"]
            if kind == "text":
                ids += _word_ids(part["text"])
            elif kind in MEDIA_FAMILY:
                m = next(media)
                seed = zlib.crc32(f"\x00mm:{m.mm_hash}".encode())
                ids += [seed + i for i in range(media_tokens(m.family, m.metadata))]
            else:
                ids.append(zlib.crc32(msgspec.json.encode(part, order="sorted")))
    return ids


def continuation_ids(body: dict, chat: bool, ids: list[int], answer: list[int]) -> list[int]:
    """The token ids of a prompt (``ids``) followed by its answer (``answer``: indices into
    :data:`VOCAB`) as the next turn's prompt spells them, which is what a decode keeps for the
    next turn (bidirectional transfer): on chat, the assistant message's role token and the
    words of its text; on completions, the words of prompt and answer run together (token-id
    prompts: the answer's ids appended)."""
    text = "".join([VOCAB[t] for t in answer])
    if chat:
        return ids + [zlib.crc32(b"\x00role:assistant")] + _word_ids(text)
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1:
        p = p[0]
    if isinstance(p, list):
        return list(p) + list(answer)
    return _word_ids(p + text) or [0]  # type: ignore[operator]  # validated: a string here


def answer_chunk_ids(answer: list[int]) -> list[list[int]]:
    """The ids of :func:`continuation_ids`'s chat answer (the assistant role token, then the
    words of its text) spread over the answer's tokens, as a stream with ``return_token_ids``
    carries them: the role token with the first, each word with the token that ends it (the
    one holding the whitespace after it, or the last token). Concatenated, they are the
    answer's ids."""
    n = len(answer)
    out: list[list[int]] = [[] for _ in range(n)]
    if not n:
        return out
    out[0].append(zlib.crc32(b"\x00role:assistant"))
    ends: list[int] = []  # each token's end offset in the text
    pos = 0
    for t in answer:
        pos += len(VOCAB[t])
        ends.append(pos)
    text = "".join([VOCAB[t] for t in answer])
    j = 0
    for m in _WORD.finditer(text):
        e = m.end()
        if e >= len(text):
            j = n - 1
        else:
            while ends[j] <= e:
                j += 1
        out[j].append(zlib.crc32(m.group().encode("utf-8")))
    return out


_WORD = re.compile(r"\S+")


# ---------------------------------------------------------------------------------
# Output

def _opt_int(body: dict, key: str) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise PromptError(f"'{key}' must be an integer")
    return v


def max_tokens_of(body: dict, chat: bool) -> int | None:
    """The explicit output cap: ``max_completion_tokens`` wins on chat."""
    if chat:
        v = _opt_int(body, "max_completion_tokens")
        if v is not None:
            return v
    return _opt_int(body, "max_tokens")


def output_length(body: dict, chat: bool, default_max_tokens: int = DEFAULT_MAX_TOKENS, *,
                  prompt_tokens: int = 0, max_model_len: int | None = None) -> tuple[int, bool]:
    """(number of output tokens, whether the output ends by length -> finish "length").

    An explicit cap is always reached; without one the simulated model stops by
    itself after ``max(default_max_tokens, min_tokens)`` tokens. A completions
    request without ``max_tokens`` has vLLM's protocol default cap of 16. With
    ``max_model_len``, the output also stops where the context ends.
    """
    max_tokens_of(body, chat)  # type check
    cap, _, implicit = output_cap(body, chat)
    room = float("inf") if max_model_len is None else max_model_len - prompt_tokens
    return plan_output(cap, implicit, _opt_int(body, "min_tokens") or 0, default_max_tokens, room)


def _seed_bytes(body: dict, lora_path: str | None = None) -> bytes:
    """The request's ``seed``; with a LoRA adapter, its path too (other weights, another output)."""
    seed = body.get("seed")
    out = b"none" if seed is None else str(seed).encode()
    return out if lora_path is None else out + b"\x00lora:" + lora_path.encode()


def output_tokens(fingerprint: bytes, seed: bytes, n: int, choice: int = 0) -> list[int]:
    """Indices into :data:`VOCAB` of the ``n`` output tokens of one choice."""
    if n <= 0:
        return []
    d = hashlib.sha256(fingerprint + b"\x00" + seed + b"\x00%d" % choice).digest()
    rng = random.Random(int.from_bytes(d[:16], "big"))
    return rng.choices(_VOCAB_RANGE, k=n)


def expected_tokens(body: dict, *, choice: int = 0, default_max_tokens: int = DEFAULT_MAX_TOKENS,
                    max_model_len: int | None = None, lora_path: str | None = None) -> list[str]:
    """The output tokens (strings) of a full, un-faulted response to ``body``
    (``max_model_len``: the instance's context, when the cap may exceed it; ``lora_path``: the
    path of the LoRA adapter ``body`` names, as the instance that serves it has it)."""
    chat = "messages" in body
    prompt = analyze(body, chat)
    n, _ = output_length(body, chat, default_max_tokens, prompt_tokens=prompt.tokens, max_model_len=max_model_len)
    return [VOCAB[i] for i in output_tokens(prompt.fingerprint, _seed_bytes(body, lora_path), n, choice)]


def expected_text(body: dict, *, choice: int = 0, default_max_tokens: int = DEFAULT_MAX_TOKENS,
                  max_model_len: int | None = None, lora_path: str | None = None) -> str:
    """The text of a full, un-faulted response of a prefill/decode/pd instance to ``body``.

    Chat if ``body`` has ``messages``, completions otherwise. Equal to the
    non-stream ``content``/``text`` and to the concatenated stream deltas.
    """
    return "".join(expected_tokens(body, choice=choice, default_max_tokens=default_max_tokens,
                                   max_model_len=max_model_len, lora_path=lora_path))


def prompt_tokens(body: dict) -> int:
    """The ``usage.prompt_tokens`` the simulator reports for ``body``."""
    return analyze(body, "messages" in body).tokens
