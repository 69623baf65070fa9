"""The access log (access_log.py): one line per request with what an operator needs, in
both formats, in process and from a real ``epd-proxy serve``."""

import asyncio
import io
import os
import signal

import msgspec
from helpers import JSON, chat_body, stack
from procs import child_proxy, fresh_request

from epd_proxy.observe.access_log import AccessLog
from epd_proxy.sim import SimCluster, SimConfig


async def test_one_line_per_request_with_the_fields_text_and_json():
    for fmt in ("text", "json"):
        out = io.StringIO()
        async with stack(encode=1) as (cluster, proxy, client):
            proxy.app.pipeline.access_log = AccessLog(fmt, stream=out)
            image = ["https://example.com/cat.png"]
            whole = await client.chat(chat_body(images=image), [(b"x-request-id", b"rid-whole")])
            streamed = await client.chat(chat_body(stream=True, stream_options={"include_usage": True}),
                                         [(b"x-request-id", b"rid-stream")])
            bad = await client.post("/v1/chat/completions", b"{nope", [(b"x-request-id", b"rid-bad")])
            health = await client.request("GET", "/health")
            assert [r.status for r in (whole, streamed, bad, health)] == [200, 200, 400, 200]
        lines = out.getvalue().splitlines()
        assert len(lines) == 4, lines
        e, p, d = (cluster.urls(r)[0].split("://")[1] for r in ("encode", "prefill", "decode"))
        usage = whole.json()["usage"]
        if fmt == "json":
            w, s, b, h = (msgspec.json.decode(line) for line in lines)
            assert w["request_id"] == "rid-whole" and w["method"] == "POST" and w["status"] == 200
            assert w["stream"] is False and w["outcome"] == "ok"
            assert w["instances"] == {"encode": [e], "prefill": [p], "decode": [d]}
            assert set(w["stages_ms"]) == {"encode", "prefill", "decode"}
            assert (w["prompt_tokens"], w["completion_tokens"]) == (usage["prompt_tokens"],
                                                                    usage["completion_tokens"])
            assert w["bytes"] == len(whole.body)  # the body's bytes
            assert s["request_id"] == "rid-stream" and s["stream"] is True and s["outcome"] == "ok"
            assert s["completion_tokens"] == 8 and s["prompt_tokens"] > 0
            assert set(s["stages_ms"]) == {"prefill", "decode_first"}
            assert b["request_id"] == "rid-bad" and b["status"] == 400 and b["outcome"] == "error"
            assert b["instances"] == {} and b["prompt_tokens"] is None
            assert h["path"] == "/health" and h["status"] == 200
        else:
            w, s, b, h = lines
            assert " INFO epd_proxy.access: rid-whole POST /v1/chat/completions 200 whole " in w
            assert f" e={e} p={p} d={d} " in w and " encode=" in w and " prefill=" in w
            assert f" tokens={usage['prompt_tokens']}/{usage['completion_tokens']} " in w and w.endswith(" ok")
            assert " rid-stream POST /v1/chat/completions 200 stream " in s and " decode_first=" in s
            assert "/8 " in s and s.endswith(" ok")
            assert " rid-bad POST /v1/chat/completions 400 whole - - " in b and " tokens=-/- " in b
            assert b.endswith(" error")
            assert " - GET /health 200 " in h


async def test_an_in_band_failure_and_a_client_gone_are_the_outcome():
    out = io.StringIO()
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, roles={"decode": {"itl_ms": 20}})
    async with stack(sim=sim) as (cluster, proxy, client):
        proxy.app.pipeline.access_log = AccessLog("json", stream=out)
        gone = asyncio.ensure_future(client.chat(chat_body(stream=True, max_tokens=2000), timeout=30))
        await asyncio.sleep(0)
        decode = cluster.instances("decode")[0]
        loop = asyncio.get_running_loop()
        end = loop.time() + 5
        while decode._in_flight == 0:
            assert loop.time() < end
            await asyncio.sleep(0.01)
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        await client.close()
        while not out.getvalue():
            assert loop.time() < end
            await asyncio.sleep(0.01)
    line = msgspec.json.decode(out.getvalue().splitlines()[0])
    assert line["outcome"] == "client_gone" and line["stream"] is True


async def test_a_real_proxy_logs_json_lines_and_nothing_with_no_access_log():
    async with SimCluster(prefill=1, decode=1, config=SimConfig(itl_ms=0, ttft_ms=0.5)) as cluster:
        body = msgspec.json.encode(chat_body(max_tokens=2))
        for extra, want in ((["--log-format", "json"], 3), (["--no-access-log"], 0)):
            async with child_proxy(cluster, *extra, stderr=asyncio.subprocess.PIPE) as (proc, url):
                for i in range(3):
                    reply = await fresh_request(url, "POST", "/v1/chat/completions", body,
                                                JSON + [(b"x-request-id", f"r{i}".encode())])
                    assert reply.status == 200
                os.killpg(proc.pid, signal.SIGTERM)
                err = (await asyncio.wait_for(proc.stderr.read(), 10)).decode()
                await proc.wait()
            lines = [line for line in err.splitlines() if line.strip()]
            access = [line for line in lines if "epd_proxy.access" in line and "/v1/chat" in line]
            assert len(access) == want, err
            if want:
                # /health polls while starting are logged too; every line is one JSON object.
                docs = [msgspec.json.decode(line) for line in lines]
                assert [d["request_id"] for d in docs if d.get("path") == "/v1/chat/completions"] == ["r0", "r1", "r2"]
                assert any(d["logger"] == "epd_proxy" and "shutting down" in d["message"] for d in docs)


