"""The console's cluster view (console_view.py): one instance in words, the workers' views
merged, the documents."""

from epd_proxy.api.console_view import merge_instances, request_document, state_document


def _view(url="http://d:1", role="decode", state="healthy", inflight=1, requests=10, reason=None, errors=None):
    return {"url": url, "role": role, "state": state, "state_text": state, "in_rotation": state == "healthy",
            "workers_in_rotation": 1 if state == "healthy" else 0, "workers": 1, "reason": reason,
            "ejected_until": None, "source": "static", "inflight": inflight, "requests": requests,
            "errors": errors or {}, "consecutive_failures": 0, "ejections": 0, "models": ["m"], "adapters": [],
            "active_adapters": [], "load": None}


def test_workers_that_agree_add_up():
    merged = merge_instances([[_view(), _view("http://e:1", "encode")], [_view(errors={"connect": 2})]])
    assert [v["role"] for v in merged] == ["encode", "decode"]  # E, P, D, PD order
    d = merged[1]
    assert (d["inflight"], d["requests"], d["workers"], d["workers_in_rotation"]) == (2, 20, 2, 2)
    assert d["state"] == "healthy" and d["errors"] == {"connect": 2}


def test_workers_that_differ_say_mixed_and_why():
    merged = merge_instances([[_view()], [_view(state="ejected", reason="cannot connect")]])
    d = merged[0]
    assert d["state"] == "mixed" and d["state_text"].startswith("mixed")
    assert d["workers_in_rotation"] == 1 and not d["in_rotation"] and d["reason"] == "cannot connect"


def _part(recent, instances):
    return {"generated": 100.0, "window_s": 10.0, "proxy": {"topology": "P+D"}, "instances": instances,
            "traffic": {"covered_s": 10.0, "models": {}}, "recent": recent}


def _summary(rid, end):
    return {"id": rid, "end": end, "status": 200, "outcome": "ok", "stream": False, "total_ms": 5.0,
            "first_byte_ms": 4.0, "items": 0, "legs": [["decode", "http://d:1", False]], "stages_ms": {"decode": 3.0},
            "kv_outcome": None}


def test_the_state_document_joins_every_worker_newest_first_read_only():
    doc = state_document(_part([_summary("a", 1.0)], [_view()]), [_part([_summary("b", 2.0)], [_view()])], 2)
    assert doc["read_only"] is True and doc["workers"] == 2 and doc["workers_configured"] == 2
    assert [s["id"] for s in doc["recent"]] == ["b", "a"]
    assert doc["recent"][0]["waterfall"][0]["stage"] == "decode"
    assert doc["instances"][0]["requests"] == 20
    assert doc["models"]["m"]["roles"] == {"decode": {"in_rotation": 1, "out": 0}}


def test_readiness_per_model_over_the_merged_views():
    from epd_proxy.api.console_view import readiness
    views = [_view(), _view("http://d:2", state="ejected"), _view("http://p:1", "prefill", state="ejected")]
    ready = readiness(views, {"m": None}, ["prefill", "decode"])
    assert ready["m"]["ready"] is False and "prefill" in ready["m"]["why"]
    assert ready["m"]["roles"]["decode"] == {"in_rotation": 1, "out": 1}
    views[2] = _view("http://p:1", "prefill")
    assert readiness(views, {"m": None}, ["prefill", "decode"])["m"]["ready"] is True


def test_the_request_document_finds_an_id_in_every_worker():
    doc = request_document("a", [[_summary("a", 1.0)], [_summary("a", 3.0)], []])
    assert [s["end"] for s in doc["requests"]] == [3.0, 1.0] and doc["requests"][0]["waterfall"]


def _stream(connected=True, blocks=10, gaps=0, restarts=0, lost=0, last=50.0):
    return {"endpoint": "tcp://d:5557", "connected": connected, "blocks": blocks, "gaps": gaps,
            "restarts": restarts, "lost": lost, "last_event": last, "received": 3}


