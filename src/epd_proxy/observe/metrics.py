"""The proxy's Prometheus metrics.

Recording is plain arithmetic on the event loop's thread: an ``int += 1`` and,
for a histogram, one ``bisect``. The Prometheus families are built from those
numbers only when ``/metrics`` is scraped, so a request pays no locks, no label
resolution and no per-sample objects (prometheus_client's own metric objects
take a lock per increment: about a dozen per request).

What the other subsystems know (the pools, the roster, admission, the front door,
DNS discovery, reloads) they tell at scrape time through a collector each registers
(:meth:`ProxyMetrics.register`, prometheus_client's collector idea): a callable that adds
its rows to the families. This module reads no other subsystem, so it imports none.

With ``--workers N`` the numbers stay per process; a scrape turns them into a
:meth:`ProxyMetrics.snapshot` (plain data), the worker that was scraped gathers
its siblings' snapshots (``siblings.py``) and :func:`render` sums them, so every
scrape shows the whole proxy while a request still pays only its ``+= 1``.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any, Callable

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from epd_proxy.observe.version import VERSION

_STAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_BUCKETS = (1, 8, 32, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class Buckets:
    """One histogram series: counts per bucket (upper bounds inclusive, as Prometheus'
    ``le``), the last one for values above every bound."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple = _STAGE_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count of values <= le)`` for each bound and ``+Inf``."""
        out, total = [], 0
        for bound, n in zip(self.bounds, self.counts):
            total += n
            out.append((_le(bound), total))
        out.append(("+Inf", total + self.counts[-1]))
        return out


def _le(bound: float) -> str:
    return repr(float(bound))


# A source's collector: adds its rows (``[labels..., value]``) to the families it knows,
# ``families[name]``, at scrape time. A family no collector fills shows no series.
Collector = Callable[[dict[str, list]], None]

_STATUS_CLASS = {1: "1xx", 2: "2xx", 3: "3xx", 4: "4xx", 5: "5xx"}

