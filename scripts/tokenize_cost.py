"""Where a chat request's prompt tokens come from, for the KV block index: what each way costs.

Three ways to get the tokens the engine will see (chat template included):

* ``remote``: the instance's own ``POST /tokenize`` (what ``request/kv_lookup.py`` does): the
  round trip, sequential, on one keep-alive connection (low load);
* ``local``: the model's ``tokenizer.json`` (HF ``tokenizers``) and its chat template rendered
  locally (``jinja2``, as transformers renders it), in this process: time and CPU per request;
  ``transformers``' ``apply_chat_template`` too, and the memory the tokenizer takes;
* ``incremental``: only what is new since the previous turn (the new messages rendered and
  encoded, appended to the previous turn's tokens): what it saves, and whether the result is
  the full tokenization's.

With ``--ttft`` it also starts ``epd-proxy serve`` twice in front of the instance (KV events
on: every chat request pays the ``/tokenize`` call; off: it does not) and measures sequential
non-streamed 1-token chat requests through each (TTFT at low load).

Run with a Python that has ``tokenizers``, ``jinja2`` and ``transformers`` (the e2e vLLM venv),
against one instance (``--url``) or one it starts from the e2e environment (``--start``):

    flock /tmp/epd-vllm.lock flock /tmp/epd-heavy.lock \\
        ~/.cache/epd-proxy-e2e/venv/bin/python scripts/tokenize_cost.py --start --ttft [--n 300]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import resource
import statistics
import sys
import tempfile
import time
import urllib.parse

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "e2e"))

import vllm_e2e as E  # noqa: E402

WORDS = ("the quick brown fox jumps over a lazy dog while the cluster serves prefill and decode "
         "requests from many tenants across regions").split()
TURNS = (1, 4, 8)
USER_WORDS, ANSWER_WORDS = 30, 15


def _text(rnd: random.Random, n: int) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(n))


def conversation(seed: int, turns: int) -> list[dict]:
    """``turns`` user messages with the assistant's answers between them, ending on a user turn."""
    rnd = random.Random(seed)
    msgs: list[dict] = [{"role": "user", "content": f"conversation {seed}: " + _text(rnd, USER_WORDS)}]
    for _ in range(turns - 1):
        msgs += [{"role": "assistant", "content": _text(rnd, ANSWER_WORDS)},
                 {"role": "user", "content": _text(rnd, USER_WORDS)}]
    return msgs


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _summary(xs: list[float]) -> dict:
    return {"p50_ms": round(_pct(xs, 0.5) * 1e3, 3), "p99_ms": round(_pct(xs, 0.99) * 1e3, 3),
            "mean_ms": round(statistics.fmean(xs) * 1e3, 3)}


# -- local ----------------------------------------------------------------------------------


class LocalTokenizer:
    """tokenizer.json + the chat template, rendered as transformers renders it."""

    def __init__(self, model_dir: str) -> None:
        import jinja2.sandbox
        import tokenizers

        self.tok = tokenizers.Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        with open(os.path.join(model_dir, "chat_template.jinja")) as f:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self.template = env.from_string(f.read())

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt)

    def ids(self, messages: list[dict]) -> list[int]:
        # vLLM's chat path tokenizes the rendered prompt without adding special tokens again
        return self.tok.encode(self.render(messages), add_special_tokens=False).ids