def test_kv_events_in_words_per_instance():
    from epd_proxy.api.console_view import kv_events_view
    off = kv_events_view(None)
    assert off["state"] == "off" and off["state_text"].startswith("not configured") and off["blocks"] is None
    live = kv_events_view([_stream(blocks=4), _stream(blocks=6, restarts=1, last=60.0)])  # two ranks
    assert live["state"] == "connected" and live["state_text"].startswith("connected")
    assert (live["blocks"], live["restarts"], live["streams"], live["last_event"]) == (10, 1, 2, 60.0)
    stale = kv_events_view([_stream(), _stream(connected=False, gaps=2)])  # one rank silent: not used
    assert stale["state"] == "stale" and "falls back" in stale["state_text"] and stale["gaps"] == 2


def test_workers_views_of_kv_events_and_held_kv_merge():
    from epd_proxy.api.console_view import kv_events_view
    a = dict(_view(), kv_events=kv_events_view([_stream(blocks=10, gaps=1)]),
             kv_reuse={"keeps_blocks": True, "held_tokens": 300, "held_conversations": 2})
    b = dict(_view(), kv_events=kv_events_view([_stream(connected=False, blocks=8, gaps=2)]),
             kv_reuse={"keeps_blocks": None, "held_tokens": 100, "held_conversations": 1})
    [d] = merge_instances([[a], [b]])
    kv = d["kv_events"]
    assert kv["state"] == "stale" and (kv["workers"], kv["workers_connected"]) == (2, 1)
    assert kv["blocks"] == 10 and kv["gaps"] == 3  # one index per worker: the larger; gaps of each
    assert d["kv_reuse"] == {"keeps_blocks": True, "held_tokens": 400, "held_conversations": 3}
    [e] = merge_instances([[dict(_view(), kv_events=None, kv_reuse=None)], [dict(_view(), kv_events=None,
                                                                                 kv_reuse=None)]])
    assert e["kv_events"] is None and e["kv_reuse"] is None


def test_the_proxy_panel_the_store_and_each_key_s_use_of_its_limits():
    from epd_proxy.api.console_view import proxy_panel
    assert proxy_panel(None, None) == {"state_store": None, "tenants": None, "tenants_store": None,
                                       "tenants_store_up": None}
    store = {"kind": "redis", "url": "redis://:secret@r:6379", "up": False, "down_since": 90.0, "timeout": 0.1,
             "errors": {"timeout": 2}}
    tenants = {"store": "shared", "store_failures": {}, "keys": {
        "team-a": {"policy": "team-a", "class": "interactive", "weight": 1,
                   "limits": {"rpm": {"limit": 60, "used": 15, "reset": 120.0},
                              "concurrent": {"limit": 4, "used": 1}}, "models": None},
        "team-b": {"policy": "default", "class": "batch", "weight": 1,
                   "limits": {"tpm": {"limit": 1000, "used": None, "reset": 120.0}}, "models": None}}}
    panel = proxy_panel(store, tenants)
    assert panel["state_store"]["kind"] == "redis" and panel["state_store"]["state_text"].startswith("down")
    assert "secret" not in repr(panel)  # the store's address may carry its password: not shown
    a, b = panel["tenants"]
    assert a["key"] == "team-a" and [lim["limit_name"] for lim in a["limits"]] == ["concurrent", "rpm"]
    assert a["limits"][1]["share"] == 0.25
    assert b["limits"][0]["used"] is None and b["limits"][0]["share"] is None  # the store did not answer
    assert panel["tenants_store"] == "shared"
    assert panel["tenants_store_up"] is False  # a shared counter unread: the heading must not say "shared" alone
    answered = dict(tenants, keys={"team-a": tenants["keys"]["team-a"]})
    assert proxy_panel(store, answered)["tenants_store_up"] is True
    assert proxy_panel(None, dict(answered, store="in-process"))["tenants_store_up"] is None
