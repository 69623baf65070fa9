"""What the benchmark sends load to: the simulator itself, epd-proxy, and other proxies.

Each target is a URL, plus (for a proxy) the process that serves it, started
pinned to the proxy's cores. Supported workload kinds differ: vllm-router has
no encoder stage, so it is not given the multimodal workload; nginx and
"direct" relay only the decode hop (the floor of any proxy).
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import sys
import tempfile
from dataclasses import dataclass, field

from epd_proxy.bench.procs import Service

ALL_KINDS = frozenset(("stream", "nonstream", "mm", "messages", "responses"))
TEXT_KINDS = frozenset(("stream", "nonstream", "messages", "responses"))


@dataclass
class SimInfo:
    """The simulated cluster as the targets need it."""

    encode: list[str]
    prefill: list[str]
    decode: list[str]
    prefill_identities: list[dict] = field(default_factory=list)
    kv_connector: str = "nixl"
    kv_events: dict = field(default_factory=dict)  # URL -> [events endpoint, replay endpoint]

    @classmethod
    def from_json(cls, data: dict) -> "SimInfo":
        return cls(encode=list(data.get("encode") or []), prefill=list(data.get("prefill") or []),
                   decode=list(data.get("decode") or []),
                   prefill_identities=list(data.get("prefill_identities") or []),
                   kv_connector=data.get("kv_connector") or "nixl",
                   kv_events={u: list(e) for u, e in (data.get("kv_events") or {}).items()})

    def with_events(self, spec: str, url: str) -> str:
        """``spec`` with the instance's KV event sockets as attributes (as the simulator prints them)."""
        ev = self.kv_events.get(url)
        return f"{spec};kv_events={ev[0]};kv_events_replay={ev[1]}" if ev else spec

    def prefill_specs(self) -> list[str]:
        """Prefill instances as ``URL;engine_id=..;kv_host=..;kv_port=..;tp=..;pp=..`` (push mode)."""
        out = []
        for url, ident in zip(self.prefill, self.prefill_identities or [{}] * len(self.prefill)):
            if ident.get("engine_id"):
                out.append(f"{url};engine_id={ident['engine_id']};kv_host={ident.get('kv_host', '127.0.0.1')};"
                           f"kv_port={ident.get('kv_port')};tp={ident.get('tp', 1)};pp={ident.get('pp', 1)}")
            else:
                out.append(url)
        return out


@dataclass
class Target:
    name: str
    url: str
    service: Service | None = None
    kinds: frozenset = ALL_KINDS
    note: str = ""
    available: bool = True
    stages: dict | None = None  # client-side E→P→D: {"encode": url, "prefill": url, "decode": url}

    def make_client(self, concurrency: int):
        from epd_proxy.bench.clients import StagesClient, UrlClient

        n = max(256, 2 * concurrency)
        if self.stages is not None:
            return StagesClient(self.stages.get("encode"), self.stages.get("prefill"), self.stages["decode"],
                                max_idle=n)
        return UrlClient(self.url, max_idle=n)

    def supports(self, kind: str) -> bool:
        return self.available and kind in self.kinds


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def direct_target(sim: SimInfo) -> Target:
    return Target("direct", sim.decode[0], None, ALL_KINDS,
                  note="the simulated decode instance itself, no proxy (it prefills locally)")


def direct_pd_target(sim: SimInfo) -> Target:
    return Target("direct-pd", sim.decode[0], None, ALL_KINDS if sim.encode else TEXT_KINDS,
                  note="no proxy: the load generator itself calls encoder, prefill, then decode (same backend "
                       "work as through a proxy)",
                  stages={"encode": sim.encode[0] if sim.encode else None,
                          "prefill": sim.prefill[0] if sim.prefill else None, "decode": sim.decode[0]})


def epd_proxy_target(sim: SimInfo, *, cpus=None, log_dir: str, workers: int = 1, kv_connector: str = "nixl",
                     name: str = "epd-proxy", extra: list[str] | None = None, port: int | None = None,
                     kv_events: bool = False) -> Target:
    """epd-proxy in front of ``sim``; with ``kv_events``, subscribed to the instances' KV events
    (their sockets as instance attributes)."""
    port = port or free_port()
    prefill = sim.prefill_specs() if kv_connector != "nixl" else list(sim.prefill)
    decode = ",".join(sim.decode)
    if kv_events:
        prefill = [sim.with_events(spec, url) for spec, url in zip(prefill, sim.prefill)]
        decode = ",".join(sim.with_events(u, u) for u in sim.decode)
    argv = [sys.executable, "-m", "epd_proxy", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--decode", decode, "--kv-connector", kv_connector, "--log-level", "warning",
            "--shutdown-grace", "0"]  # no load balancer to warn: stop without the grace period
    if sim.encode:
        argv += ["--encode", ",".join(sim.encode)]
    for spec in prefill:  # one flag each: specs contain no commas, but keep them apart anyway
        argv += ["--prefill", spec]
    if workers > 1:
        argv += ["--workers", str(workers)]
    argv += list(extra or [])
    url = f"http://127.0.0.1:{port}"
    svc = Service(name, argv, cpus=cpus, log_path=os.path.join(log_dir, f"{name}.log"), url=url)
    kinds = ALL_KINDS if sim.encode else TEXT_KINDS
    return Target(name, url, svc, kinds, note=f"python -m epd_proxy serve ({kv_connector}"
                  + (f", {workers} workers" if workers > 1 else "") + ")")


