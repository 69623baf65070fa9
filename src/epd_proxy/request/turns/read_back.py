"""Pure: a kept turn read back from the shared state store is untrusted input.

Anyone who can write to the store (``--state-store``) could otherwise hand a prefill any
``kv_transfer_params``: vLLM's NIXL connector connects to the ``remote_host`` and
``remote_port`` they name and reads the blocks they list, checking nothing (docs/protocol.md
§2.10). So an entry is used only when it is well formed and bounded, and its parameters
point at the decode it names, as this process knows that decode: its NIXL address
(``remote_engine_id``, ``remote_host``, ``remote_port``) is one the decode itself sent this
process in an answer's parameters (:class:`DecodeAddresses`; a data parallel decode sends
one per rank). A turn naming a decode not in the pool is never sent anywhere (``decode_gone``).
A turn kept on a decode this process has not yet seen answer with parameters cannot be
verified and is a miss too (the first turns after a start, on a decode this replica has not
yet served). What cannot be checked: that the block ids and ``remote_request_id`` are the
ones decode gave for that conversation. An entry rewritten
within those bounds makes a prefill read blocks of the right decode that belong to another
turn (a wrong answer, never a connection elsewhere), which the token check
(``multiturn.reuse_params``) bounds to a prompt that shares its tokens with the entry's ids,
themselves from the store: the store is trusted no further than that.
"""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict

# The most an entry may hold: a kept turn of a million tokens, with its ids.
MAX_ENTRY_BYTES = 8 << 20
MAX_TOKENS = 1 << 21
# Parameters: a few dozen fields of short values, block id lists of at most MAX_TOKENS ids.
MAX_PARAMS = 32
MAX_TEXT = 512
MAX_GROUPS = 16
MAX_BLOCK_ID = (1 << 31) - 1
SCOPE = 16  # a client key's scope (tenants/key_scope.py)
MAX_KEY = 64  # a conversation's or a prefix's key (a 16-byte digest: multiturn, prompts)
MAX_MODEL = 1024
# The NIXL addresses remembered per decode (one per data-parallel rank).
MAX_ADDRESSES = 64

Address = tuple[object, object, object]


def address_of(params: dict) -> Address:
    """Where a prefill given ``params`` connects to read: the engine, host and port."""
    return params.get("remote_engine_id"), params.get("remote_host"), params.get("remote_port")


class DecodeAddresses:
    """Per decode URL, the NIXL addresses the decode itself sent in its answers' parameters to
    this process (never from the store)."""

    def __init__(self) -> None:
        self._by_url: dict[str, OrderedDict[Address, None]] = {}

    def learn(self, url: str, params: dict) -> None:
        known = self._by_url.setdefault(url, OrderedDict())
        address = address_of(params)
        if address in known:
            known.move_to_end(address)
            return
        if _scalar(address[0]) and _scalar(address[1]) and _scalar(address[2]):
            known[address] = None
            if len(known) > MAX_ADDRESSES:
                known.popitem(last=False)

    def knows(self, url: str) -> bool:
        return url in self._by_url

    def has(self, url: str, params: dict) -> bool:
        known = self._by_url.get(url)
        if known is None:
            return False
        try:
            return address_of(params) in known
        except TypeError:  # an unhashable value: a list where a host should be
            return False

    def forget(self, url: str) -> None:
        self._by_url.pop(url, None)


def _scalar(value: object) -> bool:
    return value is None or type(value) is int or (type(value) is str and len(value) <= MAX_TEXT)


def params_bounded(params: object, tokens: int) -> bool:
    """Whether ``params`` are parameters a decode sends for blocks it keeps: a small dict of
    short scalar values, ``do_remote_decode`` true, ``remote_num_tokens`` the entry's tokens,
    ``remote_block_ids`` lists of block ids, no more than the tokens need."""
    if type(params) is not dict or len(params) > MAX_PARAMS or params.get("do_remote_decode") is not True:
        return False
    if params.get("remote_num_tokens") != tokens or type(params.get("remote_num_tokens")) is not int:
        return False
    for key, value in params.items():
        if type(key) is not str or len(key) > MAX_TEXT:
            return False
        if key == "remote_block_ids":
            if not _block_ids(value, tokens):
                return False
        elif not (_scalar(value) or type(value) is bool or (type(value) is float and math.isfinite(value))):
            return False
    return True


def _block_ids(value: object, tokens: int) -> bool:
    if type(value) is not list or not 0 < len(value) <= MAX_GROUPS:
        return False
    for group in value:
        if type(group) is not list or len(group) > tokens + 1:
            return False
        for block in group:
            if type(block) is not int or not 0 <= block <= MAX_BLOCK_ID:
                return False
    return True


def entry_bounded(tokens: object, chars: object, expires: object, conversation: object, model: object,
                  ids: object, prefix: object) -> bool:
    """Whether an entry's own fields are in their bounds (its parameters apart)."""
    return (type(tokens) is int and 0 <= tokens <= MAX_TOKENS
            and type(chars) is int and 0 <= chars <= MAX_ENTRY_BYTES * 8
            and type(expires) in (int, float) and math.isfinite(expires)  # type: ignore[arg-type]
            and type(conversation) is bytes and 0 < len(conversation) <= MAX_KEY
            and (model is None or (type(model) is str and len(model) <= MAX_MODEL))
            and (ids is None or (type(ids) is bytes and len(ids) % 4 == 0 and len(ids) // 4 <= tokens))
            and (prefix is None or (type(prefix) is bytes and 0 < len(prefix) <= MAX_KEY)))


def ids_of(packed: bytes) -> array:
    """The token ids an entry holds, as packed (4 bytes each; ``entry_bounded`` checked it)."""
    out = array("I")
    out.frombytes(packed)
    return array("l", out)


def lengths_bounded(lengths: list[int], limit: int) -> list[int]:
    """The held lengths worth trying of those read back: positive, at most ``limit`` of them,
    the longest first (each one costs a digest and a call to the store)."""
    return sorted({n for n in lengths if type(n) is int and 0 < n <= MAX_ENTRY_BYTES}, reverse=True)[:limit]


def counter(value: bytes | None) -> int | None:
    """A held-tokens counter read back: an integer within bounds, else None."""
    if value is None or len(value) > 20:
        return None
    try:
        n = int(value)
    except ValueError:
        return None
    return n if -MAX_ENTRY_BYTES * 64 <= n <= MAX_ENTRY_BYTES * 64 else None
