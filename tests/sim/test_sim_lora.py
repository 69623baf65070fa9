"""LoRA adapters on the simulator, as vLLM 0.32 serves them: static and runtime adapters,
their /v1/models cards, vLLM's load/unload answers, an output per adapter, and the
--max-loras slots (swaps counted, vLLM's lora_requests_info)."""

from __future__ import annotations

import pytest
from simhelpers import chat_body, fast_config, metric

from epd_proxy.sim import SimCluster, SimConfig, expected_text
from epd_proxy.sim.lora import LoraSlots, parse_modules


def test_modules_and_slots_are_lru():
    assert parse_modules(("a=/x", "b=/y=z")) == {"a": "/x", "b": "/y=z"}
    with pytest.raises(ValueError):
        parse_modules(("nopath",))
    slots = LoraSlots(("base",), ("a=/a", "b=/b", "c=/c"), max_loras=2, swap_ms=7.0)
    assert [slots.acquire(n) for n in ("a", "b", "a", "c", "b", "a")] == [7.0, 7.0, 0.0, 7.0, 7.0, 7.0]
    assert slots.swaps == 5 and list(slots.active) == ["b", "a"]
    assert set(slots.running) == {"a", "b", "c"}
    for n in ("a", "b", "a", "c", "b", "a"):
        slots.release(n)
    assert slots.running == {}


def test_spec_sets_adapters_per_instance():
    c = SimCluster.from_spec("decode=2,max_loras=2,decode-1.lora_modules=x=/ad/x|y=/ad/y")
    d0, d1 = c.instances("decode")
    assert d0.lora.adapters == {} and d1.lora.adapters == {"x": "/ad/x", "y": "/ad/y"}
    assert d1.config.max_loras == 2
    with pytest.raises(ValueError):
        SimCluster.from_spec("decode=1,decode-x.lora_modules=a=/b")


async def test_static_adapter_serves_its_own_output_and_is_listed(http):
    cfg = fast_config(lora_modules=("sql=/adapters/sql", "chat=/adapters/chat"))
    async with SimCluster(pd=1, config=cfg) as c:
        url = c.urls("pd")[0]
        models = (await http.get(url, "/v1/models")).json["data"]
        assert [(m["id"], m["parent"], m["root"]) for m in models] == [
            ("sim-model", None, "sim-model"), ("sql", "sim-model", "/adapters/sql"),
            ("chat", "sim-model", "/adapters/chat")]
        texts = {}
        for model in ("sim-model", "sql", "chat"):
            body = chat_body("which weights answer this?", model=model, max_tokens=6)
            r = await http.chat(url, body)
            assert r.status == 200 and r.json["model"] == model
            texts[model] = r.json["choices"][0]["message"]["content"]
            path = None if model == "sim-model" else f"/adapters/{model}"
            assert texts[model] == expected_text(body, lora_path=path)
        assert len(set(texts.values())) == 3  # each adapter answers differently
        r = await http.chat(url, chat_body(model="other"))
        assert r.status == 404 and r.json["error"]["type"] == "NotFoundError"


