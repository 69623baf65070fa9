"""Decode's answer read for multi-turn KV reuse (vLLM's bidirectional NIXL transfer), and the
token check: the pure part that reads what a non-streamed answer says for the next turn (its
``kv_transfer_params``, the answer message, the token ids decode holds), takes the parameters
out of what the client gets, and bounds what a prefill is told to read to the tokens the new
prompt really shares with what decode holds (vLLM checks nothing: docs/protocol.md §2.10).
The keys and the store of kept turns are multiturn.py's.
"""

from __future__ import annotations

from array import array

import msgspec

from epd_proxy.request.turns.multiturn import (
    CHOICES,
    NO_IDS,
    REASONING,
    SAMPLING_FIELDS,
    UNKNOWN,
    Entry,
    answer_message,
)

# What decode's parameters carry when it holds blocks for a later reader.
_KEEP_MARK = b'"do_remote_decode"'


class _Message(msgspec.Struct):
    content: object = None
    tool_calls: object = None
    reasoning_content: object = None
    reasoning: object = None


class _Choice(msgspec.Struct):
    message: _Message | None = None
    token_ids: list[int] | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Answer(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    prompt_token_ids: list[int] | None = None
    kv_transfer_params: msgspec.Raw = msgspec.Raw(b"null")


class Answer:
    """What decode's answer says for the next turn."""

    __slots__ = ("body", "params", "message", "reason", "ids")

    def __init__(self, body: bytes, params: dict | None, message: bytes | None, reason: str,
                 ids: array | None = None) -> None:
        self.body = body  # the answer with kv_transfer_params null
        self.params = params  # decode's parameters, if they are worth keeping
        self.message = message  # answer_message() of the one choice
        self.reason = reason  # why not kept ("" when kept)
        self.ids = ids  # the tokens decode holds, prompt and answer (``return_token_ids``)


def carries_params(body: bytes) -> bool:
    """Whether decode's answer holds blocks for a later reader. vLLM writes
    ``kv_transfer_params`` among an answer's last keys, so the common answer without them is
    told by a search of its last bytes, whatever its length (a search of the whole answer
    cost about 3 instructions per byte); anything else is searched whole."""
    if body.find(NO_PARAMS, len(body) - NO_PARAMS_TAIL) >= 0:
        return False
    return body.rfind(_KEEP_MARK) >= 0


NO_PARAMS = b'"kv_transfer_params":null'
NO_PARAMS_TAIL = 160


def read_answer(body: bytes, chat: bool = True, strip_ids: bool = False) -> Answer:
    """Decode's answer with its ``kv_transfer_params`` replaced by ``null`` (every other byte
    as received; with ``strip_ids`` the token ids the proxy asked for too), and for a chat
    answer of one choice without reasoning, the parameters, the answer message to key them
    by and the token ids decode holds."""
    try:
        doc = msgspec.json.decode(body, type=_Answer)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return Answer(strip_params(body), None, None, UNKNOWN)
    raw = bytes(doc.kv_transfer_params)
    out = strip_params(body, raw)
    if strip_ids:
        out = strip_token_ids(out)
    if not chat:
        return Answer(out, None, None, UNKNOWN)
    try:
        params = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return Answer(out, None, None, UNKNOWN)
    if not isinstance(params, dict) or params.get("do_remote_decode") is not True:
        return Answer(out, None, None, UNKNOWN)
    if len(doc.choices) != 1 or doc.choices[0].message is None:
        return Answer(out, None, None, CHOICES)
    msg = doc.choices[0].message
    if msg.reasoning_content or msg.reasoning:
        return Answer(out, None, None, REASONING)  # decode holds reasoning tokens the next prompt lacks
    message = answer_message(msg.content, msg.tool_calls)
    if message is None:
        return Answer(out, None, None, UNKNOWN)
    tokens = params.get("remote_num_tokens")
    prompt, output = doc.prompt_token_ids, doc.choices[0].token_ids
    if type(tokens) is not int or prompt is None or output is None:
        return Answer(out, None, None, NO_IDS)  # nothing to check a next prompt's tokens against
    ids = array("l", prompt)
    ids.extend(output)
    del ids[tokens:]
    return Answer(out, params, message, "", ids)


_ID_LISTS = (b',"prompt_token_ids":[', b',"token_ids":[')


def strip_token_ids(body: bytes) -> bytes:
    """``body`` with the token-id lists ``return_token_ids`` added replaced by ``null``, as
    vLLM writes them when not asked (the lists are flat: the first ``]`` closes each; a JSON
    string cannot hold the unescaped quotes of the keys)."""
    for key in _ID_LISTS:
        at = body.find(key)
        while at >= 0:
            start = at + len(key) - 1
            end = body.find(b"]", start)
            if end < 0:
                break
            body = body[:start] + b"null" + body[end + 1:]
            at = body.find(key, start)
    return body


def common_prefix(held: array, tokens: list[int]) -> int:
    """How many leading tokens ``tokens`` shares with what decode holds."""
    n = min(len(held), len(tokens))
    if held[:n].tolist() == tokens[:n]:
        return n
    lo, hi = 0, n  # held[:lo] matches, held[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if held[:mid].tolist() == tokens[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


# What /tokenize takes of a chat request (vLLM's TokenizeChatRequest): the fields that make
# the prompt.
_TOKENIZE_FIELDS = ("model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
                    "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "tools")


# Fields that change neither the prompt's tokens nor what /tokenize must be told.
_TOKEN_NEUTRAL = SAMPLING_FIELDS | frozenset(_TOKENIZE_FIELDS) | {"cache_salt"}


def tokenize_body(body: dict) -> dict | None:
    """The ``/tokenize`` request for a chat request's prompt; None when the request has a
    field that may change its prompt which ``/tokenize`` does not take (``documents``,
    ``reasoning_effort``, …): its tokens cannot be checked, so nothing is read."""
    for k in body:
        if k not in _TOKEN_NEUTRAL:
            return None
    return {k: body[k] for k in _TOKENIZE_FIELDS if k in body}


class _Tokens(msgspec.Struct):
    tokens: list[int]


def tokens_of(answer: bytes) -> list[int] | None:
    """The token ids of a ``/tokenize`` answer (None if it is not one)."""
    try:
        return msgspec.json.decode(answer, type=_Tokens).tokens
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def reuse_params(entry: Entry, tokens: list[int]) -> dict | None:
    """The parameters for a prefill of ``tokens``: decode's, reading only the tokens the new
    prompt shares with what decode holds (vLLM checks nothing: an answer whose text
    re-tokenizes differently must not be read past its first difference); None when that is
    under ``READ_MIN`` (vLLM would compute it rather than read it)."""
    if entry.ids is None:
        return None
    shared = common_prefix(entry.ids, tokens)
    if shared < READ_MIN:
        return None
    params = dict(entry.params)
    held = params.get("remote_num_tokens")
    if type(held) is not int:
        return None
    if shared < held:
        # vLLM pairs the blocks it reads with the *last* of the blocks named (the prefix it
        # has cached is skipped from the front of its own, the end of the named ones), so
        # reading less means naming fewer blocks: the first ones, up to ``shared``.
        blocks = cut_blocks(params.get("remote_block_ids"), held, shared)
        if blocks is None:
            return None
        params["remote_block_ids"] = blocks
        params["remote_num_tokens"] = shared
    return params


def cut_blocks(block_ids: object, held: int, shared: int) -> list | None:
    """The blocks holding the first ``shared`` of ``held`` tokens, from decode's
    ``remote_block_ids`` (one list per KV-cache group): the block size is not in the
    parameters, so it is inferred from the count (a power of two for which ``held`` tokens,
    or one more for the slot of the last token, fill exactly that many blocks); None when
    that is ambiguous in a way that matters, or with several groups (sliding-window and
    hybrid models clip their lists)."""
    if not isinstance(block_ids, list) or len(block_ids) != 1 or not isinstance(block_ids[0], list):
        return None
    blocks = block_ids[0]
    n = len(blocks)
    if n == 0:
        return None
    keep = set()
    size = 1
    while size <= 1 << 16:
        if n in (-(-held // size), -(-(held + 1) // size)):
            keep.add(-(-shared // size))
        size *= 2
    if len(keep) != 1:
        return None
    return [blocks[:keep.pop()]]


# The fewest tokens worth reading (vLLM's default kv_recompute_threshold: it computes fewer
# itself, and only tells decode it may free the blocks).
READ_MIN = 64


_KEY = b'"kv_transfer_params":'


def strip_params(body: bytes, raw: bytes | None = None) -> bytes:
    """``body`` with its top-level ``kv_transfer_params`` value replaced by ``null`` (as a
    decode without bidirectional transfer answers); ``body`` itself when there is nothing
    to replace. ``raw``: the value's bytes, when already decoded."""
    if raw is None:
        try:
            raw = bytes(msgspec.json.decode(body, type=_Answer).kv_transfer_params)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return body
    if raw == b"null":
        return body
    at = body.rfind(_KEY)
    while at >= 0:
        pos = at + len(_KEY)
        while pos < len(body) and body[pos] in b" \t\r\n":
            pos += 1
        if body.startswith(raw, pos):
            return body[:pos] + b"null" + body[pos + len(raw):]
        at = body.rfind(_KEY, 0, at)
    return body


