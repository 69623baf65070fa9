"""What a simulated instance tells about itself: ``/sim/state``, ``/v1/models`` and
``/metrics`` (vLLM's load signals and counters, plus ``sim:`` extras).

Read-only views of an instance; they change nothing.
"""

from __future__ import annotations

import time

import msgspec

from epd_proxy.sim.host import SimHost

_encode = msgspec.json.encode


def state(inst: SimHost) -> dict:
    """``GET /sim/state``: held KV, queue lengths and counters."""
    eng = inst.engine
    kv = inst.kv
    pc = inst.prefix_cache
    ec = inst.encoder_cache
    return {
        "name": inst.name, "role": inst.role, "url": inst.url, "engine_id": inst.engine_id,
        "healthy": inst.healthy, "held_kv_blocks": kv.held_blocks,
        "held_kv": [{"request_id": h.request_id, "transfer_id": h.transfer_id, "blocks": h.block_ids}
                    for h in kv.held()],
        "push_waiters": kv.push_waiters(),
        "kept_kv_blocks": inst.kv_reuse.kept_blocks,
        "kept_kv": [{"request_id": k.request_id, "blocks": k.block_ids, "tokens": len(k.ids), "expiry": k.expiry}
                    for k in inst.kv_reuse.kept()],
        "running": eng.num_running if eng else 0, "waiting": eng.num_waiting if eng else 0,
        # [[ms, stream tokens]]: the modelled inter-token latency (Engine.gaps)
        "itl_model": [[k / 10, n] for k, n in sorted(eng.gaps.items())] if eng else [],
        "stats": inst.stats.as_dict(), "ec_store_entries": len(inst.ec_store),
        "prefix_cache": None if pc is None else {"blocks": len(pc), "queries": pc.queries, "hits": pc.hits},
        "lora": {"adapters": dict(inst.lora.adapters), "active": list(inst.lora.active), "swaps": inst.lora.swaps,
                 "requests": inst.lora.requests},
        "encoder_cache": None if ec is None else {"items": len(ec), "tokens": ec.tokens, "queries": ec.queries,
                                                  "hits": ec.hits},
    }


def models_body(inst: SimHost) -> bytes:
    """``GET /v1/models``, vLLM's shape with ``max_model_len``: a card per served name, each
    with the first name's ``root`` (one set of weights behind every alias), then a card per
    LoRA adapter (``parent`` the first name, ``root`` its path)."""
    root = inst.config.model
    created = inst.created
    permission = [{"id": f"modelperm-{inst.name}", "object": "model_permission",
                   "created": created, "allow_create_engine": False, "allow_sampling": True,
                   "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                   "allow_fine_tuning": False, "organization": "*", "group": None,
                   "is_blocking": False}]
    cards = [{"id": m, "object": "model", "created": created, "owned_by": "vllm", "root": root,
              "parent": None, "max_model_len": inst.config.max_model_len, "permission": permission}
             for m in inst.config.served_names]
    return _encode({"object": "list", "data": cards + inst.lora.cards(root, created, permission)})