# Every family the proxy exports: name -> (type, help, label names). A histogram's
# buckets are _STAGE_BUCKETS. Snapshots carry values only; this is the schema.
FAMILIES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "epd_proxy_requests": ("counter", "Client requests answered, by endpoint and status (499: the client went "
                           "away before a status was sent; endpoint \"other\": no such route, 404/405).",
                           ("endpoint", "status")),
    "epd_proxy_request_duration_seconds": ("histogram", "Time from the request's arrival to the end of the "
                                           "response.", ("endpoint", "stream", "status_class")),
    "epd_proxy_time_to_first_token_seconds": ("histogram", "Streams: time from the request's arrival to the "
                                              "first event sent to the client (encode + prefill + decode's "
                                              "first event + the proxy).", ("endpoint",)),
    "epd_proxy_inter_token_seconds": ("histogram", "Streams: the mean gap between the events relayed to the "
                                      "client after the first, one observation per stream.", ()),
    "epd_proxy_stage_duration_seconds": ("histogram", "Time spent in each stage: encode (the fan-out of an "
                                         "attempt, wall time), encode_request (each encoder sub-request), prefill, "
                                         "kv_handoff (push connectors: decode's wait for its first event after "
                                         "prefill answered), decode_first (decode until its first event), decode "
                                         "(a whole non-streamed answer).", ("stage",)),
    "epd_proxy_overhead_seconds": ("histogram", "Time in the proxy outside the stage phases, until the "
                                   "response is committed: arrival to commit minus the wall time of the encode "
                                   "fan-out and of prefill + decode until its first event.", ()),
    "epd_proxy_retries": ("counter", "Attempts retried before the response was committed.", ()),
    "epd_proxy_not_disaggregated": ("counter", "Generation requests served whole by one decode (or PD) "
                                    "instance because the proxy cannot split them, by reason: media (an image no "
                                    "encoder can be sent, e.g. an uploaded file's id), previous_response_id (the "
                                    "conversation is in one instance's store), background, cached (the KV block index "
                                    "says the chosen decode holds all but --local-prefill-max-tokens of the prompt).",
                                    ("reason",)),
    "epd_proxy_stream_errors": ("counter", "Committed streams ended with an in-band error event.", ()),
    "epd_proxy_stream_migrations": ("counter", "Committed streams whose decode broke off, by why (reset: the "
                                    "connection broke or closed before the terminator; error: decode's in-band "
                                    "error; stall: silent past the stall rule; ejected: the decode was ejected; "
                                    "eof) and what followed (ok: continued to the end on another decode; moved: "
                                    "continued, and that decode broke off too; failed: no decode could continue "
                                    "it; limit: --migration-limit reached; unsound: the answer cannot be "
                                    "continued).", ("reason", "result")),
    "epd_proxy_client_disconnects": ("counter", "Requests whose client went away before the end.", ()),
    "epd_proxy_inflight_requests": ("gauge", "Client requests in progress.", ()),
    "epd_proxy_shed_requests": ("counter", "Requests answered 429 by admission control (queue full or queue "
                                "timeout).", ()),
    "epd_proxy_queue_depth": ("gauge", "Requests waiting for an admission slot.", ()),
    "epd_proxy_admitted_requests": ("gauge", "Admission slots in use (0 when unlimited).", ()),
    "epd_proxy_queue_wait_seconds": ("histogram", "Time queued requests waited for a slot (until admitted or "
                                     "shed).", ()),
    "epd_proxy_stage_shed_requests": ("counter", "Requests answered 429 by a stage's concurrency cap "
                                      "(--max-inflight-per-role).", ("role",)),
    "epd_proxy_stage_queue_depth": ("gauge", "Requests waiting for a stage's slot.", ("role",)),
    "epd_proxy_client_connections": ("gauge", "Open client connections.", ()),
    "epd_proxy_client_connections_refused": ("counter", "Connections answered 503 at once because "
                                             "--max-connections were open and none was idle.", ()),
    "epd_proxy_client_connections_reclaimed": ("counter", "Idle keep-alive connections closed to make room "
                                               "for new ones at --max-connections.", ()),
    "epd_proxy_buffered_body_bytes": ("gauge", "Request-body bytes held (--max-buffered-bytes).", ()),
    "epd_proxy_client_rejections": ("counter", "Requests refused by the HTTP server before any handler ran "
                                    "(400 malformed, 408 too slow, 413/431 too large, 503 over the body "
                                    "budget), by status.", ("status",)),
    "epd_proxy_instance_healthy": ("gauge", "1 if the instance is in this worker's rotation (each worker "
                                   "keeps its own view).", ("role", "url", "worker")),
    "epd_proxy_instance_inflight": ("gauge", "Requests in flight to the instance.", ("role", "url")),
    "epd_proxy_instance_requests": ("counter", "Requests sent to the instance (every stage leg).",
                                    ("role", "url")),
    "epd_proxy_instance_failures": ("counter", "Failures seen on the instance, by kind (connect, timeout, "
                                    "http_503, in_band, ...).", ("role", "url", "kind")),
    "epd_proxy_instance_retries": ("counter", "Attempts retried elsewhere after this instance failed them.",
                                   ("role", "url")),
    "epd_proxy_instance_ejections": ("counter", "Times the instance was taken out of rotation (probes or "
                                     "outlier detection).", ("role", "url")),
    "epd_proxy_hedges": ("counter", "Prefills that got a hedge (a second attempt after the hedge delay) or would "
                         "have, by result: won (the hedge answered first), lost (the first attempt did), failed "
                         "(the hedge failed), budget_exhausted, instance_bound, no_alternative (no hedge sent).",
                         ("role", "result")),
    "epd_proxy_kv_stranded": ("counter", "Prefills whose KV no decode took (pull: the decode leg failed after "
                              "the prefill answered), held on the prefill until vLLM's lease on the blocks runs "
                              "out; an upper bound (a decode that failed after reading them freed them).",
                              ("role", "url")),
    "epd_proxy_instance_model_info": ("gauge", "1 for each base model the instance serves (its /v1/models, within "
                                      "its models attribute); none while it has not said.", ("role", "url", "model")),
    "epd_proxy_instance_adapters": ("gauge", "LoRA adapters the instance serves (its /v1/models cards with a "
                                    "parent).", ("role", "url")),
    "epd_proxy_panic_routing": ("counter", "Requests routed over every instance of a role because none was "
                                "in rotation.", ("role",)),
    "epd_proxy_wedged_routing": ("counter", "Requests placed while every decode of their model stood still "
                                 "(requests waiting, none running: wedged), by outcome: prefill_alone (a prefill "
                                 "answered the request whole), refused (503 overloaded at once, no instance could "
                                 "take it).", ("role", "outcome")),
    "epd_proxy_local_errors": ("counter", "Upstream connects that failed for lack of the proxy's own "
                               "resources (EMFILE, ENOBUFS, memory); never blamed on an instance.", ("role",)),
    "epd_proxy_kv_events_received": ("counter", "KV cache event batches applied to the block index from the "
                                     "instance's engine (data-parallel rank), live or replayed.", ("url", "rank")),
    "epd_proxy_kv_events_gaps": ("counter", "Live KV event batches that came after a gap in the sequence (a "
                                 "replay was asked for).", ("url", "rank")),
    "epd_proxy_kv_events_replays": ("counter", "Replay requests the instance's replay socket answered (on "
                                    "connect, on gaps, and every heartbeat).", ("url", "rank")),
    "epd_proxy_kv_events_restarts": ("counter", "Engine restarts seen in the KV events (the instance's blocks "
                                     "cleared).", ("url", "rank")),
    "epd_proxy_kv_events_lost": ("counter", "KV event gaps no replay could fill (the instance's blocks "
                                 "cleared).", ("url", "rank")),
    "epd_proxy_kv_events_connected": ("gauge", "1 while the instance's KV event stream answers (its replay "
                                      "socket, every heartbeat); 0: routing on its blocks is off.",
                                      ("url", "rank", "worker")),
    "epd_proxy_kv_index_instance_blocks": ("gauge", "KV blocks the index holds for the instance.",
                                           ("url", "rank")),
    "epd_proxy_kv_index_blocks": ("gauge", "(instance, block) pairs in the KV block index "
                                  "(--kv-index-max-blocks bounds them).", ()),
    "epd_proxy_kv_index_evictions": ("counter", "(instance, block) pairs the KV block index forgot for its "
                                     "bound.", ()),
    "epd_proxy_kv_lookups": ("counter", "Requests and the KV block index: indexed (the prompt's tokens looked up), "
                             "not_live (no instance's events live), media and api (approximate routing for "
                             "requests with media and for Messages, Responses, generate), no_prompt, "
                             "tokenize_failed.", ("outcome",)),
    "epd_proxy_kv_tokenize_seconds": ("counter", "Time spent in /tokenize calls for the block index.", ()),
    "epd_proxy_epp_decisions": ("counter", "epd-proxy epp: what each request the gateway asked about came to: "
                                "picked, rewritten (picked, its body changed: an alias, fields the proxy owns), "
                                "none_eligible (503), shed (429), refused (another status).", ("outcome",)),
    "epd_proxy_epp_requests": ("gauge", "epd-proxy epp: requests placed whose gateway stream has not ended.", ()),
    "epd_proxy_epp_served_by_fallback": ("counter", "epd-proxy epp: answers the gateway reports from a fallback "
                                         "endpoint (not the first one named).", ()),
    "epd_proxy_routing_exact": ("counter", "cache-aware picks made on the KV block index (every candidate's "
                                "events live).", ("role",)),
    "epd_proxy_routing_spills": ("counter", "cache-aware picks that passed over the preferred instance for its "
                                 "load.", ("role",)),
    "epd_proxy_instance_other_requests": ("gauge", "Requests on the instance that are not this worker's, as "
                                          "its last /metrics scrape said (0 when unknown; each worker's own "
                                          "view).", ("role", "url", "worker")),
    "epd_proxy_roster_instances": ("gauge", "Instances in the roster, by registered role and state (healthy, "
                                   "ejected, half-open, draining; leaving = removed, requests still in flight).",
                                   ("role", "state")),
    "epd_proxy_registrations": ("counter", "Instances that joined the roster, by role.", ("role",)),
    "epd_proxy_removals": ("counter", "Instances that left the roster, by role and why (unregistered, drained, "
                           "forgotten).", ("role", "reason")),
    "epd_proxy_dns_lookups": ("counter", "Re-resolutions of dns+ instance names, by result (failed: the known "
                              "instances were kept).", ("result",)),
    "epd_proxy_reloads": ("counter", "Reloads (SIGHUP or a changed cluster file), by result (failed: the running "
                          "configuration was kept).", ("result",)),
    "epd_proxy_workers": ("gauge", "Worker processes whose numbers this scrape includes.", ()),
    "epd_proxy_build_info": ("gauge", "1, labelled with the proxy's own version (GET /version answers an "
                             "instance's, as vLLM clients expect).", ("version",)),
    "epd_proxy_model_requests": ("counter", "Generation and routed requests answered, by the request's model "
                                 "(\"-\": it named none, or one no instance serves; \"other\": past "
                                 "--metrics-max-models) and status.", ("model", "status")),
    "epd_proxy_model_request_duration_seconds": ("histogram", "Time from the request's arrival to the end of the "
                                                 "response, by model.", ("model", "stream")),
    "epd_proxy_model_time_to_first_token_seconds": ("histogram", "Streams: time from the request's arrival to the "
                                                    "first event sent to the client, by model.", ("model",)),
    "epd_proxy_model_inter_token_seconds": ("histogram", "Streams: the mean gap between the events relayed after "
                                            "the first, one observation per stream, by model.", ("model",)),
    "epd_proxy_prompt_tokens": ("counter", "Prompt tokens of the answered requests, as their usage says, by the "
                                "request's model (\"-\": none; \"other\": past --metrics-max-models).", ("model",)),
    "epd_proxy_completion_tokens": ("counter", "Completion tokens of the answered requests, by model.", ("model",)),
    "epd_proxy_cached_tokens": ("counter", "Prompt tokens served from the prefix cache "
                                "(usage.prompt_tokens_details.cached_tokens, when reported), by model.", ("model",)),
    "epd_proxy_request_tokens": ("histogram", "Tokens per answered request, by model and kind (prompt, "
                                 "completion).", ("model", "kind")),
    "epd_proxy_encoder_items": ("counter", "Media items placed on the encoder (cache-aware; repeats "
                                "included).", ("url",)),
    "epd_proxy_encoder_work_tokens": ("counter", "Estimated encoder tokens of the new media placed on the "
                                      "encoder (cache-aware).", ("url",)),
    "epd_proxy_encoder_affinity_hits": ("counter", "Repeated media items sent to the encoder that encoded "
                                        "them before (cache-aware).", ("url",)),
    "epd_proxy_encoder_outstanding": ("gauge", "Media items in flight to the encoder "
                                      "(--encoder-max-outstanding bounds it per process).", ("url",)),
    "epd_proxy_encoder_failovers": ("counter", "Media items moved to another encoder after this one failed "
                                    "them (no connection, 5xx, timeout).", ("url",)),
    "epd_proxy_kv_reuse_turns": ("counter", "Multi-turn KV reuse: requests by their turn's one outcome: reused "
                                 "(the prefill read the previous turn's KV from decode), local_prefill (the decode "
                                 "holding it computed the new part alone), opening, or why it fell back: "
                                 "unmatched, not_keyed, not_held, stream_no_params, older_turn, edited, already_used, "
                                 "expired, evicted, superseded, decode_gone, decode_dropped, tokens, tokenize_failed, "
                                 "prefill_failed, no_pull_prefill, media, retried, request_failed, invalid (the turn "
                                 "read back from the shared store failed its checks).", ("outcome",)),
    "epd_proxy_kv_reuse_answers": ("counter", "Decode answers that held blocks for a later reader: kept for the "
                                   "next turn (kept), or why not: no_token_ids (Messages, Responses, a stream "
                                   "without token ids), reasoning, choices, unknown, short.", ("result",)),
    "epd_proxy_kv_reuse_local_prefill_declined": ("counter", "Turns short enough to skip the prefill whose "
                                                  "decode ran more than --local-prefill-max-streams other "
                                                  "requests (the prefill ran).", ()),
    "epd_proxy_kv_reuse_freed": ("counter", "Kept parameters handed to a prefill only to free decode's blocks "
                                 "early.", ()),
    "epd_proxy_kv_reuse_released": ("counter", "Kept parameters let go unused, by reason: superseded, bound, "
                                    "expired, decode_gone; decode frees their blocks at its TTL, or at once when "
                                    "the proxy hands them to a prefill (released).", ("reason",)),
    "epd_proxy_kv_reuse_held_tokens": ("gauge", "Tokens of KV that parameters kept by this proxy hold on the "
                                       "decode (what decode pins for them until read or expired).", ("url",)),
    "epd_proxy_kv_reuse_pressure": ("counter", "Kept turns let go, or not kept, to keep what they pin below the "
                                    "decode's KV capacity, by decode and reason: pressure (usage high or "
                                    "requests waiting; new turns not kept either when the traffic "
                                    "offered times a turn's life cannot fit), share (past the budget).",
                                    ("url", "reason")),
    "epd_proxy_state_store_errors": ("counter", "Calls to the shared state store (--state-store, or the --workers "
                                     "parent) that failed or took longer than --state-store-timeout, by "
                                     "operation (ping: the background probe while it is down); each cost "
                                     "reuse, never an answer.", ("op",)),
    "epd_proxy_state_store_invalid": ("counter", "Entries read back from the shared state store that failed "
                                      "the proxy's checks (malformed, out of bounds, or transfer parameters that "
                                      "do not point at the decode they name), by entry (turn, turn_unverified, "
                                      "response_owner, held_tokens, lengths, conversation): each a miss, never "
                                      "used.", ("entry",)),
    "epd_proxy_response_lookups": ("counter", "Stored Responses looked up (GET /v1/responses/{id}, /cancel, a "
                                   "previous_response_id follow-up), by result: owner (asked at the decode "
                                   "that made it), searched (every decode asked), refused (client keys: "
                                   "another key's, or no owner known: 404, no decode asked).", ("result",)),
    "epd_proxy_state_store_up": ("gauge", "1 while the shared state store answers (0: down, calls skipped until "
                                 "a probe succeeds), by kind (redis, parent); summed over --workers.",
                                 ("store",)),
    "epd_proxy_shared_homes": ("counter", "cache-aware's conversation placements shared through the state store, "
                               "by event: published (a turn placed off the rendezvous order, written), "
                               "dropped (not written: too many writes in flight), recalled (a turn whose "
                               "previous turn another replica routed, looked up), found (and its placement "
                               "found).", ("event",)),
    "epd_proxy_lora_calls": ("counter", "LoRA adapter loads and unloads this proxy made on instances, one per "
                             "instance: by trigger (admin: POST /v1/load_lora_adapter or /v1/unload_lora_adapter "
                             "through the proxy; on_demand: a request named an adapter a source knows), verb and "
                             "outcome (ok: 200, or the instance had it already).", ("trigger", "verb", "outcome")),
    "epd_proxy_lora_loads_pending": ("gauge", "LoRA adapters being loaded on demand now (requests wait on them).",
                                     ()),
    "epd_proxy_encoder_fallbacks": ("counter", "Media items sent raw to the consumer, which encoded them "
                                    "itself (--encoder-fallback local).", ()),
    # Tenants (tenants/limiter.py): labelled by the key's name when the [tenants] table gives it an
    # entry, "default" for the other keys, "-" without a key: bounded by the cluster file.
    "epd_proxy_tenant_requests": ("counter", "Requests of each key by result: admitted, forbidden (403: a model "
                                  "it may not use), limited_<limit> (429 by that limit, e.g. "
                                  "limited_requests_per_minute, limited_concurrent).", ("key", "result")),
    "epd_proxy_tenant_tokens": ("counter", "Tokens of each key's answers, as their usage says, by kind (input, "
                                "output).", ("key", "kind")),
    "epd_proxy_tenant_inflight": ("gauge", "Requests of each key in progress.", ("key",)),
    "epd_proxy_tenant_store_failures": ("counter", "Requests the shared counters' store could not count (an "
                                        "error, no answer in time, or within a second of one), by how they "
                                        "went on: open (admitted uncounted), closed (503).", ("mode",)),
    "epd_proxy_tenant_shed_requests": ("counter", "Requests shed by admission control (queue full, queue "
                                       "timeout, a sheddable class finding no free slot), by priority class.",
                                       ("class",)),
    "epd_proxy_tenant_displaced_requests": ("counter", "Waiting requests a full admission queue gave up "
                                            "(429) for a newcomer of a higher class.", ()),
    "epd_proxy_encode_item_failures": ("counter", "Media items two encoders failed alike, taken as the request's "
                                       "fault, not the encoders' (item_timeout: both timed out; item_error: "
                                       "vLLM's 500); the request failed at once, or the item went raw to the "
                                       "consumer (--encoder-fallback local).", ("reason",)),
}
# Histograms whose buckets are not _STAGE_BUCKETS.
_BOUNDS = {"epd_proxy_request_tokens": _TOKEN_BUCKETS}
# The roster is shared by the workers (each applies every change), a reload reaches each of
# them, and each reads what every instance serves: across workers these take the largest
# value, not the sum.
_MAX_ACROSS_WORKERS = {"epd_proxy_roster_instances", "epd_proxy_registrations", "epd_proxy_removals",
                       "epd_proxy_reloads", "epd_proxy_instance_model_info", "epd_proxy_instance_adapters",
                       "epd_proxy_build_info"}

