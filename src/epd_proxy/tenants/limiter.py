"""The tenants' shell: each request's key against its limits, its class, its models.

``Tenants.enter`` runs before admission (a request over its key's limits never takes a
queue place): the key's policy (table.py), its concurrent requests (counted in this
process), then every windowed counter in one ``take`` of the counters' store
(counters.py: in-process, or redis_counters.py shared by replicas). Refused: 429 with
``Retry-After`` and the rate-limit headers its SDK reads (limits.py). Admitted: a
``Ticket`` that the request gives back at its end (:meth:`Tenants.leave`), which settles
its tokens from the answer's usage in the background.

A store that fails (an error, no answer within ``store_timeout``) fails open by default:
the request goes on uncounted; ``store_failure = "closed"`` answers 503 instead. Either
way it is counted (``epd_proxy_tenant_store_failures_total``) and, for a second after a
failure, the store is not asked at all, so a dead store costs no request its timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from epd_proxy.config import ConfigErrors
from epd_proxy.tenants.aliases import ModelAliases, may_use, read_aliases
from epd_proxy.tenants.counters import Counters, LocalCounters, StoreUnavailable
from epd_proxy.tenants.limits import (
    Hit,
    estimate_input_tokens,
    hits,
    key_digest,
    rate_headers,
    refused_by,
    retry_after,
    settlement,
)
from epd_proxy.tenants.table import KeyPolicy, TenantTable, TrafficClass, read_tenants
from epd_proxy.wire.errors import ProxyError

log = logging.getLogger("epd_proxy.tenants")

NO_KEY = "-"  # the label and flow of requests without a client key (no key file may name a key so)
STORE_BACKOFF = 1.0  # seconds the store is not asked after a failure


class Ticket:
    """One admitted request's tenancy: its key, policy and class, the counters it was
    counted in (with their values then) and its input estimate."""

    __slots__ = ("key", "label", "policy", "traffic", "hits", "values", "estimate", "anthropic")

    def __init__(self, key: str, label: str, policy: KeyPolicy, traffic: TrafficClass, anthropic: bool) -> None:
        self.key = key
        self.label = label
        self.policy = policy
        self.traffic = traffic
        self.hits: list[Hit] = []
        self.values: list[int] = []
        self.estimate = 0
        self.anthropic = anthropic

    def queueing(self) -> tuple[str, int, float, bool, str]:
        """How it waits for an admission slot: its flow (the key), class rank, weight, whether
        its class is sheddable, the class's name."""
        traffic = self.traffic
        return self.key, traffic.rank, self.policy.weight, traffic.sheddable, traffic.name

    def headers(self, now: float) -> list[tuple[bytes, bytes]]:
        """The rate-limit headers of its answer (the counters as they stood after it was counted)."""
        return rate_headers(self.hits, self.values, now, self.anthropic) if self.hits else []


class KeyCounts:
    """One metrics label's counts (a key with its own entry, ``default``, or ``-``)."""

    __slots__ = ("admitted", "limited", "forbidden", "input", "output", "inflight")

    def __init__(self) -> None:
        self.admitted = 0
        self.limited: dict[str, int] = {}  # limit -> requests refused by it
        self.forbidden = 0  # 403: a model the key may not use
        self.input = 0  # settled input tokens
        self.output = 0
        self.inflight = 0


