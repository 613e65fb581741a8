"""OTLP/gRPC receiver: the standard TraceService/Export, so a Collector can fan spans out, and
LogsService/Export on the same server for Envoy's TTFT access log (tuner/samples.py parse_record).

Envoy (directly, or an OpenTelemetry Collector in between) exports request spans here; each export
is parsed into samples (tuner/samples.py) and handed to a callback on the event loop. Spans that are
not gorgo decisions, or do not parse, are counted per reason and dropped: the receiver answers
every well-formed export with success, because a Collector retries failed exports and a foreign
span would then be retried forever. Bearer-token check on the ``authorization`` metadata
(constant-time; the tuner's config requires a token) and optional TLS; the default bind address is
loopback.

What one sender can cost is bounded: an export is parsed on the tuner's only event loop, so at most
``max_spans`` of its spans are parsed and at most ``spans_per_s`` per second over all exports (a
token bucket holding one export's worth); the spans beyond are rejected with OTLP's partial success,
which senders do not retry. An export of more containers than any sender's
(`tuner.samples.MAX_CONTAINERS`) is refused unread, and a span of too many attributes is dropped
unread (`tuner.samples.MAX_ATTRIBUTES`). Log records get the same limits in a bucket of their
own, and their counters carry the prefix ``log_``. Each export gets a number that its samples
carry (``Sample.source``), so that no single export can fill a window or a calibration fit on its
own.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from gorgo.core.fleet import host_port
from tuner.samples import Oversized, Sample, count_records, count_spans, parse_export

log = logging.getLogger("gorgo.tuner.receiver")
MAX_MESSAGE_BYTES = 8 * 1024 * 1024  # an Envoy span is ~1 KB: room for max_spans and more
REJECTED = "rejected"  # spans over the per-export or per-second limit, never parsed
# Authenticated exports refused unread (INVALID_ARGUMENT, which senders do not retry): not a
# message, or one holding more containers than any sender's (tuner.samples.Oversized)
UNPARSABLE, OVERSIZED = "unparsable", "oversized"
REFUSED_REASONS = (UNPARSABLE, OVERSIZED)
LOG_PREFIX = "log_"  # the TTFT log's counters: log_exports, log_records, log_samples, ...


@dataclass(frozen=True, slots=True)
class ExportLimits:
    max_ms: float  # the fleet's request timeout: no TTFT or E2E beyond it is a sample
    max_spans: int = 5000  # spans parsed per export (0.15 to 0.5 s of the event loop)
    spans_per_s: float = 2000.0  # spans parsed per second, over all exports

    def validate(self) -> None:
        if not (self.max_ms > 0 and self.max_spans >= 1 and self.spans_per_s > 0):
            raise ValueError("export limits: need max_ms > 0, max_spans >= 1, spans_per_s > 0")


class _Bucket:
    """Items parsed per second over all exports: a token bucket one export deep."""

    def __init__(self, limits: ExportLimits, now: float) -> None:
        self.limits = limits
        self.allowance = float(limits.max_spans)
        self.refilled_at = now

    def take(self, items: int, now: float) -> int:
        """How many of an export's ``items`` to parse now."""
        lim = self.limits
        self.allowance = min(float(lim.max_spans),
                             self.allowance + (now - self.refilled_at) * lim.spans_per_s)
        self.refilled_at = now
        take = min(items, int(self.allowance))
        self.allowance -= take
        return take


class _LogsServicer(logs_service_pb2_grpc.LogsServiceServicer):
    def __init__(self, receiver: TraceReceiver) -> None:
        self.receiver = receiver

    async def Export(
        self, request: logs_service_pb2.ExportLogsServiceRequest,
        context: grpc.aio.ServicerContext,
    ) -> logs_service_pb2.ExportLogsServiceResponse:
        return await self.receiver.export_logs(request, context)


