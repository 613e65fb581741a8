"""OTLP/gRPC trace receiver: the standard TraceService/Export, so a Collector can fan spans out.

Envoy (directly, or an OpenTelemetry Collector in between) exports request spans here; each export
is parsed into samples (tuner/samples.py) and handed to a callback on the event loop. Spans that are
not gorgo decisions, or do not parse, are counted per reason and dropped: the receiver answers
every well-formed export with success, because a Collector retries failed exports and a foreign
span would then be retried forever. Optional bearer-token check on the ``authorization`` metadata
(constant-time) and optional TLS; the default bind address is loopback.
"""

from __future__ import annotations

import hmac
import logging
from collections import Counter
from collections.abc import Callable

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tuner.samples import Sample, parse_export

log = logging.getLogger("gorgo.tuner.receiver")
MAX_MESSAGE_BYTES = 32 * 1024 * 1024


class TraceReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, on_samples: Callable[[list[Sample]], None], token: str | None = None):
        self.on_samples = on_samples
        self._token = token.encode() if token else None
        self.counts: Counter[str] = Counter()
        self.port = 0
        self._server: grpc.aio.Server | None = None

    def _authorized(self, context: grpc.aio.ServicerContext) -> bool:
        if self._token is None:
            return True
        for key, value in context.invocation_metadata() or ():
            if key.lower() == "authorization":
                given = value.decode() if isinstance(value, bytes) else str(value)
                scheme, _, token = given.partition(" ")
                if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                                       self._token):
                    return True
        return False

    async def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest,
        context: grpc.aio.ServicerContext,
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        if not self._authorized(context):
            self.counts["unauthenticated"] += 1
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        samples, dropped = parse_export(request)
        self.counts["exports"] += 1
        self.counts["spans"] += len(samples) + sum(dropped.values())
        self.counts["samples"] += len(samples)
        self.counts.update(dropped)
        if samples:
            try:
                self.on_samples(samples)
            except Exception:  # a tuner bug must not turn into export retries
                self.counts["callback_errors"] += 1
                log.exception("sample callback failed")
        return trace_service_pb2.ExportTraceServiceResponse()

    async def start(
        self, host: str = "127.0.0.1", port: int = 4317,
        tls: tuple[bytes, bytes] | None = None,
    ) -> int:
        """Listen; ``tls`` is (certificate chain PEM, private key PEM). Returns the bound port."""
        self._server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),  # a port in use fails instead of being shared
        ])
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        address = f"{host}:{port}"
        if tls is None:
            self.port = self._server.add_insecure_port(address)
        else:
            cert, key = tls
            creds = grpc.ssl_server_credentials([(key, cert)])
            self.port = self._server.add_secure_port(address, creds)
        if not self.port:
            raise OSError(f"cannot listen on {address}")
        await self._server.start()
        return self.port

    async def stop(self, grace: float = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
