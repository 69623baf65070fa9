"""Reloading (reload.py): the pure rules, a reload applied in process with streams in flight,
and real proxy processes that get SIGHUP or see their cluster file change."""

import argparse
import asyncio
import logging
import os
import signal

from helpers import Client, chat_body, wait_for
from proxy_process import ProxyProcess

from epd_proxy import start_proxy
from epd_proxy.cli import build_parser
from epd_proxy.cli.serve import ServeSettings
from epd_proxy.runtime.reload import FileWatch, Reloader, emptied_roles, restart_needed
from epd_proxy.runtime.serve import apply_config
from epd_proxy.sim import SimCluster, SimConfig


def test_only_the_instances_change_at_run_time():
    old = argparse.Namespace(port=8000, workers=1, decode=["http://a:1"], prefill=None, routing="least-loaded")
    new = argparse.Namespace(port=9000, workers=1, decode=["http://b:1"], prefill=["http://p:1"],
                             routing="round-robin")
    assert restart_needed(old, new) == ["port", "routing"]
    assert restart_needed(old, old) == []


def test_a_file_watch_sees_a_rewrite_and_a_replacement(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text("port = 1\n")
    watch = FileWatch(str(path))
    assert not watch.changed()
    path.write_text("port = 22\n")  # another size
    assert watch.changed() and not watch.changed()
    other = tmp_path / "new.toml"
    other.write_text("port = 33\n")
    os.replace(other, path)  # how editors and ConfigMap updates swap a file
    assert watch.changed()
    path.unlink()
    assert not watch.changed()  # a missing file is no change (the reload would fail anyway)


def _settings(path) -> ServeSettings:
    argv = ["serve", "--config", str(path)]
    settings = ServeSettings(argv, build_parser().parse_args(argv))
    settings.started = settings.load()
    return settings


def _served(inst) -> int:
    return len(inst.generation_records())


async def test_a_reload_applies_the_instances_as_a_diff_and_lets_streams_finish(tmp_path, caplog):
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, roles={"decode": {"itl_ms": 5}})
    async with SimCluster(decode=2, config=sim) as cluster:
        a, b = cluster.instances("decode")
        path = tmp_path / "cluster.toml"
        path.write_text(f'probe_interval = 0\ndecode = ["{a.url}"]\n')
        settings = _settings(path)
        async with await start_proxy(settings.config(settings.started)) as proxy:
            reloader = Reloader(settings, lambda cfg: apply_config(proxy, cfg), args=settings.started,
                                watch=False)
            client = Client(proxy.url)
            try:
                stream = asyncio.ensure_future(client.chat(chat_body(stream=True, max_tokens=200), timeout=30))
                await wait_for(lambda: a._in_flight == 1)
                path.write_text(f'probe_interval = 0\nport = 9999\ndecode = ["{b.url}"]\n')
                with caplog.at_level(logging.INFO, "epd_proxy.reload"):
                    assert reloader.reload()
                assert "changed port: applied at the next restart only" in caplog.text
                # New requests go to the new instance; the stream on the old one goes on.
                for _ in range(3):
                    assert (await client.chat(chat_body())).status == 200
                assert _served(b) == 3 and not stream.done()
                reply = await stream
                assert reply.status == 200 and reply.events[-1] == b"data: [DONE]"
                assert len(reply.events) > 200
                # Then the old one leaves the roster.
                await wait_for(lambda: proxy.app.membership.find(a.url) is None)
                # A bad file changes nothing.
                path.write_text('decode = ["http://c:1"]\nrouting = "random"\n')
                with caplog.at_level(logging.ERROR, "epd_proxy.reload"):
                    assert not reloader.reload()
                assert f"reload: {path}: routing must be one of" in caplog.text
                assert [i.url for i in proxy.app.pools["decode"].instances] == [b.url]
            finally:
                await client.close()


async def _roster_of_every_worker(proxy: ProxyProcess, workers: int, want, timeout: float = 10.0) -> dict:
    """GET /status over new connections (the kernel spreads them over the workers) until every
    worker's decode roster satisfies ``want``; returns {pid: urls}."""
    seen: dict[int, list[str]] = {}
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        status = (await proxy.fresh_get("/status")).json()
        seen[status["pid"]] = sorted(i["url"] for i in status["pools"]["decode"] if i["state"] != "draining")
        if len(seen) == workers and all(want(urls) for urls in seen.values()):
            return seen
        assert loop.time() < end, f"not every worker got there: {seen}\n{proxy.log()}"
        await asyncio.sleep(0.02)


