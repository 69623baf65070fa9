"""What the console shows of the cluster: each instance's view, one worker's document, and
the workers' documents as one.

An instance's view says its state in words (``in rotation``, ``out: ejected``, ``half-open``,
``draining``, ``leaving``) and why it is out, so the page never needs colour alone; where it
came from (``source``: flag, file, DNS, registration); what it holds (in flight, the load its
own ``/metrics`` reported); what it serves (models, LoRA adapters, the adapters active there);
whether its KV events are live and the blocks the index holds for it (``kv_events``), and for a
decode the KV kept there for a next turn (``kv_reuse``). The proxy's own parts (the shared state
store, each tenant key's use of its limits) are :func:`proxy_panel`. With ``--workers`` each
worker keeps its own health view, so :func:`merge_instances` says in how many workers an
instance is in rotation and calls the state ``mixed`` when they differ.
"""

from __future__ import annotations

from epd_proxy.instances.health import DRAINING, EJECTED, HALF_OPEN, HEALTHY
from epd_proxy.instances.instance import LEAVING, Instance
from epd_proxy.instances.model_directory import model_readiness
from epd_proxy.instances.roster import registered_role
from epd_proxy.observe.traffic import finish, merge, waterfall

STATE_TEXT = {HEALTHY: "in rotation", EJECTED: "out: ejected", HALF_OPEN: "half-open: on trial",
              DRAINING: "draining: no new requests", LEAVING: "leaving: finishing its requests",
              "mixed": "mixed: differs between workers"}
ROLE_ORDER = ("encode", "prefill", "decode", "prefill_decode")
KV_EVENTS_TEXT = {"connected": "connected: its events are live, the index routes on them",
                  "stale": "stale: its replay socket does not answer; routing falls back to estimates",
                  "off": "not configured: no KV events (routing estimates)"}
RECENT_SHOWN = 50  # the newest requests in the state document (the lookup searches every ring)


def kv_events_view(streams: list[dict] | None) -> dict:
    """One instance's KV events in words from its streams' ``/status`` entries (one per
    data-parallel rank, ``kvcache/feed.py``; None: it has none): ``connected`` while every
    stream's replay socket answers (the index is used for it), else ``stale``; the blocks the
    index holds for it, and what went wrong (gaps, engine restarts, messages lost)."""
    if not streams:
        return {"state": "off", "state_text": KV_EVENTS_TEXT["off"], "streams": 0, "connected": 0, "blocks": None,
                "gaps": 0, "restarts": 0, "lost": 0, "last_event": None, "workers": 1, "workers_connected": 0}
    connected = sum(1 for st in streams if st["connected"])
    state = "connected" if connected == len(streams) else "stale"
    last = [st["last_event"] for st in streams if st["last_event"] is not None]
    return {"state": state, "state_text": KV_EVENTS_TEXT[state], "streams": len(streams), "connected": connected,
            "blocks": sum(st["blocks"] for st in streams), "gaps": sum(st["gaps"] for st in streams),
            "restarts": sum(st["restarts"] for st in streams), "lost": sum(st["lost"] for st in streams),
            "last_event": max(last) if last else None, "workers": 1, "workers_connected": 1 if state == "connected"
            else 0}


def merge_kv_events(have: dict, other: dict) -> dict:
    """Two workers' views of one instance's events: each worker subscribes itself and keeps
    its own index, so ``connected`` only if both are; the blocks and restarts are the larger
    (the same engine seen twice), the gaps and losses add up (each subscription's own)."""
    out = dict(have)
    out["workers"] = have["workers"] + other["workers"]
    out["workers_connected"] = have["workers_connected"] + other["workers_connected"]
    if have["state"] != other["state"]:
        state = "stale" if "stale" in (have["state"], other["state"]) else "connected"
        out["state"], out["state_text"] = state, KV_EVENTS_TEXT[state]
    if other["blocks"] is not None:
        out["blocks"] = max(have["blocks"] or 0, other["blocks"])
    out["restarts"] = max(have["restarts"], other["restarts"])
    out["gaps"] = have["gaps"] + other["gaps"]
    out["lost"] = have["lost"] + other["lost"]
    if other["last_event"] is not None:
        out["last_event"] = max(have["last_event"] or 0, other["last_event"])
    return out