# The process_* and python_* families (prometheus_client's own collectors), per process.
_RUNTIME = CollectorRegistry(auto_describe=False)
ProcessCollector(registry=_RUNTIME)
PlatformCollector(registry=_RUNTIME)
GCCollector(registry=_RUNTIME)
# Summed across workers except these (a start time, limits, the interpreter's description).
_RUNTIME_MIN = {"process_start_time_seconds", "process_max_fds"}
_RUNTIME_ANY = {"python_info"}


NO_MODEL = "-"  # the label of a request that named no model, or one no instance serves
OTHER_MODELS = "other"  # the label every model past --metrics-max-models shares


class ModelSeries:
    """One model label's numbers: what a request records through its record's ``series``
    (resolved once per request, so recording is attribute access and arithmetic)."""

    __slots__ = ("label", "requests", "whole", "stream", "ttft", "itl", "tokens", "prompt", "completion")

    def __init__(self, label: str) -> None:
        self.label = label
        self.requests: dict[int, int] = {}  # status -> answered
        self.whole = Buckets()  # durations of non-streamed answers
        self.stream = Buckets()  # ... and of streams
        self.ttft = Buckets()
        self.itl = Buckets()
        self.tokens = [0, 0, 0]  # prompt, completion, cached
        self.prompt = Buckets(_TOKEN_BUCKETS)  # tokens per answered request
        self.completion = Buckets(_TOKEN_BUCKETS)


