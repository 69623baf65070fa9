"""The console: a live page in the browser (``/console``) and the JSON it reads.

The page is three static files in the package (``console_page/``: HTML, script, style; no
CDN, no build step), served as they are to anyone: they hold no data. The JSON behind it,
``GET /console/api/state`` and ``GET /console/api/request?id=``, shows backend addresses, so
it is the roster's (``access.py``: the admin key whenever one is configured, open only when
no key is). The page asks for the key when the JSON answers 401 and sends it as ``X-API-Key``.
Read-only: nothing here changes anything.

Reading the state turns on the ring of recent requests (``observe/recent.py``) for a while;
with ``--workers`` the worker a page reached asks its siblings for their parts
(``siblings.py``) and answers for the whole proxy (``console_view.py``). With a shared state
store, its ``gateway`` part is every replica's published summary (``gateway.py``).
"""

from __future__ import annotations

import os
import time
from importlib import resources
from urllib.parse import parse_qs

import msgspec

from epd_proxy.api.access import READ
from epd_proxy.api.admin import AdminApi
from epd_proxy.api.console_view import RECENT_SHOWN, instance_view, proxy_panel, request_document, state_document
from epd_proxy.api.gateway import GatewayBoard
from epd_proxy.api.gateway_view import alone
from epd_proxy.api.siblings import SiblingChannel
from epd_proxy.config import ProxyConfig
from epd_proxy.http.response import Request, ResponseWriter
from epd_proxy.instances.instance import now as instance_now
from epd_proxy.instances.membership import Membership
from epd_proxy.instances.pool import InstancePool
from epd_proxy.kvcache.feed import EventFeed
from epd_proxy.observe.recent import RecentRequests
from epd_proxy.observe.traffic import partial
from epd_proxy.request.turns.reuse import TurnReuse
from epd_proxy.state.guard import GuardedStore
from epd_proxy.tenants.limiter import Tenants

PAGE = "/console"
STATE = "/console/api/state"
REQUEST = "/console/api/request"
WINDOW = 10.0  # seconds of traffic the live numbers cover
STATE_QUESTION = "console"  # what a worker asks its siblings (siblings.py)
REQUEST_QUESTION = "console-request "  # ... followed by the request id

_ASSETS = {  # path -> (file in console_page/, content type)
    PAGE: ("index.html", b"text/html; charset=utf-8"),
    PAGE + "/": ("index.html", b"text/html; charset=utf-8"),
    PAGE + "/console.js": ("console.js", b"text/javascript; charset=utf-8"),
    PAGE + "/console.css": ("console.css", b"text/css; charset=utf-8"),
}
# The page loads only its own files and talks only to this proxy.
_PAGE_HEADERS = [(b"cache-control", b"no-cache"), (b"x-content-type-options", b"nosniff"),
                 (b"referrer-policy", b"no-referrer"), (b"x-frame-options", b"DENY"),
                 (b"content-security-policy", b"default-src 'self'; frame-ancestors 'none'")]
_JSON_HEADERS = [(b"cache-control", b"no-store")]
# A decode multi-turn reuse knows nothing of yet (as /status shows it).
_NOT_HELD = {"keeps_blocks": None, "held_tokens": 0, "held_conversations": 0, "kv_budget": None}


def _load_assets() -> dict[str, bytes]:
    folder = resources.files("epd_proxy.api").joinpath("console_page")
    return {name: folder.joinpath(name).read_bytes() for name, _ in set(_ASSETS.values())}