async def test_runtime_load_and_unload_answer_as_vllm(http, tmp_path):
    async with SimCluster(pd=2, config=fast_config(allow_runtime_lora=True),
                          ) as c, SimCluster(pd=1, config=fast_config()) as plain:
        url = c.urls("pd")[0]
        r = await http.post(url, "/v1/load_lora_adapter", {"lora_name": "fin", "lora_path": "/ad/fin"})
        assert r.status == 200 and r.data == b"Success: LoRA adapter 'fin' added successfully."
        assert r.headers[b"content-type"].startswith(b"text/plain")
        again = await http.post(url, "/v1/load_lora_adapter", {"lora_name": "fin", "lora_path": "/ad/fin"})
        assert again.status == 400 and again.json["error"]["type"] == "InvalidUserInput"
        assert again.json["error"]["code"] == 400 and "already been loaded" in again.json["error"]["message"]
        base = await http.post(url, "/v1/load_lora_adapter", {"lora_name": "sim-model", "lora_path": "/x"})
        assert base.status == 400 and "conflicts with a served base model" in base.json["error"]["message"]
        missing = await http.post(url, "/v1/load_lora_adapter", {"lora_name": "fin2"})
        assert missing.status == 400
        ids = [m["id"] for m in (await http.get(url, "/v1/models")).json["data"]]
        assert ids == ["sim-model", "fin"]
        body = chat_body("a question for the finance adapter", model="fin", max_tokens=5)
        r = await http.chat(url, body)
        assert r.status == 200 and r.json["choices"][0]["message"]["content"] == expected_text(
            body, lora_path="/ad/fin")
        other = c.urls("pd")[1]  # the adapter is on the first instance only
        assert (await http.chat(other, body)).status == 404
        r = await http.post(url, "/v1/unload_lora_adapter", {"lora_name": "fin"})
        assert r.status == 200 and r.data == b"Success: LoRA adapter 'fin' removed successfully."
        r = await http.post(url, "/v1/unload_lora_adapter", {"lora_name": "fin"})
        assert r.status == 404 and r.json["error"] == {
            "message": "The lora adapter 'fin' cannot be found.", "type": "NotFoundError", "param": None,
            "code": 404}
        assert (await http.chat(url, body)).status == 404
        # Without runtime updating (vLLM's default) the routes do not exist.
        r = await http.post(plain.urls("pd")[0], "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/a"})
        assert r.status == 404 and r.json == {"detail": "Not Found"}


async def test_checked_paths_need_an_adapter_config(http, tmp_path):
    (tmp_path / "good").mkdir()
    (tmp_path / "good" / "adapter_config.json").write_text("{}")
    async with SimCluster(pd=1, config=fast_config(allow_runtime_lora=True, lora_check_paths=True)) as c:
        url = c.urls("pd")[0]
        r = await http.post(url, "/v1/load_lora_adapter", {"lora_name": "g", "lora_path": str(tmp_path / "good")})
        assert r.status == 200
        bad = str(tmp_path / "absent")
        r = await http.post(url, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": bad})
        assert r.status == 404 and r.json["error"]["message"] == f"Loading lora b failed: No adapter found for {bad}"


async def test_slots_swap_and_metrics(http):
    cfg = SimConfig(itl_ms=0, ttft_ms=0.5, ttft_per_token_ms=0, max_loras=1, lora_swap_ms=30.0,
                    lora_modules=("a=/a", "b=/b"))
    async with SimCluster(pd=1, config=cfg) as c:
        url = c.urls("pd")[0]
        for model in ("a", "a", "b", "a", "sim-model"):
            r = await http.chat(url, chat_body("slot test", model=model, max_tokens=2))
            assert r.status == 200
        text = (await http.get(url, "/metrics")).data.decode()
        assert metric(text, "sim:lora_swaps_total") == 3  # a, b, a again: one slot
        assert metric(text, "sim:lora_requests_total") == 4
        line = next(ln for ln in text.splitlines() if ln.startswith("vllm:lora_requests_info{"))
        assert 'max_lora="1"' in line and 'running_lora_adapters=""' in line
        # The swap-in is time spent before the first token.
        recs = [r for r in c.records() if r.path == "/v1/chat/completions"]
        first_a, second_a = recs[0], recs[1]
        assert first_a.t_end - first_a.t_received >= 0.03
        assert c.instances("pd")[0].lora.swaps == 3 and second_a.status == 200


async def test_kv_computed_with_an_adapter_is_valid_only_with_it(http):
    from simhelpers import prefill_body

    cfg = fast_config(lora_modules=("a=/ad/a", "b=/ad/b"))
    async with SimCluster(prefill=1, decode=1, config=cfg) as c:
        p, d = c.urls("prefill")[0], c.urls("decode")[0]
        for pmodel, dmodel, ok in (("a", "a", True), ("a", "b", False), ("sim-model", "a", False)):
            body = chat_body(f"kv with {pmodel} then {dmodel}", model=dmodel, max_tokens=4)
            r = await http.post(p, "/v1/chat/completions", prefill_body(dict(body, model=pmodel)))
            assert r.status == 200
            r = await http.chat(d, dict(body, kv_transfer_params=r.json["kv_transfer_params"]))
            assert (r.status == 200) is ok, r.data
            if ok:
                assert r.json["choices"][0]["message"]["content"] == expected_text(body, lora_path="/ad/a")
