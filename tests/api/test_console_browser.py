"""The console as a person sees it: headless Chromium (Debian's ``chromium``; installed by
scripts/ensure-system-packages.sh) opens ``/console`` in front of a simulated cluster under
load, with one decode made to fail, and the DOM it built is checked: every instance with its
state in words, the live numbers moving, a request sent with a known id shown with its legs.
The screenshot is kept (its path is printed)."""

import asyncio
import os
import re
import shutil
from html.parser import HTMLParser

import pytest
from cdp import Page, in_thread
from helpers import chat_body, stack, wait_for

from epd_proxy import ProxyConfig, start_proxy
from epd_proxy.runtime.serve import config_for_cluster
from epd_proxy.sim import SimCluster, SimConfig, expected_text

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (scripts/ensure-system-"
                                                          "packages.sh installs it when run as root)")
KNOWN = "console-browser-42"


class Dom(HTMLParser):
    """The elements with a ``data-*`` hook, with their text."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: list[dict] = []  # attrs + "text"
        self._open: list[dict] = []

    def handle_starttag(self, tag, attrs):
        if tag in ("br", "input", "meta", "link", "img"):
            return
        node = dict(attrs, tag=tag, text="")
        self._open.append(node)
        if any(k.startswith("data-") or k == "id" for k, _ in attrs):
            self.elements.append(node)

    def handle_endtag(self, tag):
        if tag in ("br", "input", "meta", "link", "img"):
            return
        while self._open:
            node = self._open.pop()
            if self._open:
                self._open[-1]["text"] += node["text"]
            if node["tag"] == tag:
                break

    def handle_data(self, data):
        if self._open:
            self._open[-1]["text"] += data

    def find(self, **attrs) -> list[dict]:
        return [e for e in self.elements if all(e.get(k.replace("_", "-")) == v for k, v in attrs.items())]

    def by_id(self, value: str) -> dict:
        [node] = [e for e in self.elements if e.get("id") == value]
        return node


async def _chromium(profile: str, url: str, *args: str) -> bytes:
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run", "--disable-extensions",
        "--hide-scrollbars", f"--user-data-dir={profile}", "--virtual-time-budget=4000", *args, url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    out, _ = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode == 0, "chromium failed"
    return out


async def test_the_console_in_a_browser_shows_the_cluster_the_traffic_and_a_request_s_path(tmp_path):
    sim = SimConfig(itl_ms=2, ttft_ms=3)
    async with stack(encode=1, prefill=1, decode=2, sim=sim) as (cluster, proxy, client):
        await client.request("GET", "/console/api/state")  # a console is open: requests are recorded
        broken = cluster.instances("decode")[1]
        await broken.crash()
        stop = asyncio.Event()

        async def load() -> None:
            i = 0
            while not stop.is_set():
                await client.chat(chat_body(f"load {i}", stream=True, max_tokens=8),
                                  headers=[(b"x-request-id", b"load-%d" % i)])
                i += 1
                await asyncio.sleep(0.02)

        known = await client.chat(chat_body("the known one", stream=True, images=["https://example.com/cat.png"]),
                                  headers=[(b"x-request-id", KNOWN.encode())])
        assert known.status == 200
        loader = asyncio.get_running_loop().create_task(load())
        try:
            await asyncio.sleep(0.3)
            url = f"{proxy.url}/console?id={KNOWN}"
            first = Dom()
            first.feed((await _chromium(str(tmp_path / "profile"), url, "--dump-dom")).decode())
            await asyncio.sleep(0.5)
            second = Dom()
            second.feed((await _chromium(str(tmp_path / "profile"), url, "--dump-dom")).decode())
            shot = tmp_path / "console.png"
            await _chromium(str(tmp_path / "profile"), url, "--window-size=1400,2200", f"--screenshot={shot}")
            narrow = tmp_path / "console-narrow.png"  # a phone's width: one column, nothing cut off
            await _chromium(str(tmp_path / "profile"), url, "--window-size=390,2400", f"--screenshot={narrow}")
        finally:
            stop.set()
            await loader
        print(f"\nconsole screenshots: {shot} {narrow}")
        assert shot.stat().st_size > 10_000 and narrow.stat().st_size > 10_000

    for dom in (first, second):
        assert "live: updated" in dom.by_id("live")["text"]
        # Every instance, with its state in words (and a symbol), the failed one out.
        cards = {c["data-url"]: c for c in dom.find(tag="article")}
        assert set(cards) == {i.url for i in cluster.all_instances()}
        assert cards[broken.url]["data-state"] == "ejected" and "out: ejected" in cards[broken.url]["text"]
        assert "cannot connect" in cards[broken.url]["text"]
        for inst_url, card in cards.items():
            if inst_url != broken.url:
                assert card["data-state"] == "healthy" and "in rotation" in card["text"]
        # The known request's path: its legs, each with the instance that served it.
        detail = dom.by_id("detail")
        assert detail.get("data-request-id") == KNOWN and "hidden" not in detail
        stages = {s["data-stage"]: s["text"] for s in dom.find(tag="li") if "data-stage" in s}
        assert {"encode", "prefill", "decode", "first_byte", "stream"} <= set(stages)
        assert cluster.urls("encode")[0].split("//")[1] in stages["encode"]
        assert cluster.urls("prefill")[0].split("//")[1] in stages["prefill"]
        assert "encode (1 item)" in stages["encode"]
        # The live numbers: requests per second under load.
        rps = float(re.search(r"[\d.]+", dom.find(data_tile="rps")[0]["text"]).group())
        assert rps > 0
    # The page polled again and again: the second look shows requests the first could not.
    ids = [{r["data-request-id"] for r in dom.find(tag="tr") if "data-request-id" in r} for dom in (first, second)]
    assert ids[1] - ids[0]
    assert os.path.getsize(shot) > 0


def _conversation(turns: int) -> list[dict]:
    system = " ".join(f"w{i}" for i in range(300))  # long enough for decode to keep its blocks
    body = {"model": "sim-model", "max_tokens": 120,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "first question"}]}
    out = [body]
    for i in range(turns - 1):
        body = dict(body, messages=body["messages"] + [{"role": "assistant", "content": expected_text(body)},
                                                       {"role": "user", "content": f"next question {i}"}])
        out.append(body)
    return out


async def test_the_console_shows_kv_events_held_kv_and_a_turn_s_reuse(tmp_path):
    """KV events published by the simulator and a conversation whose turns reuse decode's KV
    (bidirectional transfer): each card says whether its events are live, in words; the decode
    says what it holds for a next turn; a reused turn says so in the table and its waterfall.
    One prefill is stopped: its events go stale, and its card says so."""
    sim = SimConfig(itl_ms=1, ttft_ms=1, bidirectional=True, kv_events=True)
    async with stack(prefill=2, decode=1, sim=sim, local_prefill_max_tokens=0) as (cluster, proxy, client):
        await client.request("GET", "/console/api/state")  # a console is open: requests are recorded
        await wait_for(lambda: len(proxy.app.kv_events.live()) == 3)
        for i, body in enumerate(_conversation(3)):
            assert (await client.chat(body, headers=[(b"x-request-id", b"turn-%d" % i)])).status == 200
        stopped = cluster.instances("prefill")[1]
        await stopped.crash()
        await wait_for(lambda: stopped.url not in proxy.app.kv_events.live(), timeout=10)
        url = f"{proxy.url}/console?id=turn-2"
        dom = Dom()
        dom.feed((await _chromium(str(tmp_path / "profile"), url, "--dump-dom")).decode())
        shot = tmp_path / "console-kv.png"
        await _chromium(str(tmp_path / "profile"), url, "--window-size=1400,2600", f"--screenshot={shot}")
        print(f"\nconsole screenshot: {shot}")
        decode = cluster.urls("decode")[0]

    cards = {c["data-url"]: c for c in dom.find(tag="article")}
    assert set(cards) == {i.url for i in cluster.all_instances()}
    assert sorted(e["data-kv-events"] for e in dom.elements if e.get("data-kv-events")) == [
        "connected", "connected", "stale"]
    assert "KV events" in cards[decode]["text"] and "connected: its events are live" in cards[decode]["text"]
    assert "stale: its replay socket does not answer" in cards[stopped.url]["text"]
    assert "blocks indexed" in cards[decode]["text"]
    assert "kept for a next turn" in cards[decode]["text"]  # the held KV, in words
    held = [e for e in dom.find(tag="dd") if "data-held-tokens" in e]
    assert len(held) == 1 and int(held[0]["data-held-tokens"]) > 0
    # The turns' outcomes in the table: the later turns reused decode's KV.
    outcomes = {r["data-request-id"]: r for r in dom.find(tag="tr") if "data-request-id" in r}
    assert "reused" in outcomes["turn-2"]["text"] and "reused" in outcomes["turn-1"]["text"]
    cells = [e for e in dom.find(tag="td") if e.get("data-kv-outcome") == "reused"]
    assert len(cells) == 2
    # ... and in the request's waterfall, with the decode it was held on.
    assert dom.by_id("detail").get("data-request-id") == "turn-2"
    stages = {s["data-stage"]: s["text"] for s in dom.find(tag="li") if "data-stage" in s}
    assert "multi-turn KV reused" in stages["kv_reuse"] and decode.split("//")[1] in stages["kv_reuse"]
    assert "2 of 2" in dom.find(data_tile="reused")[0]["text"]
    assert shot.stat().st_size > 10_000


LONG_MODEL = "meta-llama/Llama-3.3-70B-Instruct-FP8-dynamic"  # a real model id: one long unbreakable word
_WHY_BOXES = """(() => {
  const width = document.documentElement.clientWidth;
  const cells = [...document.querySelectorAll('#models td, #cluster .why')].filter(
    (e) => /no decode instance|health probe/.test(e.textContent));
  return {width, boxes: cells.map((e) => { const r = e.getBoundingClientRect();
    return {text: e.textContent, left: r.left, right: r.right, height: r.height}; })};
})()"""


def _narrow_look(url: str, profile: str, shot: str) -> dict:
    with Page(profile, 400, 1400) as page:
        page.open(url)
        page.wait_for("document.querySelector('#models tbody tr')"
                      " && document.querySelector('article[data-role=encode]')"
                      " && /blocks/.test(document.querySelector('article[data-role=prefill]').textContent)")
        page.screenshot(shot)
        out = page.evaluate(_WHY_BOXES)
        out["scope"] = page.evaluate("document.getElementById('gateway-scope').textContent")
        out["cards"] = page.evaluate("Object.fromEntries([...document.querySelectorAll('article')].map("
                                     "(a) => [a.dataset.role + ' ' + a.dataset.url, a.textContent]))")
        return out


async def test_at_400_px_why_a_model_or_instance_is_out_is_on_screen_and_encoders_show_their_queue(tmp_path):
    """Both decodes down: the models table says why the model cannot be served and each decode
    card why it is out, inside a 400 px wide screen (the real layout, asked of the browser);
    the encoder's card shows its queue, not a KV cache; prefill and decode cards say their KV
    cache's use with its size in blocks (vllm:cache_config_info)."""
    sim = SimConfig(model=LONG_MODEL, itl_ms=2, ttft_ms=3)
    async with SimCluster(encode=1, prefill=1, decode=2, config=sim) as cluster:
        config = config_for_cluster(cluster, ProxyConfig(probe_interval=0.1, scrape_interval=0.1))
        async with await start_proxy(config) as proxy:
            for decode in cluster.instances("decode"):
                await decode.crash()
            shot = tmp_path / "console-400px.png"
            look = await in_thread(_narrow_look, f"{proxy.url}/console", str(tmp_path / "profile"), str(shot))
    print(f"\nconsole screenshot at 400 px: {shot}")
    texts = " | ".join(b["text"] for b in look["boxes"])
    assert "no decode instance serves it" in texts and "health probe" in texts, texts
    for box in look["boxes"]:  # every reason inside the screen, none scrolled off to the right
        assert box["left"] >= 0 and box["right"] <= look["width"] + 0.5 and box["height"] > 0, (box, look["width"])
    assert look["scope"].startswith("(one replica: this proxy only")  # no store: the console says what it covers
    cards = look["cards"]
    [encoder] = [text for key, text in cards.items() if key.startswith("encode ")]
    assert "Queue" in encoder and "not from this proxy" in encoder and "KV cache" not in encoder, encoder
    [prefill] = [text for key, text in cards.items() if key.startswith("prefill ")]
    assert re.search(r"KV cache [\d.]+ % \([\d,]+ of 65,536 blocks\)", prefill), prefill


