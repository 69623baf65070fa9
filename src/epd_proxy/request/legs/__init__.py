"""The legs of one attempt: encoders, prefill and decode, and how a KV connector joins them."""
