"""Multi-turn KV reuse over a shared state store (``--state-store``, or the ``--workers``
parent): a turn kept by one proxy replica or worker is taken by whichever one gets the next
turn. The same promises as ``multiturn.TurnStore`` (used once, never past its deadline,
held tokens bounded per decode), kept by the store instead of this process's memory:

* a turn's entry (``t:``) is ``put`` with a TTL of its remaining life (decode's TTL less the
  margin: it never outlives decode's blocks) and ``take``-n atomically (GETDEL), leaving a
  mark (``u:``) so a second use is ``used``;
* the conversation's latest turn (``c:``) is swapped on each ``put``: the previous one, if
  still there, is taken and let go (``superseded``); a lookup that misses while its
  conversation has a turn is ``edited``;
* a prompt API's held lengths are a set per prefix (``l:``);
* held tokens per decode are counters per quarter of an entry's life (``h:``), summed over
  the last five: an entry taken or let go early subtracts from its own quarter; one that
  expires unread is forgotten when its quarter's counter expires (at most a quarter of its
  life late). Past ``--kv-reuse-max-held-tokens`` the replica whose ``put`` crossed it lets
  go of its own oldest entries on that decode (it cannot see the others'), so across N
  replicas the bound holds within what one ``put`` adds, approximately;
* ``on`` says some decode answered with parameters, so a replica that has not seen one
  itself still looks its turns up (``TurnStore.active``), read every second until set.

The request path waits on the store at most the guard's budget; a failure is a miss
(``unknown``), the plain path. What the store returns is untrusted input (read_back.py): an
entry, a conversation's latest key, a prefix's lengths or a held-tokens counter that fails
its checks is a miss (``invalid``), counted in ``epd_proxy_state_store_invalid_total``, never
used: never an error, never a prefill told to connect elsewhere."""

from __future__ import annotations

import asyncio
import collections
import hashlib
import time
from array import array
from typing import Callable

import msgspec

from epd_proxy.request.turns.multiturn import BOUND, EDITED, EXPIRED, SUPERSEDED, UNKNOWN, USED, Entry, TurnStore
from epd_proxy.request.turns.outcomes import INVALID
from epd_proxy.request.turns.read_back import (
    MAX_ENTRY_BYTES,
    MAX_KEY,
    SCOPE,
    counter,
    entry_bounded,
    ids_of,
    lengths_bounded,
    params_bounded,
)
from epd_proxy.state.guard import GuardedStore

# How long the "on" mark lives; written again at most every ON_REFRESH seconds.
ON_TTL = 86400.0
ON_REFRESH = 60.0
WATCH_INTERVAL = 1.0
# Buckets of held tokens per entry life.
QUARTERS = 4
# Keys this process put, remembered to let its oldest go past the bound.
OWN = 65536
# The held lengths of a prompt API's prefix tried at most (each one a digest and a store call).
MAX_LENGTHS = 16


class _Stored(msgspec.Struct, array_like=True):
    params: dict
    decode: str
    tokens: int
    chars: int
    expires: float  # wall clock
    conversation: bytes
    model: object
    ids: bytes | None  # array('I') as bytes (token ids, 4 bytes each)
    prefix: bytes | None
    quarter: int
    owner: bytes | None = None  # the client key's scope (key_scope.py), None without keys


def _trust_all(entry: Entry) -> str:
    return ""


def _url_key(url: str) -> bytes:
    return hashlib.blake2b(url.encode(), digest_size=12).digest()