_CHARTS = """(() => Object.fromEntries([...document.querySelectorAll('#charts figure')].map((f) => [f.dataset.chart, {
  label: f.querySelector('svg').getAttribute('aria-label'), caption: f.querySelector('figcaption').textContent,
  lines: [...f.querySelectorAll('polyline')].map((p) => ({series: p.dataset.series,
    ys: p.getAttribute('points').split(' ').filter(Boolean).map((xy) => Number(xy.split(',')[1]))})),
  legend: [...f.querySelectorAll('.legend li')].map((li) => li.textContent)}])))()"""


def _chart_look(url: str, profile: str, shot: str) -> dict:
    with Page(profile, 1300, 1800) as page:
        page.open(url)
        page.wait_for("(document.querySelector('[data-chart=rps] svg') || {dataset: {}}).dataset.points >= 4", 30)
        page.evaluate("document.getElementById('traffic-h').scrollIntoView()")
        page.screenshot(shot, full=False)
        return page.evaluate(_CHARTS)


async def test_the_traffic_charts_draw_the_last_minutes_from_the_polls(tmp_path):
    """Under load, the page's small charts (requests/s, errors, TTFT and ITL p50/p99, reused
    turns, the requests on each instance) grow a point per poll, drawn as inline SVG."""
    sim = SimConfig(itl_ms=2, ttft_ms=3)
    async with stack(prefill=1, decode=2, sim=sim) as (cluster, proxy, client):
        stop = asyncio.Event()

        async def load() -> None:
            i = 0
            while not stop.is_set():
                await client.chat(chat_body(f"chart {i}", stream=True, max_tokens=8))
                i += 1
                await asyncio.sleep(0.01)

        await client.request("GET", "/console/api/state")
        loader = asyncio.get_running_loop().create_task(load())
        try:
            shot = tmp_path / "console-charts.png"
            charts = await in_thread(_chart_look, f"{proxy.url}/console", str(tmp_path / "profile"), str(shot))
        finally:
            stop.set()
            await loader
        print(f"\nconsole charts screenshot: {shot}")
        urls = cluster.urls("prefill") + cluster.urls("decode")
    assert set(charts) == {"rps", "errors", "ttft", "itl", "reused", "load"}
    [rps] = charts["rps"]["lines"]
    assert len(rps["ys"]) >= 4 and min(rps["ys"]) < 80  # points, off the floor: requests were served
    assert [line["series"] for line in charts["ttft"]["lines"]] == ["p50", "p99"]
    assert all(len(line["ys"]) >= 4 for line in charts["ttft"]["lines"] + charts["itl"]["lines"])
    assert "requests / s, over the last 60 s: now" in charts["rps"]["label"]
    # One line per instance, named in the legend.
    assert len(charts["load"]["lines"]) == 3
    assert sorted(u.split("//")[1] in " ".join(charts["load"]["legend"]) for u in urls) == [True] * 3