def measure_local(model_dir: str, n: int) -> dict:
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    local = LocalTokenizer(model_dir)
    load_s = time.perf_counter() - t
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out: dict = {"load_ms": round(load_s * 1e3, 1), "rss_kib": rss1 - rss0, "turns": {}}
    for turns in TURNS:
        convs = [conversation(i, turns) for i in range(n)]
        render, encode, wall = [], [], []
        cpu0 = time.process_time()
        for msgs in convs:
            t0 = time.perf_counter()
            text = local.render(msgs)
            t1 = time.perf_counter()
            ids = local.tok.encode(text, add_special_tokens=False).ids
            t2 = time.perf_counter()
            render.append(t1 - t0)
            encode.append(t2 - t1)
            wall.append(t2 - t0)
        cpu = (time.process_time() - cpu0) / n
        # incremental: the previous turn's tokens kept, the new messages (answer + user message)
        # rendered and encoded alone, appended. Exact only if the template renders every message
        # on its own and no token spans a message boundary.
        inc, exact = [], 0
        for msgs in convs:
            prev = msgs[:-2] if turns > 1 else []
            prev_ids = local.tok.encode(local.render(prev, False), add_special_tokens=False).ids if prev else []
            t0 = time.perf_counter()
            new = local.render(msgs[len(prev):])
            ids = prev_ids + local.tok.encode(new, add_special_tokens=False).ids
            inc.append(time.perf_counter() - t0)
            exact += ids == local.ids(msgs)
        out["turns"][turns] = {"tokens": len(ids), "render": _summary(render), "encode": _summary(encode),
                               "total": _summary(wall), "cpu_us": round(cpu * 1e6, 1),
                               "incremental": _summary(inc), "incremental_exact": f"{exact}/{n}"}
    try:
        from transformers import AutoTokenizer
        t = time.perf_counter()
        hf = AutoTokenizer.from_pretrained(model_dir)
        out["transformers_load_ms"] = round((time.perf_counter() - t) * 1e3, 1)
        out["transformers_rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss1
        for turns in TURNS:
            convs = [conversation(i, turns) for i in range(n)]
            wall = []
            for msgs in convs:
                t0 = time.perf_counter()
                hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
                wall.append(time.perf_counter() - t0)
            some = convs[:20]
            same = sum(_ids_of(hf.apply_chat_template(m, add_generation_prompt=True, tokenize=True))
                       == local.ids(m) for m in some)
            out["turns"][turns]["transformers"] = _summary(wall)
            out["turns"][turns]["transformers_same_as_local"] = f"{same}/{len(some)}"
    except ImportError as exc:
        out["transformers"] = f"not measured: {exc}"
    return out


def _ids_of(x) -> list[int]:
    if isinstance(x, dict) or hasattr(x, "keys"):
        return list(x["input_ids"])
    return list(x)


# -- remote ---------------------------------------------------------------------------------


class Client:
    """One keep-alive connection."""

    def __init__(self, url: str) -> None:
        u = urllib.parse.urlsplit(url)
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)

    def post(self, path: str, body: dict) -> tuple[int, bytes]:
        self.conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
        r = self.conn.getresponse()
        return r.status, r.read()


def measure_remote(url: str, n: int, model_dir: str | None) -> dict:
    c = Client(url)
    local = LocalTokenizer(model_dir) if model_dir else None
    out: dict = {}
    for turns in TURNS:
        convs = [conversation(10_000 + i, turns) for i in range(n + 20)]
        lat, same = [], 0
        for i, msgs in enumerate(convs):
            t0 = time.perf_counter()
            status, data = c.post("/tokenize", {"model": E.MODEL_NAME, "messages": msgs,
                                                "add_generation_prompt": True})
            dt = time.perf_counter() - t0
            assert status == 200, data[:300]
            if i >= 20:  # the first ones warm the instance's template cache
                lat.append(dt)
            if local is not None:
                same += json.loads(data)["tokens"] == local.ids(msgs)
        out[turns] = {"tokenize": _summary(lat),
                      **({"local_same_as_instance": f"{same}/{len(convs)}"} if local else {})}
    return out


def _ttft(url: str, n: int, turns: int) -> dict:
    c = Client(url)
    lat = []
    for i in range(n + 20):
        msgs = conversation(20_000 + i + 1000 * turns, turns)
        t0 = time.perf_counter()
        status, data = c.post("/v1/chat/completions", {"model": E.MODEL_NAME, "messages": msgs, "max_tokens": 1,
                                                       "temperature": 0})
        dt = time.perf_counter() - t0
        assert status == 200, data[:300]
        if i >= 20:
            lat.append(dt)
    return _summary(lat)