class Tenants:
    """Per-key limits, classes and model rules for one process."""

    def __init__(self, table: TenantTable, aliases: ModelAliases | None = None, counters: Counters | None = None,
                 clock: Callable[[], float] = time.time, prefix: str = "epd-proxy:") -> None:
        self.table = table
        self.aliases = aliases
        # The counters' names: under --state-store-prefix, as every key this deployment stores
        # (two deployments sharing one Redis count apart).
        self.counter_prefix = prefix + "rl:"
        self.active = True  # limits and classes apply (a [tenants] table); aliases apply whenever set
        self.counters: Counters = counters if counters is not None else LocalCounters(clock)
        self.shared = counters is not None and not isinstance(counters, LocalCounters)
        # In-process counters are asked without a coroutine (the common case pays no await).
        self.local = self.counters if isinstance(self.counters, LocalCounters) else None
        self.store_url = table.store if self.shared else None  # the store in use (read at start only)
        self.clock = clock
        self.concurrent: dict[str, int] = {}  # key -> requests in progress here
        self.seen: set[str] = set()  # the keys that asked (names from the key file: bounded by it)
        self.counts: dict[str, KeyCounts] = {}  # label -> counts (labels: the table's names, default, -)
        self.store_failures = {"open": 0, "closed": 0}
        self._down_until = 0.0
        self._settling: set[asyncio.Task] = set()

    @classmethod
    def off(cls) -> "Tenants":
        """No tables: nothing applies (a request pays two attribute tests)."""
        tenants = cls(TenantTable())
        tenants.active = False
        return tenants

    def apply_config(self, config) -> None:
        """A reload (a validated config): the new tables for the requests from now on (those
        in flight keep theirs). A changed ``store`` needs a restart."""
        table, aliases = read_config(config)
        if table is not None and table.store != self.store_url:
            log.warning("reload: tenants.store changed: applied at the next restart only (counters %s)",
                        "shared" if self.shared else "in-process")
        self.apply(table, aliases)

    def apply(self, table: TenantTable | None, aliases: ModelAliases | None) -> None:
        self.active = table is not None
        self.table = table or TenantTable()
        self.aliases = aliases
        if table is None:
            return
        log.info("tenants: %d key(s) with their own limits, default %s", len(table.keys),
                 ", ".join(f"{k}={v}" for k, v in table.default.limits.items()) or "unlimited")

    def _counts(self, label: str) -> KeyCounts:
        counts = self.counts.get(label)
        if counts is None:
            counts = self.counts[label] = KeyCounts()
        return counts

    async def enter(self, key: str | None, anthropic: bool, body_bytes: int, headers: dict) -> Ticket:
        """The request's ticket, or ProxyError: 429 over a limit, 503 with the store failed closed.
        ``headers``: the request's (its priority header, if the table names one)."""
        table = self.table
        policy = table.policy(key)
        name = NO_KEY if key is None else key
        label = NO_KEY if key is None else policy.label
        header = table.priority_header
        traffic = table.traffic(policy, headers.get(header) if header is not None else None)
        ticket = Ticket(name, label, policy, traffic, anthropic)
        counts = self._counts(label)
        cap = policy.limits.get("concurrent")
        held = self.concurrent.get(name, 0)
        if cap is not None and held >= cap:
            self._refused(counts, "concurrent")
            raise ProxyError(429, f"key {label!r} has {cap} requests in progress, its concurrent limit; "
                                  f"retry when one ends", code="rate_limit_exceeded", headers=[(b"retry-after", b"1")])
        self.concurrent[name] = held + 1  # taken before any await: two requests cannot both take the last
        if len(policy.limits) > (cap is not None):
            try:
                await self._count(ticket, key, body_bytes, counts)
            except BaseException:
                self._release(name)
                raise
        self.seen.add(name)
        counts.admitted += 1
        counts.inflight += 1
        return ticket

    async def _count(self, ticket: Ticket, key: str | None, body_bytes: int, counts: KeyCounts) -> None:
        """The request counted in its key's windows (``ticket.hits``), or ProxyError 429 (503)."""
        now = self.clock()
        estimate = ticket.estimate = estimate_input_tokens(body_bytes)
        wanted = hits(ticket.policy, key_digest(key), estimate, now, self.counter_prefix)
        local = self.local
        taken = local.take_now(wanted) if local is not None else await self._take(wanted, now)
        if taken is None:
            return  # the store failed open: uncounted
        ok, values = taken
        if not ok:
            hit = refused_by(wanted, values)
            assert hit is not None  # refused: some counter had no room
            self._refused(counts, hit.name)
            wait = retry_after(hit, now)
            raise ProxyError(429, f"key {ticket.label!r} reached its limit of {hit.limit} "
                                  f"{hit.name.replace('_', ' ')}; retry in {wait} s", code="rate_limit_exceeded",
                             headers=[(b"retry-after", b"%d" % wait)] + rate_headers(wanted, values, now,
                                                                                    ticket.anthropic))
        ticket.hits, ticket.values = wanted, values

    def _release(self, name: str) -> None:
        held = self.concurrent.get(name, 1) - 1
        if held > 0:
            self.concurrent[name] = held
        else:
            self.concurrent.pop(name, None)

    def _refused(self, counts: KeyCounts, limit: str) -> None:
        counts.limited[limit] = counts.limited.get(limit, 0) + 1

    async def _take(self, wanted: list[Hit], now: float) -> tuple[bool, list[int]] | None:
        """The store's answer, or None: failed open (nothing counted)."""
        if not wanted:
            return True, []
        if self.shared and now < self._down_until:
            self._failed(None)
            return None
        try:
            return await self.counters.take(wanted)
        except StoreUnavailable as exc:
            self._down_until = now + STORE_BACKOFF
            self._failed(exc)
            return None

    def _failed(self, exc: StoreUnavailable | None) -> None:
        mode = self.table.store_failure
        self.store_failures[mode] += 1
        if exc is not None:
            log.warning("tenants: the counters' store failed (%s); requests are %s until it answers", exc,
                        "admitted uncounted" if mode == "open" else "refused (503)")
        if mode == "closed":
            raise ProxyError(503, "the rate-limit store is unavailable; retry later", headers=[(b"retry-after", b"1")])

    def check_model(self, ticket: Ticket, asked: object, served: object) -> None:
        """403 when the key may not use the model that will run (:func:`may_use`)."""
        allowed = ticket.policy.models
        if allowed is None or may_use(allowed, self.aliases, asked, served):
            return
        raise self._forbidden(ticket.label, asked)

    def check_entry(self, key: str | None, asked: object, catalog) -> None:
        """Before any limit is consulted (``enter``): 403 when ``key`` may not use the model the
        request names (``asked``, resolved as routing will: its alias, the default, the cluster's
        only model when it names none). Nothing counted, nothing spent: a refused request never
        hides behind a 429 nor uses the key's budget. ``catalog``: the cluster's models."""
        policy = self.table.policy(key)
        allowed = policy.models
        if allowed is None:
            return
        served = asked if self.aliases is None else self.aliases.resolve(asked, catalog)
        if served is None:  # the cluster's only model; none known: the key must name one of its own
            bases = catalog.bases
            served = bases[0] if len(bases) == 1 else None
        if not may_use(allowed, self.aliases, asked, served):
            raise self._forbidden(NO_KEY if key is None else policy.label, asked)

    def _forbidden(self, label: str, asked: object) -> ProxyError:
        self._counts(label).forbidden += 1
        what = f"the model `{asked}`" if asked is not None else "a model it does not name (give one in 'model')"
        return ProxyError(403, f"key {label!r} may not use {what}", type="PermissionDeniedError",
                          param="model", code="model_not_allowed")

    def visible(self, key: str | None) -> frozenset[str] | None:
        """The models ``key`` may name (its list), None: any. Only with a [tenants] table."""
        return self.table.policy(key).models if self.active else None

    def model_ids(self, key: str | None, catalog) -> list[str] | None:
        """The model ids (served, and aliases) ``key`` may use, in the catalog's order then the
        aliases': what its unknown-model 404 names. None: any (every id is named)."""
        allowed = self.visible(key)
        if allowed is None:
            return None
        aliases = self.aliases
        ids = [m for m in catalog.parents if may_use(allowed, aliases, m, m)]
        if aliases is not None:
            ids += [a for a, target in aliases.names.items()
                    if a not in ids and target in catalog.parents and may_use(allowed, aliases, a, target)]
        return ids

    def cards(self, key: str | None, cards: tuple[dict, ...]) -> list[dict]:
        """``/v1/models``' cards for ``key``: those ``[model_aliases] listed`` shows, the key's
        only (a key with a model list also sees the aliases its list names)."""
        aliases = self.aliases
        listed = list(cards) if aliases is None else aliases.cards(cards)
        allowed = self.visible(key)
        if allowed is None:
            return listed
        names: dict = aliases.names if aliases is not None else {}
        out = [c for c in listed if may_use(allowed, aliases, c.get("id"), names.get(c.get("id"), c.get("id")))]
        if names:
            shown = {c.get("id") for c in out}
            by_id = {c.get("id"): c for c in cards}
            out += [dict(by_id[target], id=alias) for alias, target in names.items()
                    if alias in allowed and alias not in shown and target in by_id]
        return out

    def engine_priority(self, ticket: Ticket, sent: object) -> int | None:
        """The ``priority`` field the instances get for a request of ``ticket`` whose client sent
        ``sent`` (absent: None). With ``engine_priority``, its class's (:meth:`TenantTable.priority_of`),
        the client's only when higher (vLLM's priority scheduling runs lower values first: a
        client may lower its own priority, never raise it); without, the client's never below 0
        (the engine's default). None: no field to send."""
        floor = self.table.priority_of(ticket.traffic)
        if type(sent) is int and sent > floor:
            return sent
        if floor == 0 and sent is None:
            return None
        return floor

    def leave(self, ticket: Ticket, status: int, tokens: tuple) -> None:
        """The request is over: its concurrent slot freed, its tokens settled in the background."""
        self._release(ticket.key)
        counts = self._counts(ticket.label)
        counts.inflight -= 1
        prompt, completion = tokens[0], tokens[1]
        counts.input += prompt or 0
        counts.output += completion or 0
        if not ticket.hits:
            return
        if prompt is None and status >= 400:
            tokens = (0, 0)  # nothing was served: the estimate is given back
        adds = settlement(ticket.hits, ticket.estimate, tokens)
        if not adds:
            return
        if self.local is not None:
            self.local.add_now(adds)
            return
        task = asyncio.get_running_loop().create_task(self._settle(adds))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle(self, adds: list[tuple[Hit, int]]) -> None:
        if self.clock() < self._down_until:
            self.store_failures["open"] += 1
            return
        try:
            await self.counters.add(adds)
        except StoreUnavailable as exc:
            self._down_until = self.clock() + STORE_BACKOFF
            self.store_failures["open"] += 1
            log.warning("tenants: settling tokens failed (%s)", exc)

    async def status(self) -> dict:
        """``/status``' ``tenants``: per key with its own entry or seen by this process, its
        class and, for each limit, what its counters hold now; the requests in progress here."""
        now = self.clock()
        out: dict = {"store": "shared" if self.shared else "in-process",
                     "store_failures": dict(self.store_failures), "keys": {}}
        table = self.table
        for name in sorted(set(table.keys) | self.seen):
            policy = table.policy(None if name == NO_KEY else name)
            wanted = hits(policy, key_digest(None if name == NO_KEY else name), 0, now, self.counter_prefix)
            try:
                values = await self.counters.read(wanted) if wanted else []
            except StoreUnavailable:
                values = [None] * len(wanted)  # type: ignore[list-item]
            limits = {h.name: {"limit": h.limit, "used": v, "reset": round(h.reset_at, 3)}
                      for h, v in zip(wanted, values)}
            if "concurrent" in policy.limits:
                limits["concurrent"] = {"limit": policy.limits["concurrent"], "used": self.concurrent.get(name, 0)}
            out["keys"][name] = {"policy": policy.label, "class": policy.traffic.name, "weight": policy.weight,
                                 "limits": limits,
                                 "models": sorted(policy.models) if policy.models is not None else None}
        return out

    def collect(self, f: dict[str, list]) -> None:
        """Per label: admitted, refused by each limit, forbidden, settled tokens, in progress;
        the store's failures."""
        for label, c in self.counts.items():
            f["epd_proxy_tenant_requests"] += [[label, "admitted", c.admitted], [label, "forbidden", c.forbidden]]
            f["epd_proxy_tenant_requests"] += [[label, f"limited_{limit}", n] for limit, n in c.limited.items()]
            f["epd_proxy_tenant_tokens"] += [[label, "input", c.input], [label, "output", c.output]]
            f["epd_proxy_tenant_inflight"].append([label, c.inflight])
        f["epd_proxy_tenant_store_failures"] = [[mode, n] for mode, n in self.store_failures.items()]

    async def close(self) -> None:
        if self._settling:
            await asyncio.gather(*self._settling, return_exceptions=True)
        await self.counters.close()