async def test_who_what_and_tokens_for_every_request_text_and_json(tmp_path):
    """Stream and whole answers, usage asked or not: tokens in every line, with the client,
    the model and the key's name (never the key)."""
    keys = tmp_path / "keys"
    keys.write_text("team-a:sk-aaa\nsk-unnamed\n")
    auth = {name: [(b"authorization", b"Bearer " + key)] for name, key in
            (("team-a", b"sk-aaa"), ("line2", b"sk-unnamed"), ("key1", b"sk-flag"))}
    for fmt in ("text", "json"):
        out = io.StringIO()
        async with stack(api_keys=("sk-flag",), api_key_file=str(keys)) as (cluster, proxy, client):
            proxy.app.pipeline.access_log = AccessLog(fmt, stream=out)
            asked = {"include_usage": True}
            replies = [
                await client.chat(chat_body(max_tokens=5), auth["team-a"]),
                await client.chat(chat_body(stream=True, max_tokens=6), auth["line2"]),
                await client.chat(chat_body(stream=True, max_tokens=7, stream_options=asked), auth["key1"]),
                await client.chat({k: v for k, v in chat_body(max_tokens=4).items() if k != "model"},
                                  auth["team-a"]),
                await client.chat(chat_body(max_tokens=2, model="my model\n"), auth["team-a"]),
            ]
            assert [r.status for r in replies] == [200] * 4 + [404]  # a model decode does not serve
            assert replies[1].body.find(b'"usage"') < 0  # not asked: not sent
            assert replies[2].body.find(b'"usage"') >= 0
        lines = out.getvalue().splitlines()
        assert len(lines) == 5 and "sk-" not in out.getvalue()
        prompt = replies[0].json()["usage"]["prompt_tokens"]
        want = [(5, "team-a", "sim-model", False), (6, "line2", "sim-model", True), (7, "key1", "sim-model", True),
                (4, "team-a", None, False), (None, "team-a", "my model\n", False)]
        for line, (completion, key, model, stream) in zip(lines, want):
            if fmt == "json":
                doc = msgspec.json.decode(line)
                assert (doc["prompt_tokens"], doc["completion_tokens"]) == ((prompt, completion) if completion
                                                                            else (None, None))
                assert doc["cached_tokens"] is None or doc["cached_tokens"] >= 0
                assert (doc["client"], doc["key"], doc["model"], doc["stream"]) == ("127.0.0.1", key, model, stream)
            else:
                if completion:
                    assert f" tokens={prompt}/{completion} cached=" in line
                else:  # no answer, no tokens
                    assert " tokens=-/- cached=- " in line
                shown = {None: "-", "my model\n": "my%20model%0A"}.get(model, model)
                assert f" client=127.0.0.1 model={shown} key={key} {'ok' if completion else 'error'}" in line, line


async def test_the_forwarded_client_only_behind_trusted_proxies():
    forwarded = [(b"x-forwarded-for", b"198.51.100.1, 203.0.113.7, 127.0.0.2")]
    for trusted, want in (((), "127.0.0.1"), (("127.0.0.0/8",), "203.0.113.7"), (("10.0.0.0/8",), "127.0.0.1")):
        out = io.StringIO()
        async with stack() as (cluster, proxy, client):
            proxy.app.pipeline.access_log = AccessLog("json", stream=out, trusted_proxies=trusted)
            assert (await client.chat(chat_body(max_tokens=2), forwarded)).status == 200
            assert (await client.request("GET", "/health", headers=forwarded)).status == 200
        docs = [msgspec.json.decode(line) for line in out.getvalue().splitlines()]
        assert [d["client"] for d in docs] == [want, want], trusted


async def test_a_real_proxy_logs_the_key_name_and_the_forwarded_client(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("billing-team:sk-123\n")
    async with SimCluster(prefill=1, decode=1, config=SimConfig(itl_ms=0, ttft_ms=0.5)) as cluster:
        body = msgspec.json.encode(chat_body(stream=True, max_tokens=3))
        async with child_proxy(cluster, "--api-key-file", str(keys), "--trusted-proxies", "127.0.0.0/8,10.0.0.0/8",
                               stderr=asyncio.subprocess.PIPE) as (proc, url):
            reply = await fresh_request(url, "POST", "/v1/chat/completions", body,
                                        JSON + [(b"authorization", b"Bearer sk-123"),
                                                (b"x-forwarded-for", b"203.0.113.9")])
            assert reply.status == 200
            os.killpg(proc.pid, signal.SIGTERM)
            err = (await asyncio.wait_for(proc.stderr.read(), 10)).decode()
            await proc.wait()
    line = next(line for line in err.splitlines() if "epd_proxy.access" in line and "/v1/chat" in line)
    assert " tokens=" in line and " tokens=-" not in line and "/3 cached=" in line
    assert " client=203.0.113.9 model=sim-model key=billing-team ok" in line
