"""Pure: the turns whose answer was a stream without KV parameters, remembered so that the
next turn's outcome names why it has nothing to reuse (``stream_no_params``, outcomes.py).

vLLM 0.32 sends decode's ``kv_transfer_params`` in a non-streamed chat or completions answer
(and in its Responses stream), never in a chat or completions stream: a conversation whose
client streams is never kept there, and its next turn would read as ``not_held``, which
sends an operator after the store or the routing. A stream that ends without parameters
leaves here the key its next turn will ask for (chat: the prompt's fields and messages;
completions and generate: the prompt), in a bounded, oldest-first table; the next turn,
finding nothing held, looks here before it says ``not_held`` or ``unmatched``. One digest
per such stream, and one lookup on a turn that already fell back.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from epd_proxy.request.turns.multiturn import prompt_fields
from epd_proxy.request.turns.prompts import candidate_keys, prefix_key, prompt_material
from epd_proxy.request.turns.prompts import keep_key as prompt_keep_key
from epd_proxy.wire.blobs import encode_json

CAPACITY = 4096  # streams remembered per process: later ones push out the oldest


def history_key(body: dict, upto: int) -> bytes:
    """A chat prompt's key over its fields and ``messages[:upto]``: the key of a request's
    whole history, and of the next turn's history before the answer it carries."""
    h = hashlib.blake2b(prompt_fields(body), digest_size=16)
    for msg in body["messages"][:upto]:
        h.update(encode_json(msg))
        h.update(b"\x1e")
    h.update(b"\x1c")
    return h.digest()


class UnkeptStreams:
    """The keys of turns answered by a stream without parameters, at most ``capacity``."""

    __slots__ = ("capacity", "_keys", "_lengths")

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()
        self._lengths: OrderedDict[bytes, set[int]] = OrderedDict()  # a prompt's prefix key -> lengths

    def __len__(self) -> int:
        return len(self._keys)

    def add_chat(self, body: dict) -> None:
        messages = body.get("messages")
        if isinstance(messages, list) and messages:
            self._add(history_key(body, len(messages)))

    def add_prompt(self, body: dict, path: str) -> None:
        material = prompt_material(body, path)
        prefix = None if material is None else prefix_key(body, path, material[0])
        if material is None or prefix is None:
            return
        self._add(prompt_keep_key(body, path, material[0]))
        self._lengths.setdefault(prefix, set()).add(len(material[0]))
        self._lengths.move_to_end(prefix)
        while len(self._lengths) > self.capacity:
            self._lengths.popitem(last=False)

    def chat_follows(self, body: dict, last_answer: int) -> bool:
        """Whether this chat request's history up to its last answer (at ``last_answer``) was
        a request answered by a stream without parameters."""
        return bool(self._keys) and history_key(body, last_answer) in self._keys

    def prompt_follows(self, body: dict, path: str) -> bool:
        """Whether this prompt extends a prompt answered by a stream without parameters."""
        if not self._lengths:
            return False
        material = prompt_material(body, path)
        prefix = None if material is None else prefix_key(body, path, material[0])
        lengths = None if prefix is None else self._lengths.get(prefix)
        if not lengths or material is None:
            return False
        return any(key in self._keys for key, _ in candidate_keys(body, path, material[0], list(lengths)))

    def _add(self, key: bytes) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
