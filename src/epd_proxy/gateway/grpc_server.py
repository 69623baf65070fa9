"""The endpoint picker's gRPC listener: the external processing service and gRPC health.

Health answers for three services, as the inference extension's protocol names them:
``liveness`` (the process runs its event loop), ``readiness`` and the external processing
service's own name (both: the proxy's ``/ready`` rule, the instances the pool needs are
known and it is not shutting down). Every replica is ready at once: replicas run
active-active, sharing limits and what they learned through the state store.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from epd_proxy.gateway.ext_proc import SERVICE, ExternalProcessor
from epd_proxy.gateway.picker import EndpointPicker

log = logging.getLogger("epd_proxy.epp")

LIVENESS = "liveness"
READINESS = "readiness"
# How often readiness is read again.
READY_INTERVAL = 1.0
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class GrpcListener:
    """The gRPC server on ``host:port``, started and stopped with the picker's process."""

    def __init__(self, picker: EndpointPicker, ready: Callable[[], bool]) -> None:
        self.picker = picker
        self.ready = ready
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self.port = 0
        self._watch: asyncio.Task | None = None

    async def start(self, host: str, port: int) -> None:
        # BUFFERED sends the whole body in one message, and a rewritten one goes back whole:
        # gRPC's 4 MiB default would fail any body past it (--max-body-size is the picker's bound).
        size = self.picker.max_body + (1 << 20) if self.picker.max_body < (1 << 31) - (1 << 20) else -1
        server = self.server = grpc.aio.server(options=[("grpc.max_receive_message_length", size),
                                                        ("grpc.max_send_message_length", size)])
        pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(self.picker), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self.port = server.add_insecure_port(address)
        except RuntimeError:  # grpc's word for a bind that failed
            self.port = 0
        if not self.port:
            self.server = None
            raise OSError(f"cannot listen on {address} for gRPC (another process listens there? "
                          f"choose another --grpc-port)")
        await server.start()
        await self.health.set(LIVENESS, _SERVING)
        await self._tell_readiness()
        self._watch = asyncio.get_running_loop().create_task(self._follow_readiness())

    async def _tell_readiness(self) -> None:
        status = _SERVING if self.ready() else _NOT_SERVING
        for service in (READINESS, SERVICE, ""):
            await self.health.set(service, status)

    async def _follow_readiness(self) -> None:
        while True:
            await asyncio.sleep(READY_INTERVAL)
            try:
                await self._tell_readiness()
            except Exception:  # pragma: no cover - never stop telling
                log.exception("gRPC readiness")

    async def shutting_down(self) -> None:
        """Not ready any more (the gateway stops sending); streams in flight go on."""
        self.ready = lambda: False
        await self._tell_readiness()

    async def close(self, grace: float = 0.0) -> None:
        """Stop listening; streams in flight get ``grace`` seconds to end (closed once)."""
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        server, self.server = self.server, None
        if server is not None:
            await self.health.enter_graceful_shutdown()
            await server.stop(grace)
