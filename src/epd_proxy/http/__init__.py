"""The HTTP/1.1 layer the proxy runs on (server, client, timers)."""

Headers = list[tuple[bytes, bytes]]
"""Header fields as they go on the wire: (name, value) byte pairs, in order."""
