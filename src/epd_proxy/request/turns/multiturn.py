"""Multi-turn KV reuse between decode and prefill (vLLM's bidirectional NIXL transfer).

With ``bidirectional_kv_xfer`` on both NIXL instances, decode keeps a finished request's
blocks (prompt and answer) and says so in its answer's ``kv_transfer_params``
(``do_remote_decode: true``, the block ids, ``remote_num_tokens``, an expiry on decode's
clock). Given to the prefill of the conversation's *next* turn, they let it read those blocks
instead of computing the previous answer again. vLLM checks nothing (docs/protocol.md §2.10):
the parameters are good for one use, only for a prompt that really extends that turn, and only
before decode frees the blocks. This module is the pure part that keeps those promises:

* :func:`keep_key` and :func:`lookup_key`: the key a turn's parameters are kept under, and
  the key a request looks them up with: a digest of everything that makes the prompt's tokens (the model, the tools,
  the template's arguments: every body field but the sampling ones) and of the messages up to
  and including the previous answer, byte for byte. The next turn's messages must reproduce
  the previous prompt and its answer exactly, or the lookup misses;
* :class:`TurnStore`: the parameters by key, taken at most once (a tombstone remembers a
  used key, so a retry, a regeneration or a second request of the conversation at once falls
  back), dropped at their deadline on the proxy's clock, and bounded in tokens per decode;
* :func:`read_answer`: decode's non-streamed chat answer: its parameters, the answer message
  the next turn will carry, and the answer with the parameters replaced by ``null``, so they
  never reach a client.

No I/O and no clock: the pipeline passes the time in.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Protocol

import msgspec

from epd_proxy.request.turns.outcomes import PREFILL_FAILED
from epd_proxy.routing.disaggregation import skips_prefill  # noqa: F401  (the rule, beside decode_alone)
from epd_proxy.wire.blobs import encode_json

# Body fields that do not change the prompt's tokens (sampling and output options, and what
# the proxy itself sets or drops): left out of a turn's key, so a client may change them
# between turns. Every other field counts: an unknown one can only make a lookup miss.
SAMPLING_FIELDS = frozenset((
    "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens", "min_tokens",
    "temperature", "top_p", "top_k", "min_p", "seed", "n", "stop", "stop_token_ids", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logprobs", "top_logprobs", "logit_bias", "user",
    "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "request_id", "priority", "response_format", "structured_outputs", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "guided_decoding_backend", "metadata", "store", "parallel_tool_calls",
    "length_penalty", "kv_transfer_params", "ec_transfer_params", "conversation_id", "service_tier",
    "return_tokens_as_token_ids", "return_token_ids", "bad_words", "allowed_token_ids", "prompt_logprobs",
    "echo", "vllm_xargs",
))

# What decode's parameters carry when it holds blocks for a later reader.
_KEEP_MARK = b'"do_remote_decode"'

# Why the store has no parameters for a key (TurnStore.take; the turn's outcome is named from
# it, outcomes.py).
UNKNOWN = "unknown"  # none for the previous turn here (another worker, a stream, a restart)
EDITED = "edited"  # the conversation's latest turn is known, but this history differs from it
USED = "used"  # already given to a prefill (a retry, a regeneration, a concurrent request)
EXPIRED = "expired"  # past their deadline on the proxy's clock
DECODE_GONE = "decode_gone"  # the decode holding the blocks left, or is out of rotation
# Why an answer's parameters were not kept (epd_proxy_kv_reuse_answers_total{result}): its text
# is not what the next prompt will carry, or there is no single answer to continue.
REASONING = "reasoning"
CHOICES = "choices"
NO_IDS = "no_token_ids"  # the answer came without the token ids the check needs (a stream, Messages)

# Why kept parameters were let go before use (``epd_proxy_kv_reuse_released_total{reason}``).
SUPERSEDED = "superseded"  # the conversation's next turn was kept, or came without them
BOUND = "bound"  # the decode's held tokens passed --kv-reuse-max-held-tokens


class Entry:
    """One turn's parameters, and what they hold where until when."""

    __slots__ = ("params", "decode", "tokens", "chars", "deadline", "conversation", "model", "ids", "prefix",
                 "key", "owner")

    def __init__(self, params: dict, decode: str, tokens: int, chars: int, deadline: float,
                 conversation: bytes, model: object = None, ids: array | None = None,
                 prefix: bytes | None = None, key: bytes | None = None, owner: bytes | None = None) -> None:
        self.params = params  # decode's kv_transfer_params, as it sent them
        self.decode = decode  # the URL of the decode that holds the blocks
        self.tokens = tokens  # remote_num_tokens: the prompt and the answer
        self.chars = chars  # the characters of the messages those tokens are (for estimates)
        self.deadline = deadline  # on the proxy's clock: decode's TTL from receipt, less the margin
        self.conversation = conversation  # its conversation (keep_key), for SUPERSEDED and EDITED
        self.model = model  # the body's model (a release call names it)
        self.ids = ids  # the token ids decode holds (prompt, then answer): what a next prompt must start with
        # A prompt API's turn (turns/prompts.py): its lengths-index key; ``chars`` is then the
        # bytes of what decode holds, as the next prompt spells them.
        self.prefix = prefix
        self.key = key  # a chat turn's key: whether a later request extends it (earlier_keys)
        self.owner = owner  # the scope of the client key whose turn it is (None without keys)


