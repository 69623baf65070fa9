"""``--simulate`` with ``--workers N``: the simulated cluster in a process of its own.

Alone, the proxy runs the simulated instances in its own event loop (serve.py). With workers,
each worker would otherwise start a cluster of its own on other ports, and the parent, which
only supervises, runs no event loop. So the parent forks one simulator process before it forks
any worker (it is single-threaded then), reads the cluster's addresses from a pipe, and every
worker is configured with them, as a proxy in front of a real cluster would be. The simulator
ignores SIGINT, SIGTERM and SIGHUP (a Ctrl-C, a service manager's stop or a reload reach the
whole process group, and the workers' requests in flight must still be answered while they
drain): it stops when its lifeline closes, a pipe whose write end the parent holds (and the
workers, forked with it), so once every one of them has exited, however they ended.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import signal
import time

import msgspec

from epd_proxy.config import InstanceSpec, ProxyConfig
from epd_proxy.http import event_loop

log = logging.getLogger("epd_proxy.simulated")

START_TIMEOUT = 30.0  # seconds the parent waits for the simulator's addresses
STOP_TIMEOUT = 10.0  # seconds the parent waits for the simulator to stop, before SIGKILL


def addresses_of(cluster) -> dict:
    """What a proxy needs of a simulated cluster (``SimCluster``), as plain data: each role's
    URLs (PD instances with the decodes), each prefill's identity, each decode's KV event
    sockets, the KV connector."""
    # With kv_events on, every prefill and decode names its KV event sockets.
    decode = [{"url": i.url, "kv_events": i.kv_events and i.kv_events.endpoint,
               "kv_events_replay": i.kv_events and i.kv_events.replay_endpoint}
              for i in cluster.instances("decode") + cluster.instances("pd")]
    return {"encode": cluster.urls("encode"), "prefill": cluster.prefill_identities(),
            "decode": decode, "kv_connector": cluster.config.kv_connector}


def config_for_addresses(addresses: dict, config: ProxyConfig | None = None) -> ProxyConfig:
    """``config`` with the cluster's instances (``addresses_of``) and its KV connector."""
    encode = [InstanceSpec(u, "encode") for u in addresses["encode"]]
    prefill = [InstanceSpec(i["url"], "prefill", engine_id=i["engine_id"], kv_host=i["kv_host"],
                            kv_port=i["kv_port"], tp=i["tp"], pp=i["pp"], bootstrap_port=i.get("bootstrap_port"),
                            kv_events=i.get("kv_events"), kv_events_replay=i.get("kv_events_replay"))
               for i in addresses["prefill"]]
    decode = [InstanceSpec(d["url"], "decode", kv_events=d.get("kv_events"), kv_events_replay=d.get("kv_events_replay"))
              for d in addresses["decode"]]
    base = config or ProxyConfig()
    return base.replace(encode=encode, prefill=prefill, decode=decode, kv_connector=addresses["kv_connector"])


class SimulatorProcess:
    """The simulated cluster of ``spec`` in a child process (``start``), stopped by ``stop``."""

    def __init__(self, pid: int, addresses: dict, lifeline: int) -> None:
        self.pid = pid
        self.addresses = addresses
        self._lifeline = lifeline  # the write end: closed by every holder, the simulator stops

    @classmethod
    def start(cls, spec: str) -> SimulatorProcess:
        """Fork the simulator and wait for its addresses; ValueError when it cannot start."""
        read_end, write_end = os.pipe()
        life_r, life_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the simulator
            os.close(read_end)
            os.close(life_w)
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
            code = 1
            try:
                event_loop.run(_simulate(spec, write_end, life_r))
                code = 0
            except BaseException:
                log.exception("the simulated cluster failed")
            finally:
                os._exit(code)
        os.close(write_end)
        os.close(life_r)
        try:
            data = _read_all(read_end, START_TIMEOUT)
        finally:
            os.close(read_end)
        try:
            answer = msgspec.json.decode(data) if data else {"error": "it exited before it said its addresses"}
        except msgspec.DecodeError:
            answer = {"error": f"it answered {data[:200]!r}"}
        simulator = cls(pid, answer, life_w)
        if "error" in answer:
            simulator.stop()
            raise ValueError(f"--simulate {spec!r}: the simulated cluster did not start: {answer['error']}")
        return simulator

    def stop(self) -> None:
        """Close the lifeline and wait for the simulator (SIGKILL past ``STOP_TIMEOUT``); it is
        reaped here unless the supervisor's loop, which reaps every child, already did."""
        if self._lifeline >= 0:
            os.close(self._lifeline)
            self._lifeline = -1
        end = time.monotonic() + STOP_TIMEOUT
        try:
            while os.waitpid(self.pid, os.WNOHANG) == (0, 0):
                if time.monotonic() > end:
                    log.warning("the simulated cluster (pid %d) did not stop: killed", self.pid)
                    os.kill(self.pid, signal.SIGKILL)
                    os.waitpid(self.pid, 0)
                    return
                time.sleep(0.02)
        except ChildProcessError:
            pass


def _read_all(fd: int, timeout: float) -> bytes:
    out = bytearray()
    end = time.monotonic() + timeout
    while True:
        left = end - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return bytes(out)
        chunk = os.read(fd, 65536)
        if not chunk:
            return bytes(out)
        out += chunk


async def _simulate(spec: str, write_end: int, lifeline: int) -> None:
    from epd_proxy.sim import SimCluster

    try:
        cluster = SimCluster.from_spec(spec)
        await cluster.start()
    except Exception as exc:  # a bad spec, a port in use: said to the parent
        os.write(write_end, msgspec.json.encode({"error": str(exc) or type(exc).__name__}))
        os.close(write_end)
        return
    try:
        os.write(write_end, msgspec.json.encode(addresses_of(cluster)))
        os.close(write_end)
        closed = asyncio.Event()
        asyncio.get_running_loop().add_reader(lifeline, closed.set)  # readable only at EOF: nobody writes
        await closed.wait()
    finally:
        await cluster.stop()
