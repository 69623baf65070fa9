"""Observability: the Prometheus metrics (paid at scrape time), the access log and the
optional OpenTelemetry traces. Below the request path, which records into them."""