async def test_sighup_and_a_changed_file_reload_every_worker(tmp_path):
    async with SimCluster(decode=3, config=SimConfig(itl_ms=0, ttft_ms=0.5)) as cluster:
        a, b, c = (i.url for i in cluster.instances("decode"))
        path = tmp_path / "cluster.toml"
        path.write_text(f'probe_interval = 0\nworkers = 2\ndecode = ["{a}"]\n')
        async with ProxyProcess(["--config", str(path)]) as proxy:
            await _roster_of_every_worker(proxy, 2, lambda urls: urls == [a])
            # A change to the file: the parent sees it and reloads every worker.
            path.write_text(f'probe_interval = 0\nworkers = 2\ndecode = ["{a}", "{b}"]\n')
            await _roster_of_every_worker(proxy, 2, lambda urls: urls == sorted([a, b]))
            # SIGHUP to the parent: passed on, and nobody dies of it.
            path.write_text(f'probe_interval = 0\nworkers = 2\ndecode = ["{c}"]\n')
            proxy.proc.send_signal(signal.SIGHUP)
            await _roster_of_every_worker(proxy, 2, lambda urls: urls == [c])
            assert proxy.proc.returncode is None
            assert (await proxy.fresh_get("/health")).status == 200


async def test_sighup_without_a_cluster_file_kills_no_process():
    async with SimCluster(decode=1, config=SimConfig(itl_ms=0, ttft_ms=0.5)) as cluster:
        for workers in (1, 2):
            async with ProxyProcess(["--decode", cluster.urls("decode")[0], "--workers", str(workers)]) as proxy:
                for n in (1, 2):
                    proxy.proc.send_signal(signal.SIGHUP)
                    await proxy.wait_log("reload: no cluster file to re-read", count=n * workers)
                assert proxy.proc.returncode is None
                await _roster_of_every_worker(proxy, workers, lambda urls: urls == cluster.urls("decode"))
                # A worker whose siblings are slow to answer a scrape (a loaded machine) reports their
                # counters as the parent last kept them: the count converges, it is not exact at once.
                deadline = asyncio.get_running_loop().time() + 10
                while True:
                    metrics = (await proxy.fresh_get("/metrics")).body
                    if b'epd_proxy_reloads_total{result="ok"} 2.0' in metrics:
                        break
                    assert asyncio.get_running_loop().time() < deadline, metrics[-2000:]
                    await asyncio.sleep(0.2)


async def test_sighup_reloads_a_single_process(tmp_path):
    async with SimCluster(decode=2, config=SimConfig(itl_ms=0, ttft_ms=0.5)) as cluster:
        a, b = cluster.urls("decode")
        path = tmp_path / "cluster.toml"
        path.write_text(f'probe_interval = 0\ndecode = ["{a}"]\n')
        settings = _settings(path)
        async with await start_proxy(settings.config(settings.started)) as proxy:
            reloader = Reloader(settings, lambda cfg: apply_config(proxy, cfg), args=settings.started,
                                watch=False)
            reloader.start()
            try:
                path.write_text(f'probe_interval = 0\ndecode = ["{b}"]\n')
                os.kill(os.getpid(), signal.SIGHUP)
                await wait_for(lambda: reloader.reloads == 1)
                assert [i.url for i in proxy.app.pools["decode"].instances if i.state != "draining"] == [b]
            finally:
                await reloader.close()


def test_a_reload_may_empty_only_the_roles_its_file_allows():
    running = argparse.Namespace(encode=["http://e:1"], prefill=None, decode=["http://d:1,http://d:2"])

    def config(*flags):
        args = build_parser().parse_args(["serve", *flags])
        return ServeSettings(["serve", *flags], args).config(args)

    emptied = config("--decode", "http://d:1")
    assert emptied_roles(running, emptied) == ["encode"] and emptied_roles(running, emptied, allowed=True) == []
    allowed = config("--decode", "http://d:1", "--allow-empty-roles", "prefill,encode")
    assert allowed.allow_empty_roles == ("prefill", "encode")
    assert emptied_roles(running, allowed) == [] and emptied_roles(running, allowed, allowed=True) == ["encode"]
    dns = config("--encode", "dns+http://e.svc:1", "--decode", "http://d:3")
    assert emptied_roles(running, dns) == []  # a name is an instance


async def _status_roles(proxy: ProxyProcess) -> dict:
    status = (await proxy.fresh_get("/status")).json()
    return {role: sorted(i["url"] for i in pool if i["state"] != "draining")
            for role, pool in status["pools"].items()}


