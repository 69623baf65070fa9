"""LoRA adapters loaded and unloaded on instances: vLLM's runtime routes, called by the proxy.

Two callers: the admin API (``POST /v1/load_lora_adapter``, ``/v1/unload_lora_adapter``
through the proxy: every instance of the adapter's base model, or the ones named) and the
request path (a request naming an adapter no instance has, that a configured source knows:
``--lora-source NAME=PATH``, ``--lora-dir DIR``). Each instance is asked with vLLM's own body
(``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` must be on there), and what it serves is read again right
after (``HealthChecks.learn_models``, probes.py), so the next request routes with the new models.

Loads on demand are single-flight per adapter (concurrent requests wait on one load), at most
``--max-lora-loads`` at once, each bounded by ``--lora-load-timeout``; a failed one is
remembered for ``FAILED_TTL`` seconds so that a burst of requests for an adapter that cannot be
loaded does not become a burst of loads. The adapter goes to one instance per role (prefill
and decode: KV computed with an adapter is valid only with it), the first in its affinity
order (``routing/lora_affinity.py``) among the healthy instances of its base model, where its
next requests go too.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

import msgspec

from epd_proxy.http import Headers
from epd_proxy.http.transport import TransportTimeouts, UpstreamError
from epd_proxy.instances.instance import Instance
from epd_proxy.instances.models import ModelCatalog
from epd_proxy.instances.pool import InstancePool
from epd_proxy.routing.lora_affinity import AdapterAffinity
from epd_proxy.state.guard import GuardedStore
from epd_proxy.wire.errors import ProxyError

log = logging.getLogger("epd_proxy.adapters")

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
ADAPTER_ROLES = ("prefill", "decode")  # the roles that run an adapter (encoders run the base model)
FAILED_TTL = 5.0  # seconds a failed load on demand is answered from memory
MAX_PENDING = 1024  # adapters waiting for a load on demand at once (beyond: 503)
# What an instance without the runtime LoRA routes means: vLLM registers them only with this
# variable in its environment, and FastAPI answers any route it lacks 404 {"detail": "Not Found"}.
NO_RUNTIME_LORA = ("the instance has no runtime LoRA routes: start vLLM with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True "
                   "in its environment (and --enable-lora)")

CLAIM_POLL = 0.05  # seconds between looks at another proxy's load in flight


@dataclass(frozen=True, slots=True)
class Outcome:
    """One instance's answer to a load or unload (status None: it did not answer)."""

    role: str
    url: str
    status: int | None
    body: bytes

    @property
    def ok(self) -> bool:
        return self.status == 200

    def message(self) -> str:
        """The instance's own message (vLLM's envelope, else its text)."""
        if self.status is None:
            return self.body.decode("utf-8", "replace")
        try:
            data = msgspec.json.decode(self.body)
            if isinstance(data, dict):
                err = data.get("error")
                if isinstance(err, dict) and isinstance(err.get("message"), str):
                    return err["message"]
                if isinstance(data.get("detail"), str):
                    if self.status == 404 and data["detail"] == "Not Found":  # the route itself is missing
                        return f"HTTP 404: Not Found ({NO_RUNTIME_LORA})"
                    return f"HTTP {self.status}: {data['detail']}"
        except msgspec.DecodeError:
            pass
        return self.body[:300].decode("utf-8", "replace") or f"HTTP {self.status}"


def aggregate(name: str, verb: str, outcomes: Sequence[Outcome]) -> tuple[int, bytes, bytes]:
    """The answer to a load or unload over ``outcomes``, in vLLM's shape: every instance
    succeeded: 200 and vLLM's plain text; else the first failure's status (502 when an
    instance did not answer) with the envelope, its message naming how many succeeded, and
    ``instances``: each one's URL, role, status and message. (status, body, content type)"""
    if outcomes and all(o.ok for o in outcomes):
        done = "added" if verb == "load" else "removed"
        return 200, f"Success: LoRA adapter '{name}' {done} successfully.".encode(), b"text/plain; charset=utf-8"
    failed = [o for o in outcomes if not o.ok]
    first = failed[0] if failed else None
    status = 404 if first is None else (first.status or 502)
    if first is None:
        message = f"no instance to {verb} LoRA adapter '{name}' on"
    else:
        message = (f"{verb} of LoRA adapter '{name}' succeeded on {len(outcomes) - len(failed)} of "
                   f"{len(outcomes)} instances; the {first.role} instance answered: {first.message()}")
    err = ProxyError(status, message)
    body = err.envelope()
    body["instances"] = [{"url": o.url, "role": o.role, "status": o.status,
                          "message": "ok" if o.ok else o.message()} for o in outcomes]
    return status, msgspec.json.encode(body), b"application/json"


def valid_name(name: object) -> bool:
    """An adapter name a source may be asked for: a plain name, never a path."""
    return (type(name) is str and 0 < len(name) <= 255 and "/" not in name and "\\" not in name
            and "\x00" not in name and name not in (".", ".."))