class ConsoleApi:
    """The console's routes; what it reads is handed to it (``runtime/build.py``)."""

    def __init__(self, config: ProxyConfig, *, pools: dict[str, InstancePool], membership: Membership,
                 recent: RecentRequests, admin: AdminApi, siblings: SiblingChannel | None = None,
                 window: float = WINDOW, kv_events: EventFeed | None = None, reuse: TurnReuse | None = None,
                 state: GuardedStore | None = None, tenants: Tenants | None = None,
                 board: GatewayBoard | None = None) -> None:
        self.config = config
        self.pools = pools
        self.membership = membership
        self.recent = recent
        self.admin = admin  # its access policy: who may read the roster
        self.siblings = siblings
        self.window = window
        self.kv_events = kv_events  # each instance's KV event streams (kvcache/feed.py)
        self.reuse = reuse  # the KV each decode keeps for a next turn (request/turns/reuse.py)
        self.state_store = state  # the shared state store, if any (state/)
        self.tenants = tenants  # each key's use of its limits, with a [tenants] table
        self.board = board  # every replica's summary, with a shared store (gateway.py)
        self._files = _load_assets()

    def routes(self) -> dict:
        """``(method, path) -> handler``, for the app's route table."""
        table = {("GET", path): self.page for path in _ASSETS}
        table[("GET", STATE)] = self.state
        table[("GET", REQUEST)] = self.request
        return table

    async def page(self, req: Request, writer: ResponseWriter) -> None:
        name, content_type = _ASSETS[req.path]
        writer.send(200, self._files[name], content_type, _PAGE_HEADERS)

    async def state(self, req: Request, writer: ResponseWriter) -> None:
        if not self.admin.allowed(req, writer, READ):
            return
        local = self.local_state()
        tenants = self.tenants
        local["panel"] = proxy_panel(self.state_store.status() if self.state_store is not None else None,
                                     await tenants.status() if tenants is not None and tenants.active else None)
        peers: list = []
        count = 1
        if self.siblings is not None:
            peers = [p for p in await self.siblings.ask(STATE_QUESTION) if isinstance(p, dict)]
            count = self.siblings.count
        doc = state_document(local, peers, count)
        board = self.board
        doc["gateway"] = await board.view() if board is not None else alone(count, None)
        writer.send(200, msgspec.json.encode(doc), headers=_JSON_HEADERS)

    async def request(self, req: Request, writer: ResponseWriter) -> None:
        if not self.admin.allowed(req, writer, READ):
            return
        rid = (parse_qs(req.query).get("id") or [""])[0].strip()
        found = [self.recent.find(rid)] if rid else []
        if rid and self.siblings is not None and rid.isascii() and rid.isprintable() and " " not in rid:
            found += [p for p in await self.siblings.ask(REQUEST_QUESTION + rid) if isinstance(p, list)]
        writer.send(200, msgspec.json.encode(request_document(rid, found)), headers=_JSON_HEADERS)

    def local_state(self) -> dict:
        """This worker's part: its instance views, its traffic partial, its recent requests.
        Reading it keeps the ring recording."""
        self.recent.look()
        now, wall = instance_now(), time.time()
        placement = getattr(self.pools["encode"].policy, "encoders", None)  # cache-aware's media counts
        feed = self.kv_events
        streams = feed.status()["instances"] if feed is not None and feed.active else {}
        held = self.reuse.status() if self.reuse is not None and self.reuse.store is not None else None
        instances = [instance_view(inst, now, wall, placement if inst.role == "encode" else None,
                                   streams.get(inst.url),
                                   None if held is None or inst.role != "decode" else held.get(inst.url, _NOT_HELD))
                     for inst in self.membership.instances()]
        instances += [instance_view(inst, now, wall) for inst in self.membership.departing()]
        recent = self.recent
        traffic = partial(recent.records(wall - self.window), wall, self.window, recent.since,
                          recent.oldest if recent.saturated else None)
        config = self.config
        return {"generated": round(wall, 3), "window_s": self.window, "pid": os.getpid(),
                "parents": self.pools["decode"].served.directory.current.parents,  # the catalog's: adapter -> base
                "required": list(self.membership.required_roles()),
                "proxy": {"topology": self.membership.topology,
                          "kv_connector": config.kv_connector if self.pools["prefill"].instances else None,
                          "routing": {role: pool.policy.name for role, pool in self.pools.items()},
                          "admin_key": bool(config.admin_api_key)},
                "instances": instances, "traffic": traffic, "recent": recent.latest(RECENT_SHOWN)}

    async def close(self) -> None:
        if self.board is not None:
            await self.board.close()

    async def answer(self, question: str):
        """A sibling worker's question (``siblings.py``), or None if it is not the console's."""
        if question == STATE_QUESTION:
            return self.local_state()
        if question.startswith(REQUEST_QUESTION):
            return self.recent.find(question[len(REQUEST_QUESTION):])
        return None
