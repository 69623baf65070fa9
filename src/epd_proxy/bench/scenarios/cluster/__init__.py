"""The cluster scenario: where the routing policy sends work, measured on a simulated cluster.

A cluster (2 encoders, 3 prefills, 4 decodes by default) whose prefill
instances keep a prefix cache smaller than the workload's working set
(``--cluster-cache-ratio`` of it, per instance; encoders likewise), and a
multi-turn chat workload (:mod:`epd_proxy.bench.conversations`) started as
Poisson arrivals of conversations at a few load levels. Each policy gets a
fresh cluster and a fresh proxy per (workload, load level) cell, so no policy
inherits another's warm caches; every answer is verified byte for byte, and
each turn's prompt carries the previous answer as received.

Policies (``--policies``; ``--policy-def NAME=ARGS`` adds proxy policies):

``round-robin``, ``least-loaded``,  epd-proxy with ``--routing NAME``
``load-aware``, ``power-of-two``
``cache-aware``                     epd-proxy with cache-aware prefill and encode, load-aware
                                    decode (the proxy's per-role defaults, spelled out)
``exact``                           the same, the instances publishing vLLM's KV events and the proxy
                                    subscribed (cache-aware then routes on the block index)
``NAME`` from ``--policy-def``      epd-proxy with the given ``serve`` flags
``oracle``                          no proxy: the load generator runs E→P→D itself and
                                    pins each conversation (by its index) to one
                                    encoder, prefill and decode: the hit rate to reach
``vllm-router:POLICY``              vllm-router ``--policy POLICY`` (text workloads only:
                                    it has no encoder stage)

Workloads (``--cluster-workloads``): ``chat`` (with images, E+P+D), ``text``
(the same conversations without images, P/D: the one vllm-router can run),
``unique`` (one turn per conversation, no shared system prompt: no two
prompts share a prefix, for the load spread).

``--cluster-kv-cases`` adds the KV events comparison (``kv_matrix``): approximate, exact,
vllm-router and oracle side by side with evictions, proxy replicas taking turns, a second client
population straight to the instances and a prefill restarted mid-run (``kv_cases``).

The pure parts are functions over plain data: the policy specs (``policies``), the
counters from the instances' ``/sim/state``, the merge of repeats and the targets
(``evaluate``), the KV comparison's cases, figures and targets (``kv_cases``, ``kv_evaluate``).
The I/O shell: the clients and the open-loop driver (``drive``), one cell (``cell``), the matrix
with the scenario's flags (``run``), the KV comparison (``kv_matrix``); ``section`` and
``kv_section`` are its report parts.
"""
