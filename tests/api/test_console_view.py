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