def read_config(config) -> tuple[TenantTable | None, ModelAliases | None]:
    """The config's ``[tenants]`` and ``[model_aliases]`` tables read; ``ConfigErrors`` lists
    every mistake of both."""
    errors: list[str] = []
    table = aliases = None
    if config.tenants is not None:
        try:
            table = read_tenants(config.tenants)
        except ConfigErrors as exc:
            errors += exc.errors
    if config.model_aliases is not None:
        try:
            aliases = read_aliases(config.model_aliases)
        except ConfigErrors as exc:
            errors += exc.errors
    if errors:
        raise ConfigErrors(errors)
    return table, aliases


def check_config(config) -> None:
    """``validate_config``'s check of the tenants' tables."""
    read_config(config)


def build_tenants(config) -> Tenants:
    """A process's tenants: off (``active`` False) without a ``[tenants]`` table; counters in
    Redis when the table names a ``store``, else in the replicas' state store (``--state-store``,
    with its password) when there is one, else in this process."""
    table, aliases = read_config(config)
    counters = None
    if table is not None and (table.store or config.state_store):
        from epd_proxy.state.configured import password
        from epd_proxy.tenants.redis_counters import RedisCounters, redis_client

        url, secret = (table.store, None) if table.store else (config.state_store, password(config))
        counters = RedisCounters(redis_client(url, table.store_timeout, secret), table.store_timeout)
    tenants = Tenants(table or TenantTable(), aliases, counters, prefix=config.state_store_prefix)
    tenants.active = table is not None
    return tenants