def source_of(name: str, sources: dict[str, str], directory: str | None) -> tuple[str, str | None] | None:
    """Where adapter ``name`` is loaded from: (path, its base model as its ``adapter_config.json``
    names it, if read), from ``--lora-source`` first, else ``--lora-dir`` (``DIR/NAME`` holding
    a LoRA ``adapter_config.json``, as vLLM's filesystem resolver requires); None: nowhere."""
    if not valid_name(name):
        return None
    path = sources.get(name)
    if path is not None:
        return path, _base_in(path)
    if directory:
        path = os.path.join(directory, name)
        config = _adapter_config(path)
        if config is not None and config.get("peft_type") == "LORA":
            base = config.get("base_model_name_or_path")
            return path, base if isinstance(base, str) else None
    return None


def _adapter_config(path: str) -> dict | None:
    try:
        with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _base_in(path: str) -> str | None:
    config = _adapter_config(path)
    base = config.get("base_model_name_or_path") if config else None
    return base if isinstance(base, str) else None


def base_for(catalog: ModelCatalog, wanted: str | None) -> str:
    """The served base model an adapter goes on: ``wanted`` when it is a base id or a base's
    ``root`` (an adapter_config's ``base_model_name_or_path`` is the model's path), else the
    cluster's only base model; ProxyError otherwise."""
    bases = catalog.bases
    if wanted:
        if wanted in bases:
            return wanted
        for card in catalog.cards:
            if card.get("id") in bases and card.get("root") == wanted:
                return card["id"]
    if len(bases) == 1:
        return bases[0]
    if not bases:
        raise ProxyError(503, "no instance has said which models it serves yet; retry shortly", retryable=False)
    raise ProxyError(400, f"this cluster serves several base models ({', '.join(bases)}); "
                          f"name one in 'base_model'", param="base_model")


