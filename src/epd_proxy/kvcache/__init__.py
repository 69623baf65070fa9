"""Which instance holds which KV blocks, as the instances themselves say: vLLM's KV cache
events (``--kv-events-config``) read over ZMQ into one block index per proxy process.

``index.py`` (pure: the blocks keyed on their tokens, per instance; the longest prefix
each instance holds; speculative entries after a routing decision), ``events.py`` (pure:
vLLM's event messages decoded), ``sequence.py`` (pure: an event stream's sequence
numbers: in order, a gap to replay, a duplicate, an engine restart), ``streams.py``
(pure: where an instance publishes its events), ``feed.py`` (the shell: one subscriber
per instance, following the roster; ``/metrics`` and ``/status``).
"""
