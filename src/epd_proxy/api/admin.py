"""The roster's HTTP surface: ``/instances`` (vLLM's registration API), drain, profiling, and
LoRA adapters loaded and unloaded on the instances (``/v1/load_lora_adapter``,
``/v1/unload_lora_adapter``: the admin key's, as they change where requests may go).

Wire-compatible with vLLM's EPD proxy and its registrar: ``POST /instances``
answers 200 ``{"registered": true|false}`` (false: known, refreshed);
``DELETE /instances`` takes the URL as ``?url=`` or in the registrar's JSON
body and answers ``{"removed": bool}``; ``GET /instances`` is vLLM's
``{role: {"live", "evicted"}}`` plus this proxy's extra state. Every change
goes through :class:`~epd_proxy.api.access.AccessPolicy` first; a refusal changes
nothing and is logged with the peer.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec

from epd_proxy.api.access import ADMIN, READ, REGISTER, AccessPolicy, peer_ip
from epd_proxy.api.client_auth import presented_admin_key
from epd_proxy.http import Headers
from epd_proxy.http.response import Request, ResponseWriter
from epd_proxy.http.transport import TransportTimeouts, UpstreamError
from epd_proxy.instances.adapters import LOAD, UNLOAD, Adapters, aggregate, base_for, valid_name
from epd_proxy.instances.membership import Membership
from epd_proxy.instances.roster import (
    MembershipConflict,
    RegistrationError,
    normalise_url,
    parse_registration,
    parse_url_param,
)
from epd_proxy.wire.errors import ProxyError

log = logging.getLogger("epd_proxy.admin")

_PROFILE_TIMEOUT = 30.0


class AdminApi:
    def __init__(self, membership: Membership, access: AccessPolicy, upstream_headers: Headers,
                 adapters: Adapters | None = None) -> None:
        self.membership = membership
        self.access = access
        self._headers = upstream_headers
        self.adapters = adapters or Adapters(membership.pools, upstream_headers)

    def allowed(self, req: Request, writer: ResponseWriter, action: str) -> bool:
        """Whether ``req`` may do ``action``; if not, the refusal is sent and logged."""
        err = self.access.check(action, presented_admin_key(req.headers), peer_ip(req.peer))
        if err is None:
            return True
        log.warning("refused %s %s from %s: %s", req.method, req.path, peer_ip(req.peer) or "?", err.message)
        writer.send(err.status, err.body())
        return False

    # -- /instances -------------------------------------------------------------------------
    async def register(self, req: Request, writer: ResponseWriter) -> None:
        if not self.allowed(req, writer, REGISTER):
            return
        try:
            spec = parse_registration(req.body)
            new = self.membership.register(spec, source="api")
        except RegistrationError as exc:
            _send_error(writer, ProxyError(422, str(exc), param=exc.param))
            return
        except MembershipConflict as exc:
            _send_error(writer, ProxyError(409, str(exc), param="role"))
            return
        except ValueError as exc:  # the KV connector cannot use it (e.g. push without engine_id)
            _send_error(writer, ProxyError(422, str(exc)))
            return
        writer.send(200, msgspec.json.encode({"registered": new}))

    async def unregister(self, req: Request, writer: ResponseWriter) -> None:
        if not self.allowed(req, writer, REGISTER):
            return
        url = _url_from(req)
        if url is None:
            _send_error(writer, ProxyError(422, "give the instance as ?url=... or a JSON body with 'url'",
                                           param="url"))
            return
        writer.send(200, msgspec.json.encode({"removed": self.membership.unregister(url)}))

    async def drain(self, req: Request, writer: ResponseWriter) -> None:
        if not self.allowed(req, writer, REGISTER):
            return
        url = _url_from(req)
        if url is None:
            _send_error(writer, ProxyError(422, "give the instance as a JSON body {\"url\": ...}", param="url"))
            return
        inst = self.membership.find(url)
        if not self.membership.drain(url):
            _send_error(writer, ProxyError(404, "no such instance", param="url"))
            return
        writer.send(200, msgspec.json.encode({"draining": True, "inflight": inst.inflight if inst else 0}))

    async def roster(self, req: Request, writer: ResponseWriter) -> None:
        if not self.allowed(req, writer, READ):
            return
        writer.send(200, msgspec.json.encode(self.membership.snapshot()))

    # -- profiling ------------------------------------------------------------------------------
    async def start_profile(self, req: Request, writer: ResponseWriter) -> None:
        await self._profile(req, writer, "/start_profile")

    async def stop_profile(self, req: Request, writer: ResponseWriter) -> None:
        await self._profile(req, writer, "/stop_profile")

    async def _profile(self, req: Request, writer: ResponseWriter, path: str) -> None:
        """Forwarded to every instance (the reference picks one per role); 503 if none
        has profiling enabled."""
        if not self.allowed(req, writer, ADMIN):
            return
        body = req.body or b"{}"
        targets = [(role, inst) for role, pool in self.membership.pools.items() for inst in pool.instances]
        results = await asyncio.gather(*(self._post(inst, path, body) for _, inst in targets))
        out: dict[str, list] = {}
        for (role, inst), (status, detail) in zip(targets, results):
            out.setdefault(role, []).append({"url": inst.url, "status": status, "detail": detail})
        if not any(status == 200 for status, _ in results):
            _send_error(writer, ProxyError(503, f"no instance accepted {path} (is profiling enabled on them?)"))
            return
        writer.send(200, msgspec.json.encode(out))

    async def _post(self, inst, path: str, body: bytes) -> tuple[int | None, str | None]:
        t = TransportTimeouts(connect=5.0, headers=_PROFILE_TIMEOUT, idle=_PROFILE_TIMEOUT)
        headers = [(b"content-type", b"application/json"), *self._headers]
        try:
            status, _, data = await inst.connections.fetch("POST", path, body=body, headers=headers, timeouts=t)
        except UpstreamError as exc:
            return None, str(exc)
        if status == 404:
            log.warning("%s: %s not found (profiling not enabled)", inst.url, path)
        return status, None if status == 200 else data[:200].decode("utf-8", "replace")


    # -- LoRA adapters ----------------------------------------------------------------------
    async def load_lora(self, req: Request, writer: ResponseWriter) -> None:
        """vLLM's ``{"lora_name", "lora_path"[, "load_inplace"]}``, plus the proxy's own optional
        ``base_model`` (which base's instances; default the cluster's only one) and ``instances``
        (a list of instance URLs: only those, each serving that base)."""
        await self._lora(req, writer, LOAD)

    async def unload_lora(self, req: Request, writer: ResponseWriter) -> None:
        """vLLM's ``{"lora_name"}``, plus ``instances`` as for a load; default: every instance
        that serves the adapter."""
        await self._lora(req, writer, UNLOAD)

    async def _lora(self, req: Request, writer: ResponseWriter, path: str) -> None:
        if not self.allowed(req, writer, ADMIN):
            return
        try:
            body, targets = self._lora_targets(req.body, path)
        except ProxyError as err:
            _send_error(writer, err)
            return
        outcomes = await self.adapters.call(path, body, targets)
        status, out, content_type = aggregate(body["lora_name"], "load" if path == LOAD else "unload", outcomes)
        log.info("%s %s on %d instance(s): HTTP %d", path, body["lora_name"], len(outcomes), status)
        writer.send(status, out, content_type=content_type)

    def _lora_targets(self, raw: bytes, path: str) -> tuple[dict, list]:
        """The body each instance gets and the instances, from the operator's body."""
        try:
            data = msgspec.json.decode(raw) if raw else None
        except msgspec.DecodeError:
            data = None
        if not isinstance(data, dict):
            raise ProxyError(400, "expected a JSON object with 'lora_name'" + (" and 'lora_path'" if path == LOAD
                                                                               else ""))
        name = data.get("lora_name")
        if not valid_name(name):
            raise ProxyError(400, "'lora_name' must be an adapter name", param="lora_name")
        body: dict = {"lora_name": name}
        if path == LOAD:
            lora_path = data.get("lora_path")
            if not isinstance(lora_path, str) or not lora_path:
                raise ProxyError(400, "Both 'lora_name' and 'lora_path' must be provided.", param="lora_path")
            body["lora_path"] = lora_path
            if data.get("load_inplace") is True:
                body["load_inplace"] = True
            base = data.get("base_model")
            if base is not None and not isinstance(base, str):
                raise ProxyError(400, "'base_model' must be a model id", param="base_model")
            targets = self.adapters.instances_of(base_for(self.adapters.catalog, base))
        else:
            targets = self.adapters.instances_of(None, name)
        urls = data.get("instances")
        if urls is not None:
            if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
                raise ProxyError(400, "'instances' must be a list of instance URLs", param="instances")
            wanted = {normalise_url(u) for u in urls}
            unknown = wanted - {inst.url for _, inst in targets}
            if unknown:
                raise ProxyError(400, f"not an instance that can take this: {', '.join(sorted(unknown))}",
                                 param="instances")
            targets = [(role, inst) for role, inst in targets if inst.url in wanted]
        if not targets:
            raise ProxyError(404, f"The lora adapter '{name}' cannot be found." if path == UNLOAD
                             else "no instance serves the adapter's base model", type="NotFoundError")
        return body, targets


def _url_from(req: Request) -> str | None:
    """``?url=`` (the reference), else the JSON body's ``url`` (the registrar)."""
    url = parse_url_param(req.query) if req.query else None
    if url is not None:
        return url
    if not req.body:
        return None
    try:
        data = msgspec.json.decode(req.body)
    except msgspec.DecodeError:
        return None
    value = data.get("url") if isinstance(data, dict) else None
    return normalise_url(value) if isinstance(value, str) and value.strip() else None


def _send_error(writer: ResponseWriter, err: ProxyError) -> None:
    writer.send(err.status, err.body())
