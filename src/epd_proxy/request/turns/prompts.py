"""Multi-turn KV reuse for the prompt APIs: ``/v1/completions`` and ``/inference/v1/generate``.

A chat turn is recognised by its messages (``multiturn.py``); a prompt API's next turn is
the previous prompt, the answer, and something new, run together in one string or one list
of token ids with no mark where the previous turn ended. So a turn is kept under a digest of
what decode holds, spelled as the client will spell it (the prompt's UTF-8 bytes and the
answer text's; or the prompt's token ids and the answer's), and a request is looked up at
each length a turn of its *prefix* was kept with (:func:`candidate_keys`: a digest of the
prompt fields and the first :data:`PREFIX` bytes names the lengths worth trying). The
longest held turn the new prompt starts with byte for byte is the one continued; the token
check (``multiturn.reuse_params``) then reads only what the new prompt's tokens share with
decode's.

Pure: plain dicts and bytes in, the same out.
"""

from __future__ import annotations

import hashlib
from array import array

import msgspec

from epd_proxy.request.turns.multiturn import CHOICES, NO_IDS, SAMPLING_FIELDS, UNKNOWN, prompt_fields

COMPLETIONS = "/v1/completions"
GENERATE = "/inference/v1/generate"
PROMPT_APIS = frozenset((COMPLETIONS, GENERATE))

# The bytes of a prompt its lengths index is keyed by: a held turn shorter than this is not
# kept (it holds fewer tokens than a prefill would read: multiturn.READ_MIN).
PREFIX = 128

# Fields of a prompt API that are the prompt itself (the material) or only sample from it.
_NOT_FIELDS = SAMPLING_FIELDS | {"prompt", "token_ids", "sampling_params"}


def _fields(body: dict, path: str) -> bytes:
    return path.encode() + b"\x1f" + prompt_fields({k: v for k, v in body.items() if k not in _NOT_FIELDS})


def prompt_material(body: dict, path: str) -> tuple[bytes, bool] | None:
    """The prompt as the bytes a turn is keyed by, and whether it is text (else token ids);
    None for what has no single continuation (a batch of prompts, a ``suffix``, ``echo``)."""
    if path == GENERATE:
        p = body.get("token_ids")
    else:
        if body.get("suffix") is not None or body.get("echo"):
            return None
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            return p.encode("utf-8", "surrogatepass"), True
    if isinstance(p, list) and p and all(type(t) is int and t >= 0 for t in p):
        return array("q", p).tobytes(), False
    return None


def _digest(fields: bytes, material: bytes, scope: bytes) -> bytes:
    return hashlib.blake2b(fields + b"\x1d" + material, digest_size=16, key=scope).digest()


# Every key below is keyed with the request's client key's ``scope`` (tenants/key_scope.py;
# none without keys), as a chat turn's is (multiturn._digest).


def prefix_key(body: dict, path: str, material: bytes, scope: bytes = b"") -> bytes | None:
    """The key of the lengths index for a prompt (None when it is shorter than PREFIX)."""
    if len(material) < PREFIX:
        return None
    return _digest(_fields(body, path) + b"\x1c", material[:PREFIX], scope)


def keep_key(body: dict, path: str, held: bytes, scope: bytes = b"") -> bytes:
    """The key a turn is kept under: its prompt fields and what decode holds (``held``)."""
    return _digest(_fields(body, path), held, scope)


def candidate_keys(body: dict, path: str, material: bytes, lengths: list[int], scope: bytes = b""
                   ) -> list[tuple[bytes, int]]:
    """The keys a held turn of ``lengths`` bytes this prompt extends would be kept under,
    longest first (only lengths shorter than the prompt: something must be new)."""
    fields = _fields(body, path) + b"\x1d"
    out = []
    for n in sorted(lengths, reverse=True):
        if n < len(material):
            out.append((hashlib.blake2b(fields + material[:n], digest_size=16, key=scope).digest(), n))
    return out


class _Choice(msgspec.Struct):
    text: object = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class _Answer(msgspec.Struct):
    choices: list[_Choice] = []
    kv_transfer_params: msgspec.Raw = msgspec.Raw(b"null")


class HeldTurn:
    """What a prompt API's answer says for the next turn."""

    __slots__ = ("params", "held", "ids", "reason")

    def __init__(self, params: dict | None, held: bytes | None, ids: array | None, reason: str) -> None:
        self.params = params  # decode's parameters, if worth keeping
        self.held = held  # the material decode holds: prompt and answer, as the next prompt spells them
        self.ids = ids  # the token ids decode holds
        self.reason = reason  # why not kept ("" when kept)


def read_prompt_answer(body: dict, path: str, answer: bytes) -> HeldTurn:
    """Decode's non-streamed completions or generate answer: the parameters, and the prompt
    and answer they hold (as bytes the next prompt must start with, and as token ids)."""
    try:
        doc = msgspec.json.decode(answer, type=_Answer)
        params = msgspec.json.decode(bytes(doc.kv_transfer_params))
    except (msgspec.DecodeError, msgspec.ValidationError):
        return HeldTurn(None, None, None, UNKNOWN)
    if len(doc.choices) != 1:
        return HeldTurn(None, None, None, CHOICES)
    choice = doc.choices[0]
    return held_turn(body, path, params, choice.text, choice.prompt_token_ids, choice.token_ids)


def held_turn(body: dict, path: str, params: object, text: object, prompt_ids: list[int] | None,
              output: list[int] | None) -> HeldTurn:
    """What decode holds after a prompt API's answer (``text``; the prompt's ids and the
    answer's, as decode reported them), if its ``params`` say it holds blocks."""
    if not isinstance(params, dict) or params.get("do_remote_decode") is not True:
        return HeldTurn(None, None, None, UNKNOWN)
    material = prompt_material(body, path)
    if material is None:
        return HeldTurn(None, None, None, UNKNOWN)
    prompt, is_text = material
    tokens = params.get("remote_num_tokens")
    if is_text:
        if not isinstance(text, str) or prompt_ids is None or output is None or type(tokens) is not int:
            return HeldTurn(None, None, None, NO_IDS)
        held = prompt + text.encode("utf-8", "surrogatepass")
        ids = array("l", prompt_ids)
    else:
        if output is None or type(tokens) is not int:
            return HeldTurn(None, None, None, NO_IDS)
        ids = array("l", array("q", prompt).tolist())
        held = prompt + array("q", output).tobytes()
    ids.extend(output)
    del ids[tokens:]
    return HeldTurn(params, held, ids, "")


def tokenize_prompt_body(body: dict) -> dict:
    """The ``/tokenize`` request for a completions prompt string."""
    p = body["prompt"]
    out = {"prompt": p[0] if isinstance(p, list) else p}
    for k in ("model", "add_special_tokens"):
        if k in body:
            out[k] = body[k]
    return out


def prompt_ids(material: bytes) -> list[int]:
    """A token-id prompt's ids, from its material."""
    return array("q", material).tolist()