class TurnStore:
    """Parameters by turn key: each used at most once, none past its deadline, at most
    ``max_held`` tokens per decode (0: no bound). Per process: with ``--workers`` a turn that
    lands on another worker finds nothing and falls back.

    Past the bound, the turns let go are the oldest of the client key holding the most tokens
    on that decode (its ``owner``; without keys, one owner: the oldest turns): one key keeping
    turn after turn lets its own go once it holds the most, so it never pushes out another
    key's below its own share (each key keeps at least ``max_held`` over the keys holding
    turns there, when it keeps that much)."""

    def __init__(self, ttl: float, margin: float, max_held: int, capacity: int = 65536,
                 tombstones: int = 4096) -> None:
        self.life = max(0.0, ttl - margin)
        self.max_held = max_held
        self.capacity = capacity
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()  # oldest first
        self._latest: dict[bytes, bytes] = {}  # conversation -> key of its latest entry
        self._used: OrderedDict[bytes, tuple[bytes, int] | None] = OrderedDict()
        # Prompt APIs: prefix key -> {held length: entries and tombstones of that length}.
        self._lengths: dict[bytes, dict[int, int]] = {}
        self._tombstones = tombstones
        self.held: dict[str, int] = {}  # decode URL -> tokens held for entries kept here
        self._held_by: dict[tuple[str, bytes | None], int] = {}  # (decode, owner) -> tokens held
        self.active = False  # some decode answered with parameters: reuse is on in this cluster
        self.released: dict[str, int] = {}  # for /metrics
        # Keys let go unused, and why (a later take names it: expired, bound, ...), as many as _used.
        self._gone: OrderedDict[bytes, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def holding(self) -> dict[str, tuple[int, int]]:
        """Per decode URL: the tokens the kept entries hold there, and their conversations
        (``/status``)."""
        convs: dict[str, set[bytes]] = {}
        for entry in self._entries.values():
            convs.setdefault(entry.decode, set()).add(entry.conversation)
        return {url: (self.held.get(url, 0), len(c)) for url, c in convs.items()}

    def put(self, key: bytes, entry: Entry, now: float) -> list[Entry]:
        """Keep ``entry`` under ``key``; returns the entries let go to make room for it or
        superseded by it (their blocks will not be read through this proxy)."""
        self.active = True
        out = self.expire(now)
        old = self._pop(key)
        if old is not None:  # the same turn answered again (a regeneration): the older answer's go
            out.append(old)
            self.count_release(SUPERSEDED)
        prev = self._latest.get(entry.conversation)
        if prev is not None:
            sup = self._pop(prev)
            if sup is not None:
                out.append(sup)
                self.count_release(SUPERSEDED, prev)
        self._gone.pop(key, None)
        self._entries[key] = entry
        self._latest[entry.conversation] = key
        if entry.prefix is not None:
            self._count_length(entry.prefix, entry.chars, 1)
        held = self.held.get(entry.decode, 0) + entry.tokens
        self.held[entry.decode] = held
        by = (entry.decode, entry.owner)
        self._held_by[by] = self._held_by.get(by, 0) + entry.tokens
        if self.max_held and held > self.max_held:
            while self.held.get(entry.decode, 0) > self.max_held:
                k = self._victim(entry.decode, key)
                if k is None:
                    break
                out.append(self._pop(k))  # type: ignore[arg-type]  # k is a key of _entries
                self.count_release(BOUND, k)
        while len(self._entries) > self.capacity:
            k = next(iter(self._entries))
            out.append(self._pop(k))  # type: ignore[arg-type]
            self.count_release(BOUND, k)
        return out

    def take(self, key: bytes, conversation: bytes | None, now: float) -> tuple[Entry | None, str, Entry | None]:
        """The entry for ``key``, removed (it is good for one use), or None and why; and the
        conversation's entry that this request makes useless (its history went another way),
        removed too, to be let go."""
        entry = self._pop(key)
        if entry is not None and entry.deadline <= now:
            self.count_release(EXPIRED, key)
            self.expire(now)
            return None, EXPIRED, None
        self.expire(now)
        if entry is not None:
            mark = None
            if entry.prefix is not None:
                mark = (entry.prefix, entry.chars)
                self._count_length(entry.prefix, entry.chars, 1)
            self._used[key] = mark
            if len(self._used) > self._tombstones:
                _, old = self._used.popitem(last=False)
                if old is not None:
                    self._count_length(old[0], old[1], -1)
            return entry, "", None
        if key in self._used:
            return None, USED, None
        gone = self._gone.get(key)
        if gone is not None:
            return None, gone, None
        stale = None
        if conversation is not None:
            prev = self._latest.get(conversation)
            if prev is not None:
                stale = self._pop(prev)
                if stale is not None:
                    self.count_release(SUPERSEDED, prev)
                return None, EDITED, stale
        return None, UNKNOWN, None

    def expire(self, now: float) -> list[Entry]:
        """Drop the entries past their deadline (oldest first: deadlines follow arrival)."""
        out: list[Entry] = []
        entries = self._entries
        while entries:
            key, entry = next(iter(entries.items()))
            if entry.deadline > now:
                break
            self._pop(key)
            out.append(entry)
            self.count_release(EXPIRED, key)
        return out

    def drop_decode(self, url: str) -> list[Entry]:
        """The decode at ``url`` left: its blocks are gone (or will be read by nobody)."""
        out = []
        for key in [k for k, e in self._entries.items() if e.decode == url]:
            entry = self._pop(key)
            if entry is not None:
                out.append(entry)
                self.count_release(DECODE_GONE, key)
        self.held.pop(url, None)
        for by in [by for by in self._held_by if by[0] == url]:
            del self._held_by[by]
        return out

    def trim(self, decode: str, tokens: int, reason: str, most: int) -> list[Entry]:
        """Let go of the oldest turns kept on ``decode`` (whoever's), at least ``tokens`` worth
        and at most ``most`` of them (kv_guard.py: the decode's KV is under pressure)."""
        out: list[Entry] = []
        if tokens <= 0 or most <= 0:
            return out
        for key in [k for k, e in self._entries.items() if e.decode == decode]:
            if tokens <= 0 or len(out) >= most:
                break
            entry = self._pop(key)
            if entry is not None:
                out.append(entry)
                tokens -= entry.tokens
                self.count_release(reason, key)
        return out

    def lengths(self, prefix: bytes) -> list[int]:
        """The held lengths of a prompt API's turns (kept or used) under ``prefix``."""
        found = self._lengths.get(prefix)
        return list(found) if found else []

    def _count_length(self, prefix: bytes, length: int, delta: int) -> None:
        counts = self._lengths.setdefault(prefix, {})
        n = counts.get(length, 0) + delta
        if n > 0:
            counts[length] = n
        else:
            counts.pop(length, None)
            if not counts:
                del self._lengths[prefix]

    def _victim(self, decode: str, keep: bytes) -> bytes | None:
        """The turn let go first on ``decode`` past the bound: the oldest of the owner holding
        the most tokens there (``keep``, the turn just kept, never)."""
        owners = sorted(((n, o) for (d, o), n in self._held_by.items() if d == decode),
                        key=lambda no: no[0], reverse=True)
        for _, owner in owners:
            for k, e in self._entries.items():
                if e.decode == decode and e.owner == owner and k != keep:
                    return k
        return None

    def _pop(self, key: bytes) -> Entry | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        by = (entry.decode, entry.owner)
        left = self._held_by.get(by, 0) - entry.tokens
        if left > 0:
            self._held_by[by] = left
        else:
            self._held_by.pop(by, None)
        if entry.prefix is not None:
            self._count_length(entry.prefix, entry.chars, -1)
        if self._latest.get(entry.conversation) == key:
            del self._latest[entry.conversation]
        held = self.held.get(entry.decode, 0) - entry.tokens
        if held > 0:
            self.held[entry.decode] = held
        else:
            self.held.pop(entry.decode, None)
        return entry

    def gone(self, key: bytes) -> str | None:
        """Why the turn under ``key`` was let go unused, if this process let it go."""
        return self._gone.get(key)

    def count_release(self, reason: str, key: bytes | None = None) -> None:
        """Counted for /metrics; with ``key`` remembered, so that a later take names the reason."""
        self.released[reason] = self.released.get(reason, 0) + 1
        if key is not None:  # a later request of that turn is told why (take)
            self._gone[key] = reason
            if len(self._gone) > self._tombstones:
                self._gone.popitem(last=False)


class KVReuse:
    """A request's use of its previous turn's parameters: what its prefill gets, and where a
    prefill that failed with them says so (it then runs again without: PREFILL_FAILED)."""

    __slots__ = ("params", "entry")

    def __init__(self, params: dict, entry: Entry | None = None) -> None:
        self.params = params
        self.entry = entry  # what they came from (freed early when no prefill got them)

    def failed(self, ctx: _Outcome) -> None:
        ctx.kv_outcome = PREFILL_FAILED


class _Outcome(Protocol):
    kv_outcome: str | None  # RequestContext's: the turn's outcome


# -- turn keys ------------------------------------------------------------------------------


def prompt_fields(body: dict) -> bytes:
    """Every body field that makes the prompt's tokens, canonically encoded."""
    return encode_json({k: body[k] for k in sorted(body) if k not in SAMPLING_FIELDS})


def answer_message(content: object, tool_calls: object) -> bytes | None:
    """The part of an assistant message a turn's key covers: its text and its tool calls."""
    if content is None:
        content = ""
    if not isinstance(content, str):
        return None
    return encode_json({"content": content, "tool_calls": tool_calls or None})


_CARRIED = frozenset(("role", "content", "tool_calls"))


def _carried_answer(msg: dict) -> bytes | None:
    """The client's copy of an answer, as :func:`answer_message` sees it; None when it
    carries anything else the template may render (a name, reasoning), which the held
    tokens never had."""
    for k, v in msg.items():
        if k not in _CARRIED and v not in (None, "", [], {}):
            return None
    return answer_message(msg.get("content"), msg.get("tool_calls"))


def _digest(fields: bytes, messages: list, upto: int, answer: bytes, scope: bytes = b"") -> tuple[bytes, bytes]:
    """The key over ``fields``, ``messages[:upto]`` and ``answer``, and the conversation's
    key (the same over the messages up to its first user message); both keyed with the
    request's client key's ``scope`` (tenants/key_scope.py; none without keys): another key
    replaying the same history computes other keys, so it neither finds, takes nor
    supersedes this key's turns, and learns nothing of them."""
    h = hashlib.blake2b(fields, digest_size=16, key=scope)
    conversation = b""
    for i in range(upto):
        msg = messages[i]
        h.update(encode_json(msg))
        h.update(b"\x1e")
        if not conversation and isinstance(msg, dict) and msg.get("role") == "user":
            conversation = h.digest()
    h.update(b"\x1d")
    h.update(answer)
    return h.digest(), conversation or h.digest()


def lookup_key(body: dict, hint: str | None = None, scope: bytes = b"") -> tuple[bytes, bytes, int, int] | None:
    """The key under which this chat request's previous turn would be kept, its
    conversation's key, and the characters before and after the previous answer's end (the
    new part's size, for the local-prefill estimate). None when it has no previous answer
    to continue from (no assistant message, or one the client changed in shape)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    last = -1
    for i in range(len(messages) - 1, -1, -1):
        msg = messages[i]
        if isinstance(msg, dict) and msg.get("role") == "assistant":
            last = i
            break
    if last < 0 or last == len(messages) - 1:
        return None  # nothing answered yet, or the request continues the answer itself
    carried = _carried_answer(messages[last])
    if carried is None:
        return None
    key, conversation = _digest(prompt_fields(body), messages, last, carried, scope)
    if hint:
        conversation = hint_key(hint, scope)
    before = _chars(messages, last + 1)
    return key, conversation, before, _chars(messages, len(messages)) - before


def hint_key(hint: str, scope: bytes = b"") -> bytes:
    """A ``conversation_id``'s conversation key, the client key's (``scope``) like a turn's."""
    return hashlib.blake2b(hint.encode("utf-8", "surrogatepass"), digest_size=16, key=scope).digest()


def earlier_keys(body: dict, scope: bytes = b"") -> set[bytes]:
    """The keys of the turns before the previous one that this chat request carries (one per
    earlier assistant message): a held turn among them is an older turn of this history, not
    an edit of it. Computed only when the store holds another turn of the conversation."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return set()
    last = len(messages) - 1
    while last >= 0 and not (isinstance(messages[last], dict) and messages[last].get("role") == "assistant"):
        last -= 1
    keys = set()
    h = hashlib.blake2b(prompt_fields(body), digest_size=16, key=scope)
    for i in range(last):
        msg = messages[i]
        if isinstance(msg, dict) and msg.get("role") == "assistant":
            carried = _carried_answer(msg)
            if carried is not None:
                turn = h.copy()
                turn.update(b"\x1d")
                turn.update(carried)
                keys.add(turn.digest())
        h.update(encode_json(msg))
        h.update(b"\x1e")
    return keys


def keep_key(body: dict, answer: bytes, hint: str | None = None, scope: bytes = b"") -> tuple[bytes, bytes, int]:
    """The key the next turn will look this turn's answer up with (:func:`lookup_key`), its
    conversation's key, and the characters of the prompt and the answer."""
    messages = body.get("messages")
    messages = messages if isinstance(messages, list) else []
    key, conversation = _digest(prompt_fields(body), messages, len(messages), answer, scope)
    if hint:
        conversation = hint_key(hint, scope)
    return key, conversation, _chars(messages, len(messages)) + len(answer)


def _chars(messages: list, upto: int) -> int:
    size = 0
    for i in range(upto):
        msg = messages[i]
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, str):
            size += len(content)
        elif isinstance(content, list):
            for part in content:
                text = part.get("text") if isinstance(part, dict) else None
                size += len(text) if isinstance(text, str) else 1024
    return size


def estimate_new_tokens(entry: Entry, new_chars: int, new_messages: int = 1) -> int:
    """The tokens a prefill would compute beyond what ``entry`` holds: the new part's
    characters at the entry's own characters per token (the conversation's language and
    tokenizer), plus the template's tokens around each new message and the answer's end."""
    per_char = entry.tokens / entry.chars if entry.chars > 0 else 0.25
    return int(new_chars * per_char + 0.999) + TEMPLATE_TOKENS * (new_messages + 1)


# The tokens a chat template puts around one message (role header, end of turn): a few.
TEMPLATE_TOKENS = 8


# -- decode's answer --------------------------------------------------------------------------


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


# The parameters a decode is sent for a request it prefills itself (the prefill skipped): no
# transfer either way, but blocks kept at the end as for any bidirectional request, so the
# conversation's next turn can still read them.
LOCAL_PREFILL_PARAMS = {"do_remote_decode": False, "do_remote_prefill": False}
