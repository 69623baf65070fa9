"""What the console shows of the cluster: each instance's view, one worker's document, and
the workers' documents as one.

An instance's view says its state in words (``in rotation``, ``out: ejected``, ``half-open``,
``draining``, ``leaving``) and why it is out, so the page never needs colour alone; where it
came from (``source``: flag, file, DNS, registration); what it holds (in flight, the load its
own ``/metrics`` reported); what it serves (models, LoRA adapters, the adapters active there).
With ``--workers`` each worker keeps its own health view, so :func:`merge_instances` says in
how many workers an instance is in rotation and calls the state ``mixed`` when they differ.
"""

from __future__ import annotations

from epd_proxy.instances.catalog import model_readiness
from epd_proxy.instances.health import DRAINING, EJECTED, HALF_OPEN, HEALTHY
from epd_proxy.instances.instance import LEAVING, Instance
from epd_proxy.instances.roster import registered_role
from epd_proxy.observe.traffic import finish, merge, waterfall

STATE_TEXT = {HEALTHY: "in rotation", EJECTED: "out: ejected", HALF_OPEN: "half-open: on trial",
              DRAINING: "draining: no new requests", LEAVING: "leaving: finishing its requests",
              "mixed": "mixed: differs between workers"}
ROLE_ORDER = ("encode", "prefill", "decode", "prefill_decode")
RECENT_SHOWN = 50  # the newest requests in the state document (the lookup searches every ring)


def instance_view(inst: Instance, now: float, wall: float, placement=None) -> dict:
    """``now``: the instance clock (``instance.now``); ``wall``: the wall time at ``now``;
    ``placement``: an encoder pool's ``cache-aware`` placement (``routing/encoders.py``), whose
    counts say how many media items went to the encoder and how many of them were repeats
    sent to the encoder that had encoded them (likely hits in its cache)."""
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
                                                     "kv_usage": round(sig.kv_usage, 4)},
        "media": None if placement is None else {"items": placement.items.get(inst.url, 0),
                                                 "repeats_home": placement.hits.get(inst.url, 0)},
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
    order = {role: i for i, role in enumerate(ROLE_ORDER)}
    return sorted(merged.values(), key=lambda v: (order.get(v["role"], len(order)), v["url"]))


def readiness(instances: list[dict], parents: dict, required: list[str]) -> dict:
    """Per model, ``/status``'s readiness (``catalog.model_readiness``) over the merged views:
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
            "instances": instances, "models": readiness(instances, local.get("parents", {}), local.get("required", [])),
            "traffic": traffic,
            "recent": [dict(s, waterfall=waterfall(s)) for s in recent]}


def request_document(request_id: str, found: list[list[dict]]) -> dict:
    """``GET /console/api/request?id=``: every summary with this id, from every worker,
    newest first, each with its waterfall."""
    matches = sorted((s for part in found for s in part), key=lambda s: s["end"], reverse=True)
    return {"id": request_id, "requests": [dict(s, waterfall=waterfall(s)) for s in matches]}
