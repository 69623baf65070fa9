"""The benchmark: the proxy next to vllm-router, nginx, vLLM's reference proxies and a direct
connection, on simulated or real instances (`epd-proxy bench`, docs/benchmarks.md)."""