class SharedTurns:
    """``TurnStore``'s entries in a shared store; ``turns`` keeps this process's counters
    (and ``active``)."""

    def __init__(self, store: GuardedStore, turns: TurnStore, verify: Callable[[Entry], str] = _trust_all) -> None:
        self.store = store
        self.turns = turns
        # Whether an entry read back points at a decode as this process knows it ("": it does;
        # else the name it is counted under as invalid): TurnReuse.verify.
        self.verify = verify
        self.life = turns.life
        self.width = max(self.life / QUARTERS, 1.0)
        # Key -> (decode, owner, tokens) of the turns this process put, oldest first.
        self._own: collections.OrderedDict[bytes, tuple[str, bytes | None, int]] = collections.OrderedDict()
        self._on_written = 0.0
        self._watch: asyncio.Task | None = None

    # -- on -------------------------------------------------------------------------------
    def watch(self) -> None:
        """Learn from the store that reuse is on (another replica saw a decode keep blocks)."""
        if self._watch is None and not self.turns.active:
            self._watch = asyncio.get_running_loop().create_task(self._watch_on())

    def announce(self) -> None:
        """Tell every replica that reuse is on (at most every ON_REFRESH seconds)."""
        wall = time.time()
        if wall - self._on_written > ON_REFRESH:
            self._on_written = wall
            task = asyncio.get_running_loop().create_task(self.store.put(self.store.key(b"on", b""), b"1", ON_TTL))
            _BACKGROUND.add(task)
            task.add_done_callback(_BACKGROUND.discard)

    async def _watch_on(self) -> None:
        key = self.store.key(b"on", b"")
        while not self.turns.active:
            if await self.store.get(key) is not None:
                self.turns.active = True
                return
            await asyncio.sleep(WATCH_INTERVAL)

    # -- take -----------------------------------------------------------------------------
    async def take(self, key: bytes, conversation: bytes | None, now: float
                   ) -> tuple[Entry | None, str, Entry | None]:
        """As ``TurnStore.take``: the entry (removed), or None and why; and a stale one."""
        k = self.store.key
        value, marked = await self.store.take(k(b"t", key), k(b"u", key), self.life)
        if value is not None:
            entry, quarter = self._entry(value, now)
            if entry is None:
                return None, INVALID, None
            self._unhold(entry, quarter)
            self._own.pop(key, None)
            if entry.deadline <= now:
                self.turns.count_release(EXPIRED, key)
                return None, EXPIRED, None
            entry.key = key
            return entry, "", None
        if marked:
            return None, USED, None
        gone = self.turns.gone(key)  # let go by this process (another's reasons are not known here)
        if gone is not None:
            return None, gone, None
        if conversation is not None:
            prev = await self.store.get(k(b"c", conversation))
            if prev is not None and not 0 < len(prev) <= MAX_KEY:
                self.store.invalid("conversation")
                prev = None
            if prev is not None and prev != key:
                stale = await self._take_entry(prev, now)
                if stale is not None:
                    self.turns.count_release(SUPERSEDED, prev)
                    return None, EDITED, stale
        return None, UNKNOWN, None

    async def lengths(self, prefix: bytes) -> list[int]:
        found = await self.store.members(self.store.key(b"l", prefix))
        lengths = lengths_bounded(found, MAX_LENGTHS)
        if len(lengths) < len(found) and len(lengths) < MAX_LENGTHS:
            self.store.invalid("lengths")
        return lengths

    # -- put ------------------------------------------------------------------------------
    async def put(self, key: bytes, entry: Entry, now: float, release: Callable[[Entry], None]) -> bool:
        """As ``TurnStore.put``: the entry kept (awaited: the next turn may come at once, to
        any replica); then, in the background, the conversation's previous turn superseded,
        the held tokens counted and the bound kept, what they let go handed to ``release``."""
        ttl = entry.deadline - now
        if ttl <= 0:
            return False
        wall = time.time()
        quarter = int(wall // self.width)
        ids = array("I", entry.ids).tobytes() if entry.ids is not None else None
        stored = _Stored(entry.params, entry.decode, entry.tokens, entry.chars, wall + ttl, entry.conversation,
                         entry.model, ids, entry.prefix, quarter, entry.owner)
        ok, _ = await self.store.put(self.store.key(b"t", key), msgspec.msgpack.encode(stored), ttl)
        if not ok:
            return False
        self._own[key] = (entry.decode, entry.owner, entry.tokens)
        if len(self._own) > OWN:
            self._own.popitem(last=False)
        task = asyncio.get_running_loop().create_task(self._after_put(key, entry, now, quarter, ttl, release))
        _BACKGROUND.add(task)
        task.add_done_callback(_BACKGROUND.discard)
        return True

    async def _after_put(self, key: bytes, entry: Entry, now: float, quarter: int, ttl: float,
                         release: Callable[[Entry], None]) -> None:
        out: list[Entry] = []
        turns, store, k = self.turns, self.store, self.store.key
        if entry.prefix is not None:
            await store.add(k(b"l", entry.prefix), entry.chars, self.life)
        if entry.conversation != key:
            _, prev = await store.put(k(b"c", entry.conversation), key, ttl, old=True)
            if prev is not None and not 0 < len(prev) <= MAX_KEY:
                store.invalid("conversation")
            elif prev is not None and prev != key:
                stale = await self._take_entry(prev, now)
                if stale is not None:
                    out.append(stale)
                    turns.count_release(SUPERSEDED, prev)
        held = await store.incr(self._held_key(entry.decode, quarter), entry.tokens, self.life + self.width)
        turns.held[entry.decode] = turns.held.get(entry.decode, 0) + entry.tokens
        if held is not None and turns.max_held:
            total = await self.held(entry.decode)
            for own in self._victims(entry.decode, key):
                if total <= turns.max_held:
                    break
                old = await self._take_entry(own, now)
                if old is not None:
                    out.append(old)
                    total -= old.tokens
                    turns.count_release(BOUND, own)
        for old in out:
            release(old)

    async def trim(self, decode: str, tokens: int, reason: str, most: int, now: float) -> list[Entry]:
        """``TurnStore.trim`` on the turns this process put on ``decode`` (the oldest first: it
        cannot see the others'; each replica trims its own under the same pressure)."""
        out: list[Entry] = []
        for key in [k for k, (d, _, _) in self._own.items() if d == decode]:
            if tokens <= 0 or len(out) >= most:
                break
            entry = await self._take_entry(key, now)
            if entry is not None:
                out.append(entry)
                tokens -= entry.tokens
                self.turns.count_release(reason, key)
        return out

    async def held(self, decode: str) -> int:
        """The tokens all replicas' kept parameters hold on ``decode`` (within a quarter)."""
        now = int(time.time() // self.width)
        values = await self.store.get_many([self._held_key(decode, q) for q in range(now - QUARTERS, now + 1)])
        total = 0
        for v in values:
            n = counter(v)
            if n is None and v is not None:
                self.store.invalid("held_tokens")
            total += n or 0
        return max(total, 0)

    # -- helpers --------------------------------------------------------------------------
    def _victims(self, decode: str, keep: bytes) -> list[bytes]:
        """This process's turns on ``decode`` in the order the bound lets them go: those of the
        client key holding the most tokens (of what this process put there) first, oldest
        first within a key (TurnStore's rule, on what this process can see)."""
        mine = [(k, owner, tokens) for k, (d, owner, tokens) in self._own.items() if d == decode and k != keep]
        totals: dict[bytes | None, int] = {}
        for _, owner, tokens in mine:
            totals[owner] = totals.get(owner, 0) + tokens
        return [k for k, _, _ in sorted(mine, key=lambda m: -totals[m[1]])]  # stable: oldest first within

    def _held_key(self, decode: str, quarter: int) -> bytes:
        return self.store.key(b"h", _url_key(decode) + quarter.to_bytes(8, "big", signed=True))

    async def _take_entry(self, key: bytes, now: float) -> Entry | None:
        value, _ = await self.store.take(self.store.key(b"t", key))
        self._own.pop(key, None)
        if value is None:
            return None
        entry, quarter = self._entry(value, now)
        if entry is not None:
            entry.key = key
            self._unhold(entry, quarter)
        return entry

    def _unhold(self, entry: Entry, quarter: int) -> None:
        held = self.turns.held.get(entry.decode, 0) - entry.tokens
        if held > 0:
            self.turns.held[entry.decode] = held
        else:
            self.turns.held.pop(entry.decode, None)
        if entry.tokens:
            task = asyncio.get_running_loop().create_task(
                self.store.incr(self._held_key(entry.decode, quarter), -entry.tokens, self.life + self.width))
            _BACKGROUND.add(task)
            task.add_done_callback(_BACKGROUND.discard)

    def _entry(self, value: bytes, now: float) -> tuple[Entry | None, int]:
        """The entry ``value`` holds, if it passes the checks (read_back.py); else None, counted."""
        s = None
        if len(value) <= MAX_ENTRY_BYTES:
            try:
                s = msgspec.msgpack.decode(value, type=_Stored)
            except (msgspec.DecodeError, msgspec.ValidationError):
                pass
        if (s is None or not entry_bounded(s.tokens, s.chars, s.expires, s.conversation, s.model, s.ids, s.prefix)
                or not params_bounded(s.params, s.tokens) or type(s.quarter) is not int
                or not (s.owner is None or len(s.owner) == SCOPE)):
            self.store.invalid("turn")
            return None, 0
        ids = ids_of(s.ids) if s.ids is not None else None
        deadline = now + (s.expires - time.time())  # on this process's clock
        entry = Entry(s.params, s.decode, s.tokens, s.chars, deadline, s.conversation, s.model, ids, s.prefix,
                      owner=s.owner)
        why = self.verify(entry)
        if why:
            self.store.invalid(why)
            return None, 0
        return entry, s.quarter

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()


_BACKGROUND: set[asyncio.Task] = set()
