"""The endpoint picker of a Gateway API inference extension ``InferencePool`` (``epd-proxy epp``).

``pick.py`` (the one seam: the ordered endpoints for one request and why, over the proxy's
pool), ``picker.py`` (``EndpointPicker``, the shell: the key, its limits, admission, the body,
aliases, the model's instances, the block index; what the gateway reports back),
``ext_proc.py`` (Envoy's external processing protocol in both body modes: translation only),
``grpc_server.py`` (the gRPC listener and gRPC health), ``surface.py`` (the operator's HTTP
port). Its protobuf modules come with the ``gateway`` extra; nothing below ``runtime/`` imports
them, so ``serve`` runs without it.
"""