async def test_a_reload_keeps_the_simulated_instances(tmp_path):
    """--simulate with a cluster file holding no instances (only [tenants], or simulate as its key):
    SIGHUP and a changed file keep the simulated cluster, and requests keep being answered."""
    tenants = '[tenants.default]\nrequests_per_minute = 1000\n'
    for flags, head in ((["--simulate", "prefill=1,decode=1"], ""), ([], 'simulate = "prefill=1,decode=1"\n')):
        path = tmp_path / "cluster.toml"
        path.write_text(head + tenants)
        async with ProxyProcess([*flags, "--config", str(path), "--probe-interval", "0"]) as proxy:
            before = await _status_roles(proxy)
            assert len(before["prefill"]) == 1 and len(before["decode"]) == 1
            proxy.proc.send_signal(signal.SIGHUP)
            await proxy.wait_log("reload: ", count=1)
            path.write_text(head + tenants.replace("1000", "2000"))  # an edit of the file
            await proxy.wait_log(f"reload: {path} applied", count=2)
            assert "applied (0 encode, 1 prefill, 1 decode)" in proxy.log()
            assert await _status_roles(proxy) == before
            client = Client(proxy.url)
            try:
                assert (await client.chat(chat_body())).status == 200
            finally:
                await client.close()


async def test_a_reload_that_would_empty_a_role_is_refused_unless_the_file_says_so(tmp_path):
    async with SimCluster(encode=1, decode=2, config=SimConfig(itl_ms=0, ttft_ms=0.5)) as cluster:
        (e,), (a, b) = cluster.urls("encode"), cluster.urls("decode")
        path = tmp_path / "cluster.toml"
        path.write_text(f'probe_interval = 0\nencode = ["{e}"]\ndecode = ["{a}"]\n')
        async with ProxyProcess(["--config", str(path)]) as proxy:
            # The encoders' list emptied (and a decode changed with it): nothing of it applies.
            path.write_text(f'probe_interval = 0\nencode = []\ndecode = ["{b}"]\n')
            proxy.proc.send_signal(signal.SIGHUP)
            await proxy.wait_log(f"WARNING epd_proxy.reload: reload: {path} leaves encode with no instance; "
                                 "keeping the running configuration (to empty a role on purpose, name it in "
                                 "allow_empty_roles)")
            assert await _status_roles(proxy) == {"encode": [e], "prefill": [], "decode": [a]}
            # A section's name mistyped: refused too, naming the key.
            path.write_text(f'probe_interval = 0\n[[encoder]]\nurl = "{e}"\n[[decode]]\nurl = "{b}"\n')
            proxy.proc.send_signal(signal.SIGHUP)
            await proxy.wait_log("unknown key 'encoder' (did you mean 'encode'?); keeping the running configuration")
            metrics = (await proxy.fresh_get("/metrics")).body
            assert b'epd_proxy_reloads_total{result="failed"} 2.0' in metrics
            assert await _status_roles(proxy) == {"encode": [e], "prefill": [], "decode": [a]}
            # The operator's word: the role is emptied.
            path.write_text(f'probe_interval = 0\nallow_empty_roles = ["encode"]\ndecode = ["{b}"]\n')
            proxy.proc.send_signal(signal.SIGHUP)
            await proxy.wait_log(f"reload: {path} empties encode, as its allow_empty_roles says")
            await proxy.wait_log(f"reload: {path} applied (0 encode, 0 prefill, 1 decode)")
            for _ in range(50):
                if await _status_roles(proxy) == {"encode": [], "prefill": [], "decode": [b]}:
                    break
                await asyncio.sleep(0.1)
            assert await _status_roles(proxy) == {"encode": [], "prefill": [], "decode": [b]}
            assert b'epd_proxy_reloads_total{result="ok"} 1.0' in (await proxy.fresh_get("/metrics")).body


def test_allow_empty_roles_names_roles_only(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text('allow_empty_roles = ["encoder"]\ndecode = ["http://d:1"]\n')
    settings = _settings(path)
    try:
        settings.config(settings.started)
    except ValueError as exc:
        assert "--allow-empty-roles 'encoder': not a role (did you mean 'encode'?)" in str(exc)
    else:
        raise AssertionError("accepted")


async def test_a_reload_keeps_the_simulated_instances_of_every_worker(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text('simulate = "decode=2"\nworkers = 2\n[tenants.default]\nrequests_per_minute = 1000\n')
    async with ProxyProcess(["--config", str(path), "--probe-interval", "0"]) as proxy:
        before = await _roster_of_every_worker(proxy, 2, lambda urls: len(urls) == 2)
        proxy.proc.send_signal(signal.SIGHUP)
        await proxy.wait_log(f"reload: {path} applied (0 encode, 0 prefill, 2 decode)", count=2)
        after = await _roster_of_every_worker(proxy, 2, lambda urls: len(urls) == 2)
        assert sorted(map(tuple, after.values())) == sorted(map(tuple, before.values()))
        client = Client(proxy.url)
        try:
            assert (await client.chat(chat_body())).status == 200
        finally:
            await client.close()