def find_vllm_router() -> str | None:
    path = shutil.which("vllm-router")
    if path:
        return path
    cand = os.path.join(os.path.dirname(sys.executable), "vllm-router")
    return cand if os.access(cand, os.X_OK) else None


def vllm_router_target(sim: SimInfo, *, cpus=None, log_dir: str, policy: str = "round_robin",
                       name: str = "vllm-router") -> Target:
    exe = find_vllm_router()
    if exe is None or not sim.prefill:
        why = "not installed (pip install vllm-router)" if exe is None else "needs a prefill instance"
        return Target(name, "", None, TEXT_KINDS, note=why, available=False)
    port = free_port()
    argv = [exe, "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation", "--kv-connector", "nixl"]
    for p in sim.prefill:
        argv += ["--prefill", p]
    for d in sim.decode:
        argv += ["--decode", d]
    argv += ["--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
             "--worker-startup-check-interval", "1", "--log-level", "warning",
             "--max-concurrent-requests", "65536"]
    url = f"http://127.0.0.1:{port}"
    svc = Service(name, argv, cpus=cpus, log_path=os.path.join(log_dir, f"{name}.log"), url=url)
    return Target(name, url, svc, TEXT_KINDS,
                  note=f"vllm-router --vllm-pd-disaggregation (nixl) --policy {policy}; no encoder stage")


def find_nginx() -> str | None:
    for cand in ("/usr/sbin/nginx", shutil.which("nginx")):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def nginx_conf(port: int, decode: list[str], prefix: str, *, as_root: bool, nofile: int = 20000) -> str:
    servers = "\n".join(f"    server {u.split('://', 1)[1]};" for u in decode)
    user = "user root;\n" if as_root else ""
    return f"""{user}worker_processes 1;
worker_rlimit_nofile {nofile};
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections {max(1024, nofile - 100)}; }}
http {{
  access_log off;
  client_body_temp_path {prefix}/body;
  proxy_temp_path {prefix}/proxy;
  fastcgi_temp_path {prefix}/fastcgi;
  uwsgi_temp_path {prefix}/uwsgi;
  scgi_temp_path {prefix}/scgi;
  client_max_body_size 64m;
  client_body_buffer_size 16m;
  keepalive_requests 1000000;
  upstream decode {{
{servers}
    keepalive 1024;
  }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    location / {{
      proxy_pass http://decode;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_read_timeout 600s;
    }}
  }}
}}
"""


def nginx_target(sim: SimInfo, *, cpus=None, log_dir: str) -> Target:
    exe = find_nginx()
    if exe is None:
        return Target("nginx", "", None, ALL_KINDS, note="not installed (/usr/sbin/nginx absent)", available=False)
    port = free_port()
    prefix = tempfile.mkdtemp(prefix="epd-bench-nginx-", dir=log_dir)
    conf = os.path.join(prefix, "nginx.conf")
    with open(conf, "w") as f:
        from epd_proxy.bench.procs import nofile_limits

        f.write(nginx_conf(port, sim.decode, prefix, as_root=os.geteuid() == 0, nofile=min(nofile_limits()[1], 65536)))
    argv = [exe, "-p", prefix, "-c", conf, "-g", "daemon off;"]
    url = f"http://127.0.0.1:{port}"
    svc = Service("nginx", argv, cpus=cpus, log_path=os.path.join(log_dir, "nginx.log"), url=url)
    return Target("nginx", url, svc, ALL_KINDS,
                  note="nginx, 1 worker, relaying only the decode hop (proxy_buffering off): a byte-relay floor")


def other_target(spec: str, sim: SimInfo, *, cpus=None, log_dir: str) -> Target:
    """``NAME=COMMAND`` with ``{port}``, ``{host}``, ``{encode}``, ``{prefill}``, ``{decode}``
    (comma-separated URLs) and ``{encode_args}``-style lists left to the command."""
    name, sep, command = spec.partition("=")
    if not sep or not name.strip() or not command.strip():
        raise ValueError(f"--other expects NAME=COMMAND, got {spec!r}")
    port = free_port()
    values = {"port": port, "host": "127.0.0.1", "encode": ",".join(sim.encode),
              "prefill": ",".join(sim.prefill), "decode": ",".join(sim.decode),
              "decode0": sim.decode[0] if sim.decode else "", "prefill0": sim.prefill[0] if sim.prefill else "",
              "python": sys.executable}
    argv = [a.format(**values) for a in shlex.split(command)]
    url = f"http://127.0.0.1:{port}"
    name = name.strip()
    svc = Service(name, argv, cpus=cpus, log_path=os.path.join(log_dir, f"{name}.log"), url=url)
    return Target(name, url, svc, TEXT_KINDS if not sim.encode else ALL_KINDS, note=command)