def measure_ttft(inst: "E.Vllm", n: int, proxy_python: str, log_dir: str) -> dict:
    """Sequential 1-token chat requests: the instance alone, and through the proxy with KV
    events off and on (PD topology: the instance serves whole requests, tokenizes for the index)."""
    out: dict = {}
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "src"))
    for label, spec in (("events_off", inst.url), ("events_on", inst.events_spec())):
        port = E.free_port()
        argv = [proxy_python, "-m", "epd_proxy", "serve", "--host", "127.0.0.1", "--port", str(port),
                "--decode", spec, "--log-level", "warning", "--shutdown-grace", "0"]
        proc = E.Proc(f"proxy-{label}", argv, env, log_dir, cwd=REPO)
        try:
            E.wait_http_ok(proc, f"http://127.0.0.1:{port}", 30, "/ready")
            if label == "events_on":
                E.wait_for(lambda port=port: E.request(f"http://127.0.0.1:{port}", "GET", "/status").json()["kv_events"]
                           ["instances"][inst.url][0]["connected"], 30)
            for turns in TURNS:
                out.setdefault(turns, {})[label] = _ttft(f"http://127.0.0.1:{port}", n, turns)
            if label == "events_on":
                m = E.Metrics.scrape(f"http://127.0.0.1:{port}")
                out["lookups_indexed"] = m.get("epd_proxy_kv_lookups_total", outcome="indexed")
                out["tokenize_seconds"] = m.get("epd_proxy_kv_tokenize_seconds_total")
        finally:
            proc.stop()
    for turns in TURNS:
        out[turns]["direct"] = _ttft(inst.url, n, turns)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a vLLM instance serving the tiny model (else --start)")
    ap.add_argument("--start", action="store_true", help="start one from the e2e environment")
    ap.add_argument("--ttft", action="store_true", help="TTFT through epd-proxy with KV events off and on (--start)")
    ap.add_argument("--n", type=int, default=300, help="requests per measurement")
    ap.add_argument("--model-dir", default=os.path.join(E.MODELS, "tiny-model"))
    ap.add_argument("--loop", type=int, metavar="N",
                    help="only N local tokenizations (--loop-mode) and exit: for instruction counts, run it "
                         "under `valgrind --tool=callgrind` against --loop-mode none (the conversations built, "
                         "nothing tokenized) and divide the difference by N")
    ap.add_argument("--loop-turns", type=int, default=4)
    ap.add_argument("--loop-mode", choices=("full", "incremental", "none"), default="full")
    ap.add_argument("--proxy-python", default=os.path.join(REPO, ".venv", "bin", "python"))
    args = ap.parse_args()
    if args.loop is not None:
        local = LocalTokenizer(args.model_dir)
        for i in range(args.loop):
            msgs = conversation(i, args.loop_turns)
            if args.loop_mode == "full":
                local.ids(msgs)
            elif args.loop_mode == "incremental":
                local.tok.encode(local.render(msgs[-2:]), add_special_tokens=False)
        return
    res: dict = {"n": args.n, "local": measure_local(args.model_dir, args.n)}
    inst = None
    log_dir = tempfile.mkdtemp(prefix="tokenize-cost-") if args.start else ""
    try:
        url = args.url
        if args.start:
            inst = E.Vllm("tokenize-cost", "tiny-model", 0, max_model_len=2048, kv_events=True,
                          args=["--block-size", "32"])
            inst.start(log_dir)
            inst.wait_ready()
            url = inst.url
        if url:
            res["remote"] = measure_remote(url, args.n, args.model_dir)
        if args.ttft and inst is not None:
            res["ttft"] = measure_ttft(inst, args.n, args.proxy_python, log_dir)
    finally:
        if inst is not None:
            inst.stop()
    json.dump(res, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
