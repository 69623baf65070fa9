"""``epd-proxy serve``: its flags, and the settings they and the cluster file make.

Every default is read from the config dataclasses (``ProxyConfig``, its
``StageTimeouts``, ``ServeOptions``), never written here, so the flag, its
``--help`` line and the cluster file agree with the code that uses the value. A
few defaults come from an environment variable first, as vLLM's own do; each flag
says which.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from typing import Callable

from epd_proxy.cli.cluster_file import ClusterFileError, Option, read_cluster_path
from epd_proxy.cli.parser import Parser
from epd_proxy.config import (
    ALWAYS_FORWARDED,
    ENCODER_FALLBACKS,
    LOG_FORMATS,
    LOG_LEVELS,
    NO_DECODE,
    ROLE_POLICY_DEFAULTS,
    ROLES,
    SECTIONS,
    ConfigErrors,
    ProxyConfig,
    ServeOptions,
    StageTimeouts,
    split_discovered,
    split_instances,
)
from epd_proxy.instances.load_signals import QUIET_STRETCH
from epd_proxy.routing import POLICIES

# Upstream credentials come only from explicit configuration: never from OPENAI_API_KEY,
# which may hold a key for another service entirely.
UPSTREAM_API_KEY_ENV = "EPD_PROXY_UPSTREAM_API_KEY"
ADMIN_API_KEY_ENV = "ADMIN_API_KEY"
ENCODER_MAX_BATCH_SIZE_ENV = "ENCODER_MAX_BATCH_SIZE"  # as the reference proxy reads it
KEEP_ALIVE_ENV = "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"  # the backends' setting, when the proxy runs beside them


def _env(name: str, default, kind=str):
    """A default that the environment variable ``name`` overrides when set."""
    value = os.environ.get(name)
    return default if value is None else kind(value)


_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int:
    """A byte count: ``1048576``, ``64M``, ``512k``, ``1G`` (binary units)."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = _UNITS.get(t[-1:], 1)
    try:
        n = int(t[:-1] if scale > 1 else t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1048576, 64M, 1G)") from None
    return n * scale