def merge_held_kv(have: dict | None, other: dict | None) -> dict | None:
    """Two workers' ``kv_reuse`` of one decode (``TurnReuse.status``): held tokens and
    conversations add up; it keeps blocks if any worker saw it do so."""
    if other is None or have is None:
        return have if other is None else dict(other)
    out = dict(have, held_tokens=have["held_tokens"] + other["held_tokens"],
               held_conversations=have["held_conversations"] + other["held_conversations"])
    if other["keeps_blocks"] is not None and out["keeps_blocks"] is not True:
        out["keeps_blocks"] = other["keeps_blocks"]
    return out


def proxy_panel(state_store: dict | None, tenants: dict | None) -> dict:
    """The proxy's own parts: its shared state store (``state/guard.py``'s status: its kind,
    up or down since when; its address is not shown, it may hold a password) and, with a
    ``[tenants]`` table, each key's use of each of its limits (``tenants/limiter.py``)."""
    store = None
    if state_store is not None:
        up = state_store["up"]
        store = {"kind": state_store["kind"], "up": up, "down_since": state_store["down_since"],
                 "state_text": "up" if up else "down: multi-turn reuse and shared limits fall back",
                 "errors": dict(state_store.get("errors") or {})}
    keys = None
    if tenants is not None:
        keys = []
        for name, key in tenants["keys"].items():
            limits = [{"limit_name": limit, "used": use.get("used"), "limit": use.get("limit"),
                       "share": use["used"] / use["limit"] if use.get("used") is not None and use.get("limit")
                       else None} for limit, use in sorted(key["limits"].items())]
            keys.append({"key": name, "class": key["class"], "policy": key["policy"], "limits": limits})
    shared = tenants is not None and tenants["store"] == "shared"
    # A shared counter that could not be read is the store not answering now (limiter.status).
    down = shared and any(lim["used"] is None and lim["limit_name"] != "concurrent" for k in keys or ()
                          for lim in k["limits"])
    return {"state_store": store, "tenants": keys,
            "tenants_store": None if tenants is None else tenants["store"],
            "tenants_store_up": None if not shared else not down}


def instance_view(inst: Instance, now: float, wall: float, placement=None, kv_streams: list[dict] | None = None,
                  held: dict | None = None) -> dict:
    """``now``: the instance clock (``instance.now``); ``wall``: the wall time at ``now``;
    ``placement``: an encoder pool's ``cache-aware`` placement (``routing/encoders.py``), whose
    counts say how many media items went to the encoder and how many of them were repeats
    sent to the encoder that had encoded them (likely hits in its cache); ``kv_streams``: its
    KV event streams' status (:func:`kv_events_view`); ``held``: a decode's multi-turn KV
    reuse (``TurnReuse.status``: keeps_blocks, held_tokens, held_conversations)."""
    h = inst.health
    state = LEAVING if inst.leaving else h.state
    out = h.state is EJECTED or h.state is HALF_OPEN
    until = h.ejected_until if h.state is EJECTED and h.ejected_until > now else None
    served = inst.served
    parents = served.parents if served is not None else {}
    sig = inst.signals
    return {
        "url": inst.url, "role": registered_role(inst.spec), "state": state, "state_text": STATE_TEXT[state],
        "in_rotation": state == HEALTHY, "workers_in_rotation": 1 if state == HEALTHY else 0, "workers": 1,
        "reason": h.last_error if out else None,
        "ejected_until": None if until is None else round(wall + until - now, 3),
        "source": inst.source, "inflight": inst.inflight, "requests": inst.requests,
        "errors": dict(h.errors), "consecutive_failures": h.failures, "ejections": h.ejections,
        "models": None if served is None else sorted(name for name, parent in parents.items() if parent is None),
        "adapters": sorted(name for name, parent in parents.items() if parent is not None),
        "active_adapters": sorted(sig.adapters),
        "load": None if sig.scraped_at is None else {"others": sig.others, "waiting": sig.waiting,
                                                     "kv_usage": round(sig.kv_usage, 6), "kv_blocks": sig.kv_blocks},
        "media": None if placement is None else {"items": placement.items.get(inst.url, 0),
                                                 "repeats_home": placement.hits.get(inst.url, 0)},
        "kv_events": None if inst.role == "encode" else kv_events_view(kv_streams),  # encoders hold no KV
        "kv_reuse": held,
    }