class ProxyMetrics:
    """Request, stage and failure counts of this process; what other subsystems know comes
    from the collectors they register."""

    def __init__(self, worker: int = 0, max_models: int = 32) -> None:
        self.requests: dict[tuple[str, int], int] = {}  # (endpoint, status) -> answered
        self.durations: dict[tuple[str, bool, int], Buckets] = {}  # (endpoint, stream, status // 100)
        self.stages: dict[str, Buckets] = {}  # stage -> time spent in it
        self.ttft: dict[str, Buckets] = {}  # endpoint -> arrival to first event (streams)
        self.itl = Buckets()  # per stream: mean gap between events
        self.overhead = Buckets()  # arrival to commit minus the stage durations
        self.retries = 0
        self.instance_retries: dict[tuple[str, str], int] = {}  # (role, url) -> attempts it failed, retried
        self.stream_errors = 0
        self.migrations: dict[tuple[str, str], int] = {}  # (reason, result) -> streams (request/migration.py)
        self.not_disaggregated: dict[str, int] = {}  # reason -> requests served whole by one instance
        self.hedges: dict[tuple[str, str], int] = {}  # (role, result) -> hedges (request/legs/hedged.py)
        self.disconnects = 0
        self.inflight = 0
        self.worker = worker  # this process's index with --workers (the instance_healthy label)
        self.queue_wait = Buckets()  # queued requests only: time until admitted or shed
        # Per model label: requests, latency and tokens. The first max_models models a request
        # named (and the cluster serves) get their own label, per process; later ones share
        # "other": the label set, and this dict, stay bounded whatever clients send.
        self.max_models = max_models
        self.no_model = ModelSeries(NO_MODEL)
        self.models: dict[str, ModelSeries] = {}
        self._other: ModelSeries | None = None
        self._collectors: list[Collector] = []

    def register(self, collector: Collector) -> None:
        """A source's rows, added at every scrape (in the order registered)."""
        self._collectors.append(collector)

    # -- recording (hot path) -------------------------------------------------------------
    def model(self, name: object) -> ModelSeries:
        """The series of a request naming model ``name`` (a string the cluster serves; anything
        else is ``no_model``): its own while fewer than ``max_models`` have one, else "other"."""
        if type(name) is not str:
            return self.no_model
        series = self.models.get(name)
        if series is None:
            if len(self.models) < self.max_models:
                series = self.models[name] = ModelSeries(name)
            else:
                series = self._other
                if series is None:
                    series = self._other = ModelSeries(OTHER_MODELS)
        return series

    def observe_request(self, endpoint: str, status: int, seconds: float, stream: bool = False,
                        series: ModelSeries | None = None) -> None:
        key = (endpoint, status)
        self.requests[key] = self.requests.get(key, 0) + 1
        dkey = (endpoint, stream, status // 100)
        d = self.durations.get(dkey)
        if d is None:
            d = self.durations[dkey] = Buckets()
        d.counts[bisect_left(d.bounds, seconds)] += 1  # Buckets.observe, inline (so below): every request
        d.sum += seconds
        if series is not None:
            counts = series.requests
            counts[status] = counts.get(status, 0) + 1
            b = series.stream if stream else series.whole
            b.counts[bisect_left(b.bounds, seconds)] += 1  # Buckets.observe, inline: every request
            b.sum += seconds

    def observe_tokens(self, series: ModelSeries, tokens: tuple) -> None:
        """An answer's usage, ``(prompt, completion, cached)`` (None: not reported)."""
        prompt, completion, cached = tokens
        counts = series.tokens
        if prompt is not None:
            counts[0] += prompt
            b = series.prompt
            b.counts[bisect_left(b.bounds, prompt)] += 1
            b.sum += prompt
        if completion is not None:
            counts[1] += completion
            b = series.completion
            b.counts[bisect_left(b.bounds, completion)] += 1
            b.sum += completion
        if cached is not None:
            counts[2] += cached

    def observe_encoder_request(self, seconds: float) -> None:
        b = self.stages.get("encode_request")
        if b is None:
            b = self.stages["encode_request"] = Buckets()
        b.observe(seconds)

    def observe_stages(self, timings: dict) -> None:
        stages = self.stages
        for stage, seconds in timings.items():
            b = stages.get(stage)
            if b is None:
                b = stages[stage] = Buckets()
            b.counts[bisect_left(b.bounds, seconds)] += 1
            b.sum += seconds

    def observe_commit(self, endpoint: str, since_arrival: float, upstream: float, stream: bool,
                       series: ModelSeries | None = None) -> None:
        """The response is about to be committed: the proxy's own share of the time so far
        (``upstream``: the wall time of the stage phases), and for a stream its time to first token."""
        own = since_arrival - upstream
        if own < 0.0:
            own = 0.0
        overhead = self.overhead
        overhead.counts[bisect_left(overhead.bounds, own)] += 1  # Buckets.observe, inline
        overhead.sum += own
        if stream:
            b = self.ttft.get(endpoint)
            if b is None:
                b = self.ttft[endpoint] = Buckets()
            b.observe(since_arrival)
            if series is not None:
                series.ttft.observe(since_arrival)

    def observe_gap(self, gap: float, series: ModelSeries | None = None) -> None:
        """A stream's mean gap between events (one observation per stream)."""
        self.itl.observe(gap)
        if series is not None:
            series.itl.observe(gap)

    def completion_tokens(self) -> int:
        """Completion tokens answered so far, over every model label (the console's gateway summary)."""
        every = [self.no_model, *self.models.values()] + ([self._other] if self._other is not None else [])
        return sum(s.tokens[1] for s in every)

    # -- exposition (scrape time) ----------------------------------------------------------
    def render(self, peers: list | None = None) -> bytes:
        """The exposition text of this process plus ``peers`` (other workers' snapshots)."""
        return render([self.snapshot()] + (peers or []))

    def snapshot(self) -> dict:
        """This process's numbers as plain data (JSON-encodable): family -> [[labels..., value]],
        a histogram's value being ``[counts per bucket, sum]``; runtime families apart."""
        f: dict[str, list] = {name: [] for name in FAMILIES}
        f["epd_proxy_requests"] = [[e, str(s), n] for (e, s), n in self.requests.items()]
        f["epd_proxy_request_duration_seconds"] = [
            [e, "true" if st else "false", _STATUS_CLASS.get(c, "other"), b.counts, b.sum]
            for (e, st, c), b in self.durations.items()]
        f["epd_proxy_time_to_first_token_seconds"] = [[e, b.counts, b.sum] for e, b in self.ttft.items()]
        f["epd_proxy_inter_token_seconds"] = [[self.itl.counts, self.itl.sum]]
        f["epd_proxy_stage_duration_seconds"] = [[s, b.counts, b.sum] for s, b in self.stages.items()]
        f["epd_proxy_overhead_seconds"] = [[self.overhead.counts, self.overhead.sum]]
        f["epd_proxy_retries"] = [[self.retries]]
        f["epd_proxy_instance_retries"] = [[r, u, n] for (r, u), n in self.instance_retries.items()]
        f["epd_proxy_stream_errors"] = [[self.stream_errors]]
        f["epd_proxy_stream_migrations"] = [[r, res, n] for (r, res), n in self.migrations.items()]
        f["epd_proxy_not_disaggregated"] = [[r, n] for r, n in self.not_disaggregated.items()]
        f["epd_proxy_hedges"] = [[r, result, n] for (r, result), n in self.hedges.items()]
        f["epd_proxy_client_disconnects"] = [[self.disconnects]]
        f["epd_proxy_inflight_requests"] = [[self.inflight]]
        f["epd_proxy_workers"] = [[1]]
        f["epd_proxy_build_info"] = [[VERSION, 1]]
        self._model_rows(f)
        for collect in self._collectors:
            collect(f)
        runtime = []
        for fam in _RUNTIME.collect():
            runtime.append([fam.name, fam.type, fam.documentation, [[s.name, s.labels, s.value] for s in fam.samples]])
        return {"families": f, "runtime": runtime}


    def _model_rows(self, f: dict[str, list]) -> None:
        """The per-model families: a label's rows appear once it has something to show."""
        every = [self.no_model, *self.models.values()] + ([self._other] if self._other is not None else [])
        for s in every:
            m = s.label
            for status, n in s.requests.items():
                f["epd_proxy_model_requests"].append([m, str(status), n])
            for stream, b in (("false", s.whole), ("true", s.stream)):
                if b.sum or any(b.counts):
                    f["epd_proxy_model_request_duration_seconds"].append([m, stream, b.counts, b.sum])
            for name, b in (("epd_proxy_model_time_to_first_token_seconds", s.ttft),
                            ("epd_proxy_model_inter_token_seconds", s.itl)):
                if any(b.counts):
                    f[name].append([m, b.counts, b.sum])
            if any(s.completion.counts) or any(s.prompt.counts):
                f["epd_proxy_prompt_tokens"].append([m, s.tokens[0]])
                f["epd_proxy_completion_tokens"].append([m, s.tokens[1]])
                f["epd_proxy_cached_tokens"].append([m, s.tokens[2]])
                f["epd_proxy_request_tokens"] += [[m, "prompt", s.prompt.counts, s.prompt.sum],
                                                  [m, "completion", s.completion.counts, s.completion.sum]]


def render(snapshots: list[dict]) -> bytes:
    """Prometheus text for the sum of ``snapshots`` (one per worker)."""
    return generate_latest(_Merged(snapshots))


class _Merged:
    """A one-shot collector over summed snapshots (what ``generate_latest`` iterates)."""

    def __init__(self, snapshots: list[dict]) -> None:
        self.snapshots = snapshots

    def collect(self):
        merged = merge([s["families"] for s in self.snapshots])
        for name, (kind, doc, labels) in FAMILIES.items():
            series = merged.get(name, {})
            if kind == "histogram":
                h = HistogramMetricFamily(name, doc, labels=list(labels))
                for key, (counts, total) in sorted(series.items()):
                    b = Buckets(_BOUNDS.get(name, _STAGE_BUCKETS))
                    b.counts, b.sum = counts, total
                    h.add_metric(list(key), b.cumulative(), sum_value=total)
                yield h
            else:
                cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                fam = cls(name, doc, labels=list(labels))
                for key, value in sorted(series.items()):
                    fam.add_metric(list(key), float(value))
                yield fam
        yield from _merge_runtime([s.get("runtime", []) for s in self.snapshots])


def merge(snapshots: list[dict]) -> dict[str, dict[tuple, Any]]:
    """Sum per family and label set: counters and gauges add up, histograms add bucket by bucket."""
    out: dict[str, dict[tuple, Any]] = {}
    for snap in snapshots:
        for name, rows in snap.items():
            spec = FAMILIES.get(name)
            if spec is None:
                continue
            series = out.setdefault(name, {})
            if spec[0] == "histogram":
                for row in rows:
                    key, counts, total = tuple(row[:-2]), row[-2], row[-1]
                    have = series.get(key)
                    if have is None:
                        series[key] = (list(counts), total)
                    else:
                        series[key] = ([a + b for a, b in zip(have[0], counts)], have[1] + total)
            elif name in _MAX_ACROSS_WORKERS:
                for row in rows:
                    key = tuple(row[:-1])
                    series[key] = max(series.get(key, 0), row[-1])
            else:
                for row in rows:
                    key = tuple(row[:-1])
                    series[key] = series.get(key, 0) + row[-1]
    return out


def carried(families: dict) -> dict:
    """The families that only grow (counters and histograms): what a worker's replacement
    goes on from. Gauges are each process's present, never carried over."""
    return {name: rows for name, rows in families.items() if FAMILIES.get(name, ("gauge",))[0] != "gauge"}


def combine(base: dict, families: dict) -> dict:
    """``families`` counted on from ``base`` (both in snapshot form), as :func:`merge` would sum
    them for a scrape; roster-wide families take the larger value."""
    out: dict[str, list] = {}
    for name, series in merge([base, families]).items():
        if FAMILIES[name][0] == "histogram":
            out[name] = [[*key, counts, total] for key, (counts, total) in series.items()]
        else:
            out[name] = [[*key, value] for key, value in series.items()]
    return out


def _merge_runtime(per_worker: list[list]):
    fams: dict[str, tuple] = {}
    values: dict[str, dict] = {}
    for runtime in per_worker:
        for name, kind, doc, samples in runtime:
            fams.setdefault(name, (kind, doc))
            acc = values.setdefault(name, {})
            for sname, labels, value in samples:
                key = (sname, tuple(sorted(labels.items())))
                if key not in acc or name in _RUNTIME_ANY:
                    acc.setdefault(key, value)
                elif name in _RUNTIME_MIN:
                    acc[key] = min(acc[key], value)
                else:
                    acc[key] = acc[key] + value
    for name, (kind, doc) in fams.items():
        m = Metric(name, doc, kind)
        for (sname, labels), value in values[name].items():
            m.add_sample(sname, dict(labels), value)
        yield m