async def _refuse(_requests: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")


# An export without the token is refused unread: a streaming handler never takes the message
# (a unary one buffers it whole first: 200 unauthenticated 7.9 MB exports at once took the
# tuner +1.9 GB, +0.2 GB this way), and no deserializer would parse it.
_REFUSED = grpc.stream_unary_rpc_method_handler(_refuse)
_UNPARSABLE = object()


class _TokenCheck(grpc.aio.ServerInterceptor):
    """The bearer token, checked before the export is parsed: checked in the handler, eight
    senders of 6 MB exports with a wrong token took the tuner from 71 MB to 4.9 GB (each parsed
    into protobuf objects first) and its exports' answers past Envoy's 1 s timeout."""

    def __init__(self, receiver: TraceReceiver) -> None:
        self.receiver = receiver

    async def intercept_service(self, continuation: Any,
                                details: grpc.HandlerCallDetails) -> Any:
        if not self.receiver.authorized(details.invocation_metadata):
            self.receiver.counts["unauthenticated"] += 1
            return _REFUSED
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        return self._lenient(handler)

    def _lenient(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """``handler`` with a message that does not parse answered INVALID_ARGUMENT (and
        counted), not an UNKNOWN with a traceback in the log."""
        parse, call = handler.request_deserializer, handler.unary_unary
        counts = self.receiver.counts

        def read(data: bytes) -> Any:
            try:
                return parse(data)
            except DecodeError:
                return _UNPARSABLE

        async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if request is _UNPARSABLE:
                counts[UNPARSABLE] += 1
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    "not an OTLP export message")
            return await call(request, context)

        return grpc.unary_unary_rpc_method_handler(
            checked, request_deserializer=read, response_serializer=handler.response_serializer)


class TraceReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, on_samples: Callable[[list[Sample]], None], token: str | None,
                 limits: ExportLimits, clock: Callable[[], float] = time.monotonic) -> None:
        limits.validate()
        self.on_samples = on_samples
        self._token = token.encode() if token else None
        self.limits = limits
        self._clock = clock
        self._spans = _Bucket(limits, clock())
        self._records = _Bucket(limits, clock())
        self._exports = 0  # numbers the exports: Sample.source
        self.counts: Counter[str] = Counter()
        self.port = 0
        self._server: grpc.aio.Server | None = None

    def authorized(self, metadata: Sequence[tuple[str, Any]] | None) -> bool:
        if self._token is None:
            return True
        for key, value in metadata or ():
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
        rejected = await self._export(request, count_spans, self._spans, context, "")
        if rejected:
            return trace_service_pb2.ExportTraceServiceResponse(
                partial_success=trace_service_pb2.ExportTracePartialSuccess(
                    rejected_spans=rejected, error_message=self._over_limit("spans")))
        return trace_service_pb2.ExportTraceServiceResponse()

    async def export_logs(
        self, request: logs_service_pb2.ExportLogsServiceRequest,
        context: grpc.aio.ServicerContext,
    ) -> logs_service_pb2.ExportLogsServiceResponse:
        """LogsService/Export: Envoy's TTFT log, under the same token and limits as spans (a
        bucket of its own, so open streams' periodic entries never crowd out the spans)."""
        rejected = await self._export(request, count_records, self._records, context,
                                      LOG_PREFIX)
        if rejected:
            return logs_service_pb2.ExportLogsServiceResponse(
                partial_success=logs_service_pb2.ExportLogsPartialSuccess(
                    rejected_log_records=rejected, error_message=self._over_limit("records")))
        return logs_service_pb2.ExportLogsServiceResponse()

    def _over_limit(self, what: str) -> str:
        return (f"over the limit of {self.limits.max_spans} {what} per export and "
                f"{self.limits.spans_per_s:g} per second")

    async def _export(self, request: Any, count: Callable[[Any], int], bucket: _Bucket,
                      context: grpc.aio.ServicerContext, prefix: str) -> int:
        """Parse what the limits allow of one export and hand its samples on; how many of its
        items (``count``) were rejected. Counters of the log input carry ``prefix``."""
        try:
            total = count(request)
        except Oversized as exc:
            self.counts[OVERSIZED] += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"export refused: {exc}")
        take = bucket.take(total, self._clock())
        self._exports += 1
        samples, dropped = parse_export(request, self.limits.max_ms, self._exports, take)
        c = self.counts
        c[prefix + "exports"] += 1
        c[prefix + ("records" if prefix else "spans")] += len(samples) + sum(dropped.values())
        c[prefix + REJECTED] += total - take
        c[prefix + "samples"] += len(samples)
        c.update({prefix + k: v for k, v in dropped.items()})
        if samples:
            try:
                self.on_samples(samples)
            except Exception:  # a tuner bug must not turn into export retries
                c["callback_errors"] += 1
                log.exception("sample callback failed")
        return total - take

    async def start(
        self, host: str = "127.0.0.1", port: int = 4317,
        tls: tuple[bytes, bytes] | None = None,
    ) -> int:
        """Listen; ``tls`` is (certificate chain PEM, private key PEM). Returns the bound port."""
        # No limit on calls at once: gRPC counts a call from its headers, before the token is
        # checked, so sixteen senders without it holding half-sent exports blocked every export.
        self._server = grpc.aio.server(
            interceptors=[_TokenCheck(self)],
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),  # a port in use fails instead of being shared
            ])
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(_LogsServicer(self), self._server)
        address = host_port(host, port)  # an IPv6 host in brackets: "::1:0" failed to bind
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