def metrics_text(inst: SimHost) -> str:
    """Prometheus text: vLLM's load signals and counters, plus ``sim:`` extras."""
    eng = inst.engine
    st = inst.stats
    cfg = inst.config
    held_blocks = inst.kv.held_blocks
    pc = inst.prefix_cache
    ec = inst.encoder_cache
    lbl = f'model_name="{cfg.model}",engine="0"'
    running = eng.num_running if eng else 0
    waiting = eng.num_waiting if eng else 0
    kept_blocks = inst.kv_reuse.kept_blocks
    used = (eng.kv_blocks_in_use(cfg.block_size) if eng else 0) + held_blocks + kept_blocks
    usage = min(used / cfg.num_gpu_blocks, 1.0) if cfg.num_gpu_blocks else 0.0
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{lbl}}} {running}.0",
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{lbl}}} {waiting}.0",
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{lbl}}} {usage!r}",
        # vLLM's CacheConfig as an info gauge (value 1, the fields as labels, one per engine):
        # what a usage fraction is a fraction of.
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        "# TYPE vllm:cache_config_info gauge",
        f'vllm:cache_config_info{{block_size="{cfg.block_size}",cache_dtype="auto",calculate_kv_scales="False",'
        f'cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",'
        f'is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="{cfg.num_gpu_blocks}",'
        f'num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",sliding_window="None",'
        f'swap_space="4"}} 1.0',
        "# HELP vllm:request_success_total Count of successfully processed requests.",
        "# TYPE vllm:request_success_total counter",
    ]
    for reason in ("stop", "length", "abort", "error", "repetition"):
        lines.append(f'vllm:request_success_total{{{lbl},finished_reason="{reason}"}} '
                     f"{st.success.get(reason, 0)}.0")
    lines += [
        "# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.",
        "# TYPE vllm:prompt_tokens_by_source_total counter",
        f'vllm:prompt_tokens_by_source_total{{{lbl},source="local_compute"}} {st.local_prompt_tokens}.0',
        f'vllm:prompt_tokens_by_source_total{{{lbl},source="local_cache_hit"}} {pc.hits if pc else 0}.0',
        f'vllm:prompt_tokens_by_source_total{{{lbl},source="external_kv_transfer"}} '
        f"{st.external_cached_tokens}.0",
    ]
    if inst.role in ("prefill", "decode") and cfg.kv_connector != "mooncake":
        # NixlConnector's histogram of bytes per transfer (one transfer per KV load here).
        lines += ["# HELP vllm:nixl_bytes_transferred Histogram of bytes transferred per NIXL KV Cache "
                  "transfers.", "# TYPE vllm:nixl_bytes_transferred histogram"]
        cum = 0
        for le, count in zip(st.KV_BYTES_BUCKETS, st.kv_bytes_buckets):
            cum += count
            lines.append(f'vllm:nixl_bytes_transferred_bucket{{{lbl},le="{float(le)!r}"}} {cum}.0')
        lines += [f'vllm:nixl_bytes_transferred_bucket{{{lbl},le="+Inf"}} {st.kv_transfers}.0',
                  f"vllm:nixl_bytes_transferred_count{{{lbl}}} {st.kv_transfers}.0",
                  f"vllm:nixl_bytes_transferred_sum{{{lbl}}} {st.kv_bytes_transferred}.0"]
    counters = [
        ("vllm:prompt_tokens_total", "Number of prefill tokens processed.", st.prompt_tokens),
        ("vllm:generation_tokens_total", "Number of generation tokens processed.", st.generation_tokens),
        ("vllm:num_preemptions_total", "Cumulative number of preemptions.", 0),
        ("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.",
         pc.queries if pc else 0),
        ("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.",
         pc.hits if pc else 0),
        ("vllm:external_prefix_cache_queries_total", "External prefix cache queries from KV connector "
         "cross-instance cache sharing, in terms of number of queried tokens.", st.external_queried_tokens),
        ("vllm:external_prefix_cache_hits_total", "External prefix cache hits from KV connector "
         "cross-instance cache sharing, in terms of number of cached tokens.", st.external_cached_tokens),
        ("vllm:nixl_num_failed_transfers_total", "Failed KV loads (this instance as consumer).",
         st.kv_pull_failures),
        ("sim:requests_total", "Generation requests received.", st.requests),
        ("sim:local_prefills_total", "Prompts computed on this instance instead of loaded over KV transfer.",
         st.local_prefills),
        ("sim:local_encodes_total", "Raw media items encoded by this (consumer) instance itself.",
         st.local_encodes),
        ("sim:ec_hits_total", "Media items found in the encoder cache.", st.ec_hits),
        ("sim:ec_failures_total", "Requests failed for a missing or mismatched embedding.", st.ec_failures),
        ("sim:encoded_items_total", "Media items encoded (encoder).", st.encoded_items),
        ("sim:encode_ms_total", "Encoder time spent on items missing from its cache (ms, whole).",
         int(st.encode_ms)),
        ("sim:encoded_tokens_total", "Placeholder tokens of the items encoded (not found in the cache).",
         st.encoded_tokens),
        ("sim:encoder_cache_queries_total", "Distinct media items an encoder looked up in its own cache.",
         ec.queries if ec else 0),
        ("sim:encoder_cache_hits_total", "Distinct media items an encoder found in its own cache (not "
         "encoded again).", ec.hits if ec else 0),
        ("sim:kv_pulls_total", "Successful KV loads (decode).", st.kv_pulls),
        ("sim:kv_pull_failures_total", "Failed KV loads (decode).", st.kv_pull_failures),
        ("sim:kv_transfers_served_total", "KV hand-offs served to decoders (prefill).", st.kv_pushes),
        ("sim:kv_transfer_refusals_total", "Side-channel requests refused (prefill).", st.kv_push_failures),
        ("sim:kv_expired_blocks_total", "Held blocks freed by kv_abort_timeout (prefill).",
         st.kv_blocks_expired),
        ("sim:kv_kept_expired_blocks_total", "Blocks kept after a request (bidirectional) freed by their TTL "
         "(decode).", st.kv_kept_expired_blocks),
        ("sim:kv_reuse_reads_total", "Reads of kept blocks served to a prefill (decode).", st.kv_reuse_reads),
        ("sim:kv_reuse_read_tokens_total", "Tokens of those reads (decode).", st.kv_reuse_read_tokens),
        ("sim:kv_reuse_releases_total", "Kept blocks a prefill released without reading (decode).",
         st.kv_reuse_releases),
        ("sim:kv_reuse_unknown_total", "Reads of blocks no longer kept: used, expired or never kept "
         "(decode).", st.kv_reuse_unknown),
        ("sim:kv_reuse_failures_total", "Requests failed by a read from a decode: expiry, engine id "
         "(prefill).", st.kv_reuse_failures),
        ("sim:wrong_kv_reads_total", "Reads of another prompt's KV (parameters used twice or for another "
         "prompt): the answers that follow are wrong, as vLLM's (prefill).", st.wrong_answers),
        ("sim:aborted_requests_total", "Requests whose client went away before the end.", st.aborted),
        ("sim:faults_injected_total", "Requests that got an injected fault.", st.faults),
    ]
    for name, help_, value in counters:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} counter")
        lines.append(f"{name}{{{lbl}}} {value}.0")
    lines += [
        "# HELP sim:held_kv_blocks KV blocks held for decoders that have not claimed them (stranded KV).",
        "# TYPE sim:held_kv_blocks gauge",
        f"sim:held_kv_blocks{{{lbl}}} {held_blocks}.0",
        "# HELP sim:held_kv_requests Requests whose KV is held for a decoder.",
        "# TYPE sim:held_kv_requests gauge",
        f"sim:held_kv_requests{{{lbl}}} {inst.kv.held_requests}.0",
        "# HELP sim:kept_kv_blocks KV blocks a decode keeps after its requests for the next turn "
        "(bidirectional transfer); part of vllm:kv_cache_usage_perc.",
        "# TYPE sim:kept_kv_blocks gauge",
        f"sim:kept_kv_blocks{{{lbl}}} {kept_blocks}.0",
        "# HELP sim:kept_kv_requests Requests whose blocks a decode keeps for the next turn.",
        "# TYPE sim:kept_kv_requests gauge",
        f"sim:kept_kv_requests{{{lbl}}} {inst.kv_reuse.kept_requests}.0",
        "# HELP sim:prefix_cache_blocks KV blocks kept in the prefix cache.",
        "# TYPE sim:prefix_cache_blocks gauge",
        f"sim:prefix_cache_blocks{{{lbl}}} {len(pc) if pc else 0}.0",
    ]
    if cfg.lora_modules or cfg.allow_runtime_lora:  # vLLM's --enable-lora
        lines += inst.lora.metrics_lines(lbl, time.time())
    return "\n".join(lines) + "\n"