def merge_instances(views: list[list[dict]]) -> list[dict]:
    """Each worker's instance views as one list: counts add up, the state is ``mixed``
    when the workers differ, ``workers_in_rotation`` says in how many it is in rotation.
    Ordered by role, then URL."""
    merged: dict[tuple[str, str], dict] = {}
    for worker in views:
        for v in worker:
            key = (v["role"], v["url"])
            have = merged.get(key)
            if have is None:
                merged[key] = dict(v, errors=dict(v["errors"]))
                continue
            have["workers"] += 1
            have["workers_in_rotation"] += v["workers_in_rotation"]
            for name in ("inflight", "requests", "ejections"):
                have[name] += v[name]
            for kind, n in v["errors"].items():
                have["errors"][kind] = have["errors"].get(kind, 0) + n
            have["consecutive_failures"] = max(have["consecutive_failures"], v["consecutive_failures"])
            if have["state"] != v["state"]:
                have["state"], have["state_text"] = "mixed", STATE_TEXT["mixed"]
            have["in_rotation"] = have["in_rotation"] and v["in_rotation"]
            have["reason"] = have["reason"] or v["reason"]
            if v["ejected_until"] is not None:
                have["ejected_until"] = max(have["ejected_until"] or 0, v["ejected_until"])
            have["models"] = have["models"] if have["models"] is not None else v["models"]
            have["adapters"] = have["adapters"] or v["adapters"]
            have["active_adapters"] = sorted(set(have["active_adapters"]) | set(v["active_adapters"]))
            have["load"] = have["load"] or v["load"]
            if v.get("media") is not None:
                media = have.get("media") or {"items": 0, "repeats_home": 0}
                have["media"] = {name: media[name] + v["media"][name] for name in media}
            if v.get("kv_events") is not None:
                have["kv_events"] = v["kv_events"] if have.get("kv_events") is None else \
                    merge_kv_events(have["kv_events"], v["kv_events"])
            have["kv_reuse"] = merge_held_kv(have.get("kv_reuse"), v.get("kv_reuse"))
    order = {role: i for i, role in enumerate(ROLE_ORDER)}
    return sorted(merged.values(), key=lambda v: (order.get(v["role"], len(order)), v["url"]))


def readiness(instances: list[dict], parents: dict, required: list[str]) -> dict:
    """Per model, ``/status``'s readiness (``model_directory.model_readiness``) over the merged views:
    which roles serve it, in rotation or out, and whether a request for it can be served."""
    pools: dict[str, list[dict]] = {}
    for v in instances:
        if v["state"] == LEAVING:
            continue
        names = None if v["models"] is None else v["models"] + v["adapters"]
        pool = "decode" if v["role"] == "prefill_decode" else v["role"]
        pools.setdefault(pool, []).append({"state": v["state"], "healthy": v["in_rotation"], "models": names})
    return model_readiness(pools, parents, required)


def state_document(local: dict, peers: list[dict], workers_configured: int = 1) -> dict:
    """The console's JSON (``GET /console/api/state``) from this worker's part (``local``)
    and its siblings' (``peers``), each ``{"proxy", "instances", "traffic", "recent"}``."""
    parts = [local] + peers
    recent = sorted((s for p in parts for s in p["recent"]), key=lambda s: s["end"], reverse=True)[:RECENT_SHOWN]
    traffic = finish(merge([p["traffic"] for p in parts]))
    instances = merge_instances([p["instances"] for p in parts])
    return {"read_only": True, "generated": local["generated"], "window_s": local["window_s"],
            "workers": len(parts), "workers_configured": workers_configured, "proxy": local["proxy"],
            "panel": local.get("panel"),  # the worker asked: the store is shared, tenants its view
            "instances": instances, "models": readiness(instances, local.get("parents", {}), local.get("required", [])),
            "traffic": traffic,
            "recent": [dict(s, waterfall=waterfall(s)) for s in recent]}


def request_document(request_id: str, found: list[list[dict]]) -> dict:
    """``GET /console/api/request?id=``: every summary with this id, from every worker,
    newest first, each with its waterfall."""
    matches = sorted((s for part in found for s in part), key=lambda s: s["end"], reverse=True)
    return {"id": request_id, "requests": [dict(s, waterfall=waterfall(s)) for s in matches]}