class Adapters:
    """Loads and unloads adapters on instances; loads on demand for the request path."""

    def __init__(self, pools: dict[str, InstancePool], headers: Headers, *, timeout: float = 30.0,
                 sources: dict[str, str] | None = None, directory: str | None = None, max_loads: int = 4,
                 learn_timeout: float = 2.0, shared: GuardedStore | None = None) -> None:
        self.pools = {r: pools[r] for r in ADAPTER_ROLES if r in pools}
        # Loads in flight per instance, claimed in the state store every replica and worker
        # shares: of several proxies asking for one unloaded adapter, one loads it per instance.
        self.shared = shared
        self._headers = [(b"content-type", b"application/json"), *headers]
        self.timeout = timeout
        self.sources = dict(sources or {})
        self.directory = directory
        self._learn_timeout = learn_timeout
        self._slots = asyncio.Semaphore(max_loads)
        self._pending: dict[str, asyncio.Task] = {}
        self._failed: dict[str, tuple[float, ProxyError]] = {}
        self._affinity = AdapterAffinity()
        self.loads_on_demand = 0  # adapters loaded because a request named them
        self.load_failures = 0
        # (trigger: admin | on_demand, verb: load | unload, outcome: ok | failed) -> instance calls
        self.calls: dict[tuple[str, str, str], int] = {}

    @property
    def catalog(self) -> ModelCatalog:
        return next(iter(self.pools.values())).served.directory.current

    @property
    def pending(self) -> int:
        """Adapters being loaded on demand now."""
        return len(self._pending)

    @property
    def on_demand(self) -> bool:
        return bool(self.sources or self.directory)

    # -- calls to instances ----------------------------------------------------------------
    async def call(self, path: str, body: dict, targets: Iterable[tuple[str, Instance]],
                   trigger: str = "admin") -> list[Outcome]:
        """``path`` (load or unload) with ``body`` on every target at once; each instance's models
        read again after it answered. Each call is counted (``trigger``: admin or on_demand)."""
        data = msgspec.json.encode(body)
        outcomes = list(await asyncio.gather(*(self._call(path, data, role, inst) for role, inst in targets)))
        verb = "load" if path == LOAD else "unload"
        for o in outcomes:
            key = (trigger, verb, "ok" if o.ok or _already(o) else "failed")
            self.calls[key] = self.calls.get(key, 0) + 1
        return outcomes

    async def _call(self, path: str, data: bytes, role: str, inst: Instance) -> Outcome:
        t = TransportTimeouts(connect=min(5.0, self.timeout), headers=self.timeout, idle=self.timeout)
        try:
            async with asyncio.timeout(self.timeout):
                status, _, out = await inst.connections.fetch("POST", path, body=data, headers=self._headers,
                                                              timeouts=t)
        except (UpstreamError, TimeoutError, OSError) as exc:
            return Outcome(role, inst.url, None, (str(exc) or type(exc).__name__).encode())
        if status == 200 or status == 400:  # 400: it may have it already: what it serves is news either way
            await self.pools[role].checks.learn_models(inst, self._learn_timeout)
        return Outcome(role, inst.url, status, out)

    def instances_of(self, base: str | None, adapter: str | None = None) -> list[tuple[str, Instance]]:
        """Every instance (prefill, decode) serving ``base``, or holding ``adapter``; an instance
        whose models are not known yet counts when only the base is asked for."""
        out = []
        for role, pool in self.pools.items():
            for inst in pool.instances:
                served = inst.served
                if adapter is not None:
                    if served is not None and adapter in served.parents:
                        out.append((role, inst))
                elif served is None or served.parents.get(base or "", "") is None:
                    out.append((role, inst))
        return out

    # -- on demand -----------------------------------------------------------------------------
    def loadable(self, name: object) -> bool:
        """Whether a request naming ``name`` (a model no instance serves) may load it first."""
        return self.on_demand and valid_name(name) and (
            name in self.sources or self.directory is not None)

    async def ensure(self, name: str) -> None:
        """Adapter ``name`` loaded on the instances its requests will use (single-flight); ProxyError
        when it cannot be: 404 when no source has it, else the load's failure."""
        failed = self._failed.get(name)
        if failed is not None:
            if time.monotonic() < failed[0]:
                raise failed[1]
            del self._failed[name]
        task = self._pending.get(name)
        if task is None:
            if len(self._pending) >= MAX_PENDING:
                raise ProxyError(503, "too many LoRA adapters are being loaded; retry shortly", retryable=False)
            task = self._pending[name] = asyncio.get_running_loop().create_task(self._load_on_demand(name))
            task.add_done_callback(lambda _t: self._pending.pop(name, None))
        await asyncio.shield(task)

    async def _load_on_demand(self, name: str) -> None:
        try:
            await self._load_now(name)
        except ProxyError as err:
            self.load_failures += 1
            if len(self._failed) >= MAX_PENDING:
                self._failed.clear()
            self._failed[name] = (time.monotonic() + FAILED_TTL, err)
            log.warning("LoRA adapter %s not loaded on demand: %s", name, err.message)
            raise

    async def _load_now(self, name: str) -> None:
        found = source_of(name, self.sources, self.directory)
        if found is None:
            raise self.catalog.not_found(name)
        path, wanted = found
        async with self._slots:
            if self.catalog.parents.get(name) is not None:
                return  # loaded meanwhile (another request, an operator)
            base = base_for(self.catalog, wanted)
            targets = self.targets(name, base)
            outcomes = await self._load_claimed(name, {"lora_name": name, "lora_path": path}, targets)
        bad = [o for o in outcomes if not o.ok and not _already(o)]
        if bad:
            o = bad[0]
            raise ProxyError(503 if o.status is None else 502,
                             f"LoRA adapter `{name}` could not be loaded on the {o.role} instance: {o.message()}",
                             retryable=False)
        self.loads_on_demand += 1
        log.info("LoRA adapter %s loaded on demand from %s on %d instance(s)", name, path, len(outcomes))

    async def _load_claimed(self, name: str, body: dict, targets: list[tuple[str, Instance]]) -> list[Outcome]:
        """Load on ``targets``; with a shared store, only where this process claims the load
        (``a:``, for the load's timeout) and, where another proxy claimed it, wait for that load
        (the instance's models read again until the adapter shows, or the claim is gone and the
        load is this process's after all)."""
        shared = self.shared
        if shared is None:
            return await self.call(LOAD, body, targets, "on_demand")
        keys = [shared.key(b"a", hashlib.blake2b(f"{name}\x1f{inst.url}".encode(), digest_size=16).digest())
                for _, inst in targets]
        claimed = await asyncio.gather(*(shared.claim(k, b"1", self.timeout) for k in keys))
        mine = [t for t, c in zip(targets, claimed) if c]
        try:
            outcomes = await self.call(LOAD, body, mine, "on_demand") if mine else []
        finally:
            await asyncio.gather(*(shared.take(k) for k, c in zip(keys, claimed) if c))
        waits = [self._wait_for_load(name, body, role, inst, k)
                 for (role, inst), k, c in zip(targets, keys, claimed) if not c]
        return outcomes + list(await asyncio.gather(*waits))

    async def _wait_for_load(self, name: str, body: dict, role: str, inst: Instance, key: bytes) -> Outcome:
        assert self.shared is not None
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            await asyncio.sleep(CLAIM_POLL)
            if await self.shared.get(key) is None:  # that load ended (or the store cannot say)
                await self.pools[role].checks.learn_models(inst, self._learn_timeout)
                if inst.served is not None and name in inst.served.parents:
                    return Outcome(role, inst.url, 200, b"loaded by another proxy")
                return (await self.call(LOAD, body, [(role, inst)], "on_demand"))[0]
        return Outcome(role, inst.url, None, b"another proxy's load did not end within --lora-load-timeout")

    def targets(self, name: str, base: str) -> list[tuple[str, Instance]]:
        """One instance per role with instances: the first of the adapter's affinity order among
        the base model's instances in rotation (the pool's rules: health, then panic)."""
        out = []
        for role, pool in self.pools.items():
            if not pool.instances:
                continue
            try:
                candidates = pool.candidates(model=base)
            except ProxyError:
                raise ProxyError(503, f"no {role} instance serving model `{base}` available",
                                 retryable=False) from None
            affinity = pool.served.affinity or self._affinity
            out.append((role, affinity.choose(candidates, name)))
        return out


def _already(o: Outcome) -> bool:
    """An instance that has the adapter already (vLLM's 400 for a second load of a name)."""
    return o.status == 400 and b"already been loaded" in o.body
