"""One request, from body to last byte: ingress and admission, the pipeline with its
attempts and commit point, the three stages (encode fan-out, prefill, decode) over the KV
connectors, the single upstream failure path, the relay and the usage rewrite."""