def size_text(n: int) -> str:
    """``parse_size``'s inverse for the help text: 67108864 -> ``64M``."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


# ``serve --help`` in groups: the instances, the process, then one group per section of
# ``ProxyConfig`` (the key: cli tests check that every flag of a group lands in that section).
GROUPS: dict[str, tuple[str, str]] = {
    "instances": ("instances", "URLs, optionally with ;key=value attributes (engine_id, kv_host, kv_port, tp, "
                               "pp, bootstrap_port, dp_size, models, kv_events, kv_events_replay), e.g. "
                               "'http://p1:8100;engine_id=prefill-0;kv_host=10.0.0.1;kv_port=5600'; "
                               "'dns+http://NAME:PORT' for every address NAME resolves to"),
    "process": ("process", "where this process listens, its workers and logs, the cluster file"),
    "upstream": ("upstream", "how the proxy calls the instances: the KV connector, retries, credentials, headers, "
                             "connections and every wait's bound"),
    "policies": ("routing", "which instance of each role a request goes to"),
    "kv_events": ("KV events", "vLLM's KV cache events and the block index routing follows"),
    "multi_turn": ("multi-turn KV reuse", "a conversation's next turn reads the KV its decode kept"),
    "encoders": ("encoders", "the encode stage: batching, bounds, the fallback, the rewrite to *_embeds"),
    "media": ("media", "what media a client's body may name"),
    "lora": ("LoRA adapters", "placing and loading adapters"),
    "health": ("health", "probes, outlier detection and ejection"),
    "membership": ("membership and discovery", "instances registering at run time, a pinned topology, DNS names"),
    "admission": ("admission", "requests worked on at once, and the queue"),
    "listener": ("front door", "what clients may send, how slowly, how many at once; the graceful shutdown"),
    "access": ("access and TLS", "client keys, the operator's key, HTTPS"),
    "observability": ("observability", "access log, log format, metrics' labels"),
    "store": ("state store", "what replicas and workers share"),
}


def _group(parser: argparse.ArgumentParser, key: str) -> argparse._ArgumentGroup:
    title, description = GROUPS[key]
    return parser.add_argument_group(title, description)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults, process = ProxyConfig(), ServeOptions()
    timeouts = defaults.timeouts
    names = list(POLICIES)
    parser.description = "Run the proxy in front of vLLM encode / prefill / decode instances."
    g = _group(parser, "instances")
    g.add_argument("--encode", "--encode-servers-urls", dest="encode", action="append", metavar="URL",
                   help="encoder instance(s); repeatable and comma-separated; omit for P/D only")
    g.add_argument("--prefill", "--prefill-servers-urls", dest="prefill", action="append", metavar="URL",
                   help="prefill instance(s); omit (or 'none'/'disable') for E+PD")
    g.add_argument("--decode", "--decode-servers-urls", dest="decode", action="append", metavar="URL",
                   help="decode (or PD) instance(s)")
    g = _group(parser, "process")
    g.add_argument("--host", default=process.host, help="address to listen on (default %(default)s)")
    g.add_argument("--port", type=int, default=process.port, help="port to listen on (default %(default)s)")
    g.add_argument("--workers", type=int, default=process.workers,
                   help="processes sharing the port (SO_REUSEPORT; default %(default)s)")
    g.add_argument("--log-level", default=process.log_level, choices=LOG_LEVELS,
                   help="(default %(default)s)")
    g.add_argument("--config", metavar="FILE", default=None,
                   help="cluster file (TOML) holding any of these flags as keys and the instances with "
                        "their attributes; flags given here override it; re-read on SIGHUP and when it "
                        "changes (see 'epd-proxy check-config')")
    g.add_argument("--simulate", metavar="SPEC", default=None,
                   help="start simulated vLLM instances in-process (with --workers, in one process of "
                        "their own that every worker uses), e.g. 'encode=2,prefill=1,decode=2'")
    g = _group(parser, "upstream")
    g.add_argument("--kv-connector", default=defaults.kv_connector,
                   help="nixl (pull), nixl-push or mooncake (default %(default)s)")
    g.add_argument("--decode-retries", type=int, default=defaults.decode_retries,
                   help="fresh attempts after a retryable failure before the response starts (default %(default)s)")
    g.add_argument("--no-hedging", action="store_false", dest="hedging", default=defaults.hedging,
                   help="never give a slow prefill or encoder call a second attempt (hedging is on by default: "
                        "one that has not answered within the p95 of its recent answers is tried on another "
                        "instance too, the first answer wins)")
    g.add_argument("--hedge-budget", type=float, default=defaults.hedge_budget, metavar="PERCENT",
                   help="at most this share of a role's calls gets a hedge, over the last 10-20 s "
                        "(default %(default)g)")
    g.add_argument("--hedge-min-delay", type=float, default=defaults.hedge_min_delay, metavar="SECONDS",
                   help="a call is never hedged sooner (default %(default)g)")
    g.add_argument("--hedge-max-delay", type=float, default=defaults.hedge_max_delay, metavar="SECONDS",
                   help="... and always by then; also the delay until 20 answers were seen (default %(default)g)")
    g.add_argument("--hedge-max-per-instance", type=int, default=defaults.hedge_max_per_instance, metavar="N",
                   help="hedges in flight to one instance at most (0 = no bound; default %(default)s)")
    g.add_argument("--no-stream-migration", action="store_false", dest="stream_migration",
                   default=defaults.stream_migration,
                   help="end a committed stream whose decode breaks off with an in-band error, as before (by "
                        "default a chat or completions stream is continued on another decode)")
    g.add_argument("--migration-limit", type=int, default=defaults.migration_limit, metavar="N",
                   help="moves of one stream to another decode at most (default %(default)s)")
    g.add_argument("--upstream-api-key", default=_env(UPSTREAM_API_KEY_ENV, defaults.upstream_api_key),
                   help=f"sent to backends as 'Authorization: Bearer' (default: ${UPSTREAM_API_KEY_ENV}; "
                        "for the reference proxies' behaviour pass --upstream-api-key \"$OPENAI_API_KEY\")")
    g.add_argument("--forward-header", action="append", default=[], metavar="NAME",
                   help=f"client header to pass on to every stage ({'/'.join(ALWAYS_FORWARDED)} always are); "
                        "hop-by-hop, framing and proxy-set headers are refused")
    g.add_argument("--upstream-keep-alive", type=float,
                   default=_env(KEEP_ALIVE_ENV, defaults.upstream_keep_alive, float),
                   help=f"the backends' keep-alive timeout ({KEEP_ALIVE_ENV}); idle pooled connections are "
                        f"retired at half of it (default ${KEEP_ALIVE_ENV}, else {defaults.upstream_keep_alive:g} s)")
    g.add_argument("--max-upstream-connections", type=int, default=defaults.max_upstream_connections,
                   help="concurrent connections to one instance; further requests wait in line "
                        "(default %(default)s)")
    g.add_argument("--connect-timeout", type=float, default=timeouts.connect,
                   help=f"to open a connection to an instance (default {timeouts.connect:g} s)")
    g.add_argument("--encode-timeout", type=float, default=timeouts.encode,
                   help=f"an encoder sub-request of one image: vLLM's image fetch (VLLM_IMAGE_FETCH_TIMEOUT 5 s), "
                        f"its encoding (well under a second on a GPU) and a queue; a batch adds a tenth per further "
                        f"image, audio takes 2x and video 4x (vLLM's fetch limits 10 s and 30 s). An item two "
                        f"encoders time out on fails the request at once (default {timeouts.encode:g} s)")
    g.add_argument("--prefill-timeout", type=float, default=timeouts.prefill,
                   help=f"(default {timeouts.prefill:g} s)")
    g.add_argument("--decode-timeout", type=float, default=timeouts.decode_first,
                   help=f"until decode's first event (default {timeouts.decode_first:g} s)")
    g.add_argument("--stream-idle-timeout", type=float, default=timeouts.stream_idle,
                   help=f"longest silence inside decode's stream (default {timeouts.stream_idle:g} s)")
    g.add_argument("--first-byte-timeout", type=float, default=timeouts.first_byte,
                   help=f"from a request's admission to its response's status: past it the client gets 504 "
                        f"and every upstream leg is closed (default {timeouts.first_byte:g} s, 0 = off)")
    g = _group(parser, "policies")
    g.add_argument("--routing", choices=names, default=defaults.routing,
                   help="routing policy of every role without its own flag (default: each role's own, "
                        + ", ".join(f"{role} {name}" for role, name in ROLE_POLICY_DEFAULTS.items()) + ")")
    for role in ("prefill", "decode", "encode"):
        g.add_argument(f"--{role}-policy", choices=names, default=getattr(defaults, f"{role}_policy"),
                       help=f"routing policy of the {role} instances (default: --routing, else "
                            f"{ROLE_POLICY_DEFAULTS[role]}" + ("; cache-aware for PD, i.e. without --prefill)"
                                                               if role == "decode" else ")"))
    g.add_argument("--balance-abs", type=float, default=defaults.balance_abs,
                   help="cache-aware passes over its preferred instance when that one has more than this "
                        f"many requests beyond the least-loaded one (default {defaults.balance_abs:g}) ...")
    g.add_argument("--balance-rel", type=float, default=defaults.balance_rel,
                   help=f"... and more than this many times its load (default {defaults.balance_rel:g})")
    g.add_argument("--scrape-interval", type=float, default=defaults.scrape_interval,
                   help="seconds between background scrapes of each instance's /metrics for load signals "
                        f"(vllm:num_requests_running/_waiting, kv_cache_usage_perc; 0 = off; up to "
                        f"{QUIET_STRETCH}x longer while they show only this proxy's load; default "
                        f"{defaults.scrape_interval:g})")
    g = _group(parser, "kv_events")
    g.add_argument("--kv-events-port", type=int, default=defaults.kv_events_port, metavar="PORT",
                   help="subscribe to vLLM's KV cache events (--kv-events-config, publisher zmq) of every "
                        "prefill and decode instance on tcp://HOST:PORT, its replay socket on PORT+1, unless "
                        "the instance names its own (;kv_events=tcp://host:port); routing then follows the "
                        "blocks instances hold (default: only instances that name theirs)")
    g.add_argument("--kv-index-max-blocks", type=int, default=defaults.kv_index_max_blocks, metavar="N",
                   help="bound of the KV block index, in (instance, block) pairs, about 243 bytes each "
                        f"(default {defaults.kv_index_max_blocks})")
    g = _group(parser, "multi_turn")
    g.add_argument("--no-kv-reuse", action="store_false", dest="kv_reuse", default=defaults.kv_reuse,
                   help="never give decode's kv_transfer_params to the next turn's prefill (multi-turn KV "
                        "reuse is on by default when decode answers with them: vLLM's bidirectional_kv_xfer)")
    g.add_argument("--kv-reuse-ttl", type=float, default=defaults.kv_reuse_ttl, metavar="SECONDS",
                   help="decode's decoder_kv_blocks_ttl: how long it keeps a finished request's blocks "
                        "(default %(default)g)")
    g.add_argument("--kv-reuse-margin", type=float, default=defaults.kv_reuse_margin, metavar="SECONDS",
                   help="kept parameters are used only until the TTL less this after their receipt "
                        "(default %(default)g; vLLM's prefill refuses a read within 5 s of the expiry)")
    g.add_argument("--kv-reuse-max-held-tokens", type=int, default=defaults.kv_reuse_max_held_tokens,
                   metavar="N", help="per decode, the tokens kept parameters may hold; past it the oldest "
                                     "are let go (0 = no bound; default %(default)s)")
    g.add_argument("--local-prefill-max-tokens", type=int, default=defaults.local_prefill_max_tokens,
                   metavar="N", help="a turn whose prefill would compute at most N tokens goes to the decode "
                                     "holding the rest of its prompt, alone (0 = never; default %(default)s)")
    g.add_argument("--local-prefill-max-streams", type=int, default=defaults.local_prefill_max_streams,
                   metavar="N", help="... when that decode runs at most N other requests: a local prefill "
                                     "lengthens every stream's steps on it (default %(default)s)")
    g = _group(parser, "encoders")
    g.add_argument("--encoder-max-batch-size", type=int,
                   default=_env(ENCODER_MAX_BATCH_SIZE_ENV, defaults.encoder_max_batch_size, int),
                   help=f"images per encoder sub-request (0 = unlimited; default ${ENCODER_MAX_BATCH_SIZE_ENV}, "
                        f"else {defaults.encoder_max_batch_size})")
    g.add_argument("--encoder-max-outstanding", type=int, default=defaults.encoder_max_outstanding,
                   help="media items in flight to one encoder (per process); more wait in the proxy until "
                        "the encode timeout, then 429 (0 = no bound; default %(default)s)")
    g.add_argument("--encoder-fallback", choices=ENCODER_FALLBACKS, default=defaults.encoder_fallback,
                   help="an item no encoder can take (all failed it, or all saturated past the encode "
                        "timeout): 'none' fails the request, 'local' sends the raw media to the consumer, "
                        "which encodes it itself (default %(default)s)")
    g.add_argument("--no-rewrite", action="store_true", default=not defaults.rewrite,
                   help="send raw media to the consumer (no *_embeds rewrite, no uuids to encoders)")
    g.add_argument("--ec-consumer-zmq-addrs", default=",".join(defaults.ec_consumer_zmq_addrs),
                   help="comma-separated EC consumer ZMQ addresses, aligned with --decode (E+PD only)")
    g.add_argument("--ec-consumer-dp-size", type=int, default=defaults.ec_consumer_dp_size,
                   help="data-parallel replicas per EC consumer (default %(default)s)")
    g = _group(parser, "media")
    g.add_argument("--ignore-client-uuids", action="store_true", default=defaults.ignore_client_uuids,
                   help="key media by their content even when the client sends a uuid (multi-tenant)")
    g.add_argument("--max-media-items", type=int, default=defaults.max_media_items,
                   help="media parts per request, all modalities (default %(default)s; 0 = no media accepted)")
    g.add_argument("--allowed-media-schemes", default=",".join(defaults.allowed_media_schemes),
                   help="comma-separated URL schemes media may use (default %(default)s)")
    g.add_argument("--allowed-media-hosts", action="append", default=list(defaults.allowed_media_hosts),
                   metavar="HOST|CIDR",
                   help="hosts or networks media URLs may name although they are loopback, private, "
                        "link-local, unspecified or multicast addresses; repeatable, comma-separated")
    g = _group(parser, "lora")
    g.add_argument("--no-lora-affinity", action="store_false", dest="lora_affinity", default=defaults.lora_affinity,
                   help="place a LoRA adapter's requests by the routing policy, like any other request, "
                        "instead of concentrating them on few of the instances that have it")
    g.add_argument("--lora-source", action="append", default=[], metavar="NAME=PATH",
                   help="an adapter the proxy loads (POST /v1/load_lora_adapter) on the instances it picks "
                        "when a request names it and no instance has it; PATH as the instances see it "
                        "(repeatable, comma-separated)")
    g.add_argument("--lora-dir", default=defaults.lora_dir, metavar="DIR",
                   help="a directory of adapters by name (DIR/NAME/adapter_config.json, as vLLM's "
                        "VLLM_LORA_RESOLVER_CACHE_DIR), loaded on demand like --lora-source; the instances "
                        "must see DIR at the same path")
    g.add_argument("--lora-load-timeout", type=float, default=defaults.lora_load_timeout,
                   help=f"longest wait for an adapter load on an instance (default {defaults.lora_load_timeout:g} s)")
    g.add_argument("--max-lora-loads", type=int, default=defaults.max_lora_loads,
                   help=f"adapters loaded on demand at once (default {defaults.max_lora_loads})")
    g = _group(parser, "health")
    g.add_argument("--probe-interval", type=float, default=defaults.probe_interval,
                   help=f"health probe period (0 = off; default {defaults.probe_interval:g} s)")
    g.add_argument("--probe-timeout", type=float, default=defaults.probe_timeout,
                   help=f"(default {defaults.probe_timeout:g} s)")
    g.add_argument("--fail-threshold", type=int, default=defaults.fail_threshold,
                   help="consecutive probe or transport failures that eject an instance (default %(default)s)")
    g.add_argument("--outlier-failure-percent", type=float, default=defaults.outlier_failure_percent,
                   help="share of requests failing with HTTP 500 that ejects an instance "
                        f"(default {defaults.outlier_failure_percent:g})")
    g.add_argument("--outlier-min-requests", type=int, default=defaults.outlier_min_requests,
                   help="requests an instance must have had before that share counts (default %(default)s)")
    g.add_argument("--outlier-interval", type=float, default=defaults.outlier_interval,
                   help=f"seconds over which the share is measured (default {defaults.outlier_interval:g})")
    g.add_argument("--ejection-time", type=float, default=defaults.ejection_time,
                   help="base ejection time, multiplied by the number of ejections in a row "
                        f"(default {defaults.ejection_time:g} s)")
    g.add_argument("--max-ejection-time", type=float, default=defaults.max_ejection_time,
                   help=f"longest ejection (default {defaults.max_ejection_time:g} s)")
    g.add_argument("--max-ejection-percent", type=int, default=defaults.max_ejection_percent,
                   help="most of a role that request failures may eject, rounded down (default "
                        "%(default)s); failed probes are not capped")
    g = _group(parser, "membership")
    g.add_argument("--dynamic-registration", action="store_true", default=defaults.dynamic_registration,
                   help="instances may register at run time (POST /instances); the proxy may start with "
                        "none. Needs --admin-api-key or --registration-allow")
    g.add_argument("--registration-allow", action="append", default=list(defaults.registration_allow),
                   metavar="CIDR",
                   help="network allowed to register without a key (vLLM's registrar sends none); repeatable")
    g.add_argument("--evicted-ttl", type=float, default=defaults.evicted_ttl,
                   help="forget a registered instance out of rotation this long, in s "
                        f"(default {defaults.evicted_ttl:g}; 0 = never)")
    g.add_argument("--topology", default=defaults.topology, choices=["auto", "PD", "E+PD", "P+D", "P/D", "E+P+D"],
                   help="pin the topology (default: inferred from the instances present)")
    g.add_argument("--allow-empty-roles", action="append", default=list(defaults.allow_empty_roles),
                   metavar="ROLE,...",
                   help="roles (encode, prefill, decode) a reload may leave with no instance; a reload that "
                        "would empty any other role running instances is refused and the running roster kept "
                        "(repeatable, comma-separated; default none; usually a cluster-file key)")
    g.add_argument("--dns-interval", type=float, default=defaults.dns_interval,
                   help="longest wait between re-resolutions of 'dns+http://NAME:PORT' instances; a "
                        f"shorter record TTL (at least 1 s) is honoured (default {defaults.dns_interval:g} s)")
    g.add_argument("--dns-server", metavar="HOST:PORT", default=defaults.dns_server,
                   help="DNS server for 'dns+http://' instances (default: the system's resolver)")
    g = _group(parser, "admission")
    g.add_argument("--max-inflight", type=int, default=defaults.max_inflight,
                   help=f"client requests this process works on at once (default {defaults.max_inflight}: "
                        f"unlimited); more wait in the queue or get 429")
    g.add_argument("--queue-size", type=int, default=defaults.queue_size,
                   help=f"requests waiting for a slot beyond --max-inflight (default {defaults.queue_size})")
    g.add_argument("--queue-timeout", type=float, default=defaults.queue_timeout,
                   help=f"longest wait in that queue before 429 (default {defaults.queue_timeout:g} s)")
    g.add_argument("--max-inflight-per-role", action="append", default=[], metavar="ROLE=N",
                   help="requests in the encode or prefill stage at once (repeatable, comma-separated; default "
                        "none); more wait in the same kind of queue (--queue-size, --queue-timeout) or get 429")
    g = _group(parser, "listener")
    g.add_argument("--max-body-size", type=parse_size, default=defaults.max_body_size, metavar="BYTES",
                   help="largest request body; larger ones get 413 (K/M/G suffixes; default "
                        f"{size_text(defaults.max_body_size)})")
    g.add_argument("--max-buffered-bytes", type=parse_size, default=defaults.max_buffered_bytes, metavar="BYTES",
                   help="request bodies held at once across all connections; beyond it 503 with "
                        f"Retry-After (0 = no limit; default {size_text(defaults.max_buffered_bytes)})")
    g.add_argument("--max-connections", type=int, default=defaults.max_connections,
                   help="client connections per process; beyond it idle keep-alive connections are "
                        "closed, then new ones refused with 503 (default %(default)s: a third of the descriptor "
                        "limit, the rest kept for upstream connections)")
    g.add_argument("--header-timeout", type=float, default=defaults.header_timeout,
                   help="seconds from a request's first byte to the end of its headers "
                        f"(408; default {defaults.header_timeout:g})")
    g.add_argument("--body-timeout", type=float, default=defaults.body_timeout,
                   help="seconds from the end of the headers to the end of the body "
                        f"(408; default {defaults.body_timeout:g})")
    g.add_argument("--shutdown-grace", type=float, default=defaults.shutdown_grace,
                   help=f"after SIGTERM, /ready is 503 and new connections are still accepted for this "
                        f"long (default {defaults.shutdown_grace:g} s)")
    g.add_argument("--shutdown-timeout", type=float, default=defaults.shutdown_timeout,
                   help=f"after SIGTERM, in-flight requests may finish until this long after the signal; "
                        f"then the rest are ended (default {defaults.shutdown_timeout:g} s)")
    g = _group(parser, "access")
    g.add_argument("--api-key", action="append", default=list(defaults.api_keys), metavar="KEY",
                   help="a key clients must send as 'Authorization: Bearer KEY' on every path (repeatable; "
                        "default none: the API is open); /health, /ready and the console's page stay open, "
                        "/instances, /status and /metrics then need --admin-api-key")
    g.add_argument("--api-key-file", default=defaults.api_key_file, metavar="PATH",
                   help="more client keys, one per line as name:key ('#' comments; the name is what logs, "
                        "metrics and [[tenants.keys]] know it by; a key alone is named line<N>, refused with a "
                        "[tenants] table), read again on SIGHUP")
    g.add_argument("--cache-salt-per-key", action="store_true", default=defaults.cache_salt_per_key,
                   help="with client keys, set vLLM's cache_salt from each key on chat and completions: no "
                        "key shares or can time another key's prefix cache (off: keys share it)")
    g.add_argument("--admin-api-key", default=_env(ADMIN_API_KEY_ENV, defaults.admin_api_key),
                   help="the operator's key, as X-API-Key or 'Authorization: Bearer', for roster changes, "
                        "GET /instances, /status, /metrics and profiling "
                        f"(default: ${ADMIN_API_KEY_ENV}; unset = roster changes off)")
    g.add_argument("--protect-metrics", action="store_true", default=defaults.protect_metrics,
                   help="insist on an admin key: /metrics needs it (as X-API-Key or Bearer) whenever "
                        "--admin-api-key is set anyway")
    g.add_argument("--ssl-certfile", default=defaults.ssl_certfile, metavar="PATH",
                   help="serve HTTPS with this certificate chain (PEM), as vllm serve's flag")
    g.add_argument("--ssl-keyfile", default=defaults.ssl_keyfile, metavar="PATH",
                   help="the certificate's private key (PEM; default: in --ssl-certfile)")
    g = _group(parser, "observability")
    g.add_argument("--log-requests", action="store_true", default=defaults.log_requests,
                   help="log every request's method, path, status and time (and set --log-level debug)")
    g.add_argument("--no-access-log", action="store_false", dest="access_log", default=defaults.access_log,
                   help="no access-log line per request (on by default, at INFO)")
    g.add_argument("--log-format", choices=LOG_FORMATS, default=defaults.log_format,
                   help="log lines as readable text or one JSON object each (default %(default)s)")
    g.add_argument("--trusted-proxies", action="append", default=list(defaults.trusted_proxies),
                   metavar="CIDR,...",
                   help="networks of proxies in front of this one: from a peer in them the access log's "
                        "client is the X-Forwarded-For chain's, read right to left past trusted addresses "
                        "(repeatable, comma-separated; default none: the peer)")
    g.add_argument("--metrics-max-models", type=int, default=defaults.metrics_max_models, metavar="N",
                   help="models (LoRA adapters included) with their own label in the per-model request, "
                        "latency and token metrics, per process; later ones share model=\"other\" "
                        "(default %(default)s)")
    g = _group(parser, "store")
    g.add_argument("--state-store", default=defaults.state_store, metavar="URL",
                   help="the state store every replica and worker shares (conversations' kept KV parameters, "
                        "Responses owners): redis://HOST:PORT/DB or rediss:// (TLS), Redis or Valkey "
                        "(default: this process's memory; with --workers, the parent's)")
    g.add_argument("--state-store-password-file", default=defaults.state_store_password_file, metavar="FILE",
                   help="the store's password (default: $EPD_PROXY_STATE_STORE_PASSWORD, else none)")
    g.add_argument("--state-store-prefix", default=defaults.state_store_prefix, metavar="PREFIX",
                   help="every store key's prefix (default %(default)s)")
    g.add_argument("--state-store-timeout", type=float, default=defaults.state_store_timeout, metavar="SECONDS",
                   help="a store call taking longer counts as failed: the request goes on without reuse "
                        "(default %(default)g)")


def serve_parser() -> argparse.ArgumentParser:
    """The ``serve`` flags alone (what the cluster file may set, and which flags were given)."""
    parser = Parser(prog="epd-proxy serve")
    add_arguments(parser)
    return parser


def _role_caps(values: list[str], errors: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in split_instances(values):
        role, sep, n = item.partition("=")
        try:
            if not sep:
                raise ValueError
            out[role.strip()] = int(n)
        except ValueError:
            errors.append(f"--max-inflight-per-role {item!r}: expected ROLE=N, e.g. prefill=64")
    return out


def _lora_sources(items: list[str], errors: list[str]) -> dict[str, str]:
    """``--lora-source NAME=PATH`` (repeatable, comma-separated) as {name: path}."""
    out: dict[str, str] = {}
    for item in (piece.strip() for value in items for piece in value.split(",") if piece.strip()):
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            errors.append(f"--lora-source {item!r}: expected NAME=PATH")
            continue
        out[name.strip()] = path.strip()
    return out


# Where a section field is not its flag's value as parsed: how it is read from the flags
# (``errors`` collects what cannot be read). Every other field is the flag of its name.
Read = Callable[[argparse.Namespace, list[str]], object]
FROM_FLAGS: dict[str, Read] = {
    "upstream_api_key": lambda a, e: a.upstream_api_key or None,
    "forward_headers": lambda a, e: (*ALWAYS_FORWARDED, *a.forward_header),
    "timeouts": lambda a, e: StageTimeouts(connect=a.connect_timeout, encode=a.encode_timeout,
                                           prefill=a.prefill_timeout, decode_first=a.decode_timeout,
                                           stream_idle=a.stream_idle_timeout, first_byte=a.first_byte_timeout),
    "rewrite": lambda a, e: not a.no_rewrite,
    "ec_consumer_zmq_addrs": lambda a, e: split_instances([a.ec_consumer_zmq_addrs]),
    "allowed_media_schemes": lambda a, e: tuple(split_instances([a.allowed_media_schemes])),
    "allowed_media_hosts": lambda a, e: tuple(split_instances(a.allowed_media_hosts)),
    "lora_sources": lambda a, e: _lora_sources(a.lora_source, e),
    "lora_dir": lambda a, e: a.lora_dir or None,
    "registration_allow": lambda a, e: tuple(a.registration_allow),
    "allow_empty_roles": lambda a, e: tuple(split_instances(a.allow_empty_roles)),
    "topology": lambda a, e: "P+D" if a.topology == "P/D" else a.topology,
    "max_inflight_per_role": lambda a, e: _role_caps(a.max_inflight_per_role, e),
    "api_keys": lambda a, e: tuple(a.api_key),
    "api_key_file": lambda a, e: a.api_key_file or None,
    "admin_api_key": lambda a, e: a.admin_api_key or None,
    "ssl_certfile": lambda a, e: a.ssl_certfile or None,
    "ssl_keyfile": lambda a, e: a.ssl_keyfile or None,
    "trusted_proxies": lambda a, e: tuple(split_instances(a.trusted_proxies)),
}


def section_from_args(cls: type, args: argparse.Namespace, errors: list[str]) -> object:
    """One section of the config, each field read from its flag (``FROM_FLAGS``)."""
    return cls(**{f.name: FROM_FLAGS[f.name](args, errors) if f.name in FROM_FLAGS else getattr(args, f.name)
                  for f in dataclasses.fields(cls)})


def config_from_args(args: argparse.Namespace, errors: list[str] | None = None) -> ProxyConfig:
    """The config the settings describe. What cannot be read (an instance, a role cap) is left
    out and its message appended to ``errors``; without that list, ``ConfigErrors`` names them all."""
    found: list[str] = []
    static, discover = split_discovered({role: split_instances(getattr(args, role)) for role in ROLES}, found)
    sections = {name: section_from_args(cls, args, found) for name, cls in SECTIONS.items()}
    cfg = ProxyConfig(encode=static["encode"], prefill=static["prefill"], decode=static["decode"],
                      discover=discover, tenants=getattr(args, "tenants", None),  # cluster-file tables, no flags
                      model_aliases=getattr(args, "model_aliases", None), **sections)
    if errors is not None:
        errors.extend(found)
    elif found:
        raise ConfigErrors(found)
    return cfg


def serve_options(args: argparse.Namespace) -> ServeOptions:
    return ServeOptions(host=args.host, port=args.port, workers=args.workers, log_level=args.log_level)


# Settings the cluster file may hold as a list although the flag takes one comma-separated string.
_CSV_DESTS = {"ec_consumer_zmq_addrs", "allowed_media_schemes"}


def file_options() -> dict[str, Option]:
    """What the cluster file may set: every ``serve`` flag, typed as the flag is."""
    out = {}
    for action in serve_parser()._actions:
        if action.dest in ("help", "config", *ROLES) or not action.option_strings:
            continue
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            kind = "bool"
        elif isinstance(action, argparse._AppendAction):
            kind = "strlist"
        elif action.type is int:
            kind = "int"
        elif action.type is float:
            kind = "float"
        elif action.type not in (None, str):
            kind = "parsed"  # e.g. sizes: "64M"
        else:
            kind = "csv" if action.dest in _CSV_DESTS else "str"
        out[action.dest] = Option(action.dest, kind, tuple(action.choices) if action.choices else None,
                                  action.type if kind == "parsed" else None)  # type: ignore[arg-type]
    return out


class ServeSettings:
    """The ``serve`` settings: the cluster file (if any) under the flags given on the
    command line. ``load()`` reads the file again, which is how a reload starts.

    ``argv`` is the command line after the program's name (``serve --config ...``): it
    tells the flags given apart from the defaults."""

    def __init__(self, argv: list[str], args: argparse.Namespace) -> None:
        self.argv = list(argv)
        self.path: str | None = args.config
        self._flags = args
        self._explicit = _explicit_dests(argv) if self.path else set()
        self.started: argparse.Namespace = args  # the settings the process started with

    def load(self) -> argparse.Namespace:
        """The merged settings; raises ValueError (ClusterFileError) with one line."""
        args = argparse.Namespace(**vars(self._flags))
        if self.path:
            values = read_cluster_path(self.path, file_options())
            for dest, value in values.items():
                if dest not in self._explicit:
                    setattr(args, dest, value)
        return args

    def config(self, args: argparse.Namespace | None = None) -> ProxyConfig:
        """The config to serve; raises ConfigErrors naming every mistake, of the flags and the
        file alike (the file's own type errors come first, from ``load``)."""
        args = args if args is not None else self.load()
        errors: list[str] = []
        cfg = config_from_args(args, errors)
        errors += serve_options(args).problems()
        from epd_proxy.api.app import validate_config, validate_tables

        try:  # simulated instances are the simulator's: only the client keys and the tables to check
            (validate_tables if args.simulate else validate_config)(cfg)
        except ConfigErrors as exc:
            errors += exc.errors
        if args.simulate:
            errors += _simulate_spec(args.simulate)
        if NO_DECODE in errors and split_instances(args.decode):
            errors.remove(NO_DECODE)  # decode instances were given: their own lines say what is wrong
        if errors:
            raise ConfigErrors(errors)
        return cfg


def _simulate_spec(spec: str) -> list[str]:
    """``--simulate``'s spec read as the simulator will (one line for a mistake, no traceback)."""
    from epd_proxy.sim.cluster import SimCluster

    try:
        SimCluster.from_spec(spec)
    except (ValueError, TypeError) as exc:
        return [f"--simulate {spec!r}: {exc}"]
    return []


def error_text(exc: ValueError, path: str | None) -> str:
    """A refused configuration as ``serve`` and ``check-config`` print it: one line for one
    mistake, else a count and one indented line each; the file named once."""
    lines = exc.errors if isinstance(exc, ConfigErrors) else [str(exc)]
    if path:
        lines = [line.removeprefix(f"{path}: ") for line in lines]
    head = f"{path}: " if path else ""
    if len(lines) == 1:
        return head + lines[0]
    return head + f"{len(lines)} mistakes:\n" + "\n".join(f"  {line}" for line in lines)


def _explicit_dests(argv: list[str]) -> set[str]:
    """The ``serve`` settings given on the command line (these override the cluster file)."""
    probe = serve_parser()
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    return set(vars(probe.parse_args(argv[1:] if argv[:1] == ["serve"] else argv)))


def configure_logging(level: str, fmt: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if fmt == "json":
        from epd_proxy.observe.access_log import JsonFormatter

        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonFormatter())


def argv_for_serve(argv: list[str], command: str, own: frozenset[str] | set[str]) -> list[str]:
    """A command's line as ``serve`` reads it (``epp``'s, ``sidecar``'s): its own flags (``own``,
    with their values) taken out, so a cluster file's values yield to the flags given exactly as
    they do for ``serve``."""
    out, skip = ["serve"], False
    for arg in argv[1:] if argv[:1] == [command] else argv:
        if skip:
            skip = False
        elif arg in own:
            skip = True
        elif arg.split("=", 1)[0] not in own:
            out.append(arg)
    return out


def load_for(prog: str, settings: ServeSettings) -> tuple[argparse.Namespace, ProxyConfig] | None:
    """The settings and config of a command that takes serve's flags (``epp``, ``sidecar``),
    logging configured; None once the mistake is printed in one line (the command exits 2)."""
    try:
        loaded = settings.started = settings.load()
    except ClusterFileError as exc:
        print(f"epd-proxy {prog}: {error_text(exc, settings.path)}", file=sys.stderr)
        return None
    configure_logging(loaded.log_level, loaded.log_format)
    try:
        return loaded, settings.config(loaded)
    except ValueError as exc:
        print(f"epd-proxy {prog}: {error_text(exc, settings.path)}", file=sys.stderr)
        return None


def run(args: argparse.Namespace) -> int:
    """``epd-proxy serve``; ``args.argv`` is the command line (cli.main sets it)."""
    settings = ServeSettings(args.argv, args)
    try:
        args = settings.started = settings.load()
    except ClusterFileError as exc:  # no usage text: the flags were fine
        print(f"epd-proxy serve: {error_text(exc, settings.path)}", file=sys.stderr)
        return 2
    if args.log_requests:
        args.log_level = "debug"
    configure_logging(args.log_level, args.log_format)
    try:
        cfg = settings.config(args)
        from epd_proxy.runtime.serve import tls_context

        tls_context(cfg)  # the certificate and key load
    except ValueError as exc:
        if settings.path:
            print(f"epd-proxy serve: {error_text(exc, settings.path)}", file=sys.stderr)
            return 2
        serve_parser().error(error_text(exc, None))
    from epd_proxy.runtime.serve import serve

    return serve(cfg, args.host, args.port, workers=args.workers, simulate=args.simulate,
                 settings=settings if settings.path else None)
