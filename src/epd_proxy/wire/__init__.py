"""What crosses the wire, below everything else: request bodies with large media kept as
views (``blobs``), the hot path's ids (``ids``) and the one error currency with its envelopes
(``errors``) and one field read out of a form (``multipart``). Imports nothing of the package."""
