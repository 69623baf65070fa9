"""The multiturn scenario: multi-turn KV reuse between decode and prefill, and prefill skipped
for short remainders, on a simulated P/D cluster with vLLM 0.32's bidirectional transfer.

A cluster (3 prefills, 4 decodes by default, no encoders: the reference proxy and
vllm-router have no encoder stage) with ``bidirectional=1``: every decode keeps each
finished request's blocks and names them in its answer (in a stream too, as the last
chunk before ``[DONE]``: ``bidirectional_stream_params``, what the reference proxy reads);
decodes compute a local prefill in chunks of their engine steps, so it costs their other
streams inter-token latency. The prefills' prefix caches hold ``--mt-cache-ratio`` of the
workload's working set each, as in the cluster scenario.

Two workloads of conversations (shared system prompts, think times, Poisson arrivals, every
answer verified byte for byte): ``long`` (answers several times the user turn, reasoning-
like) and ``short`` (answers shorter than the user turn).

Targets, side by side on fresh clusters:

``cache-aware``       epd-proxy, cache-aware prefill, load-aware decode, ``--no-kv-reuse``
                      (today's routing; without that flag when the proxy has no reuse)
``reuse``             the same with multi-turn reuse (automatic), ``--local-prefill-max-tokens 0``
``reuse-skip``        reuse and prefill skipping (``--local-prefill-max-tokens`` and
                      ``--local-prefill-max-streams``: the proxy's defaults, or N)
``vllm-multiturn``    vLLM 0.33's ``disagg_proxy_multiturn.py`` (fetched from the vllm sdist on
                      the package index; sent ``conversation_id``)
``vllm-router:P``     vllm-router ``--policy P``

Reported per target: prompt tokens computed (on prefills, on decodes, together), tokens
read from decode, KV moved, TTFT p50/p99, ITL p99 as the client sees it and as the decodes'
steps set it (``/sim/state`` ``itl_model``: what the ITL target weighs, free of the client's
scheduling noise), blocks decodes keep (peak while running,
at the end), errors and mismatches (answers that differ from the simulator's, and prefills
that read another prompt's KV). The pure parts (counters, targets, the report) are in
``evaluate``; the processes and the driver in ``run``.
"""
