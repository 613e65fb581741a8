"""The OTLP/gRPC receiver: samples out, foreign/malformed spans counted, token and TLS enforced,
what one export may cost bounded."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2_grpc
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from gorgo.core.fleet import host_port
from tests.tuner.conftest import ipv6_loopback, make_log_export, make_record
from tuner.receiver import OVERSIZED, REJECTED, ExportLimits, TraceReceiver
from tuner.samples import MAX_CONTAINERS, Sample

LIMITS = ExportLimits(max_ms=600_000.0)


def export_through(receiver: TraceReceiver, request, *, metadata=None, creds=None,
                   tls: tuple[bytes, bytes] | None = None,
                   host: str = "127.0.0.1") -> grpc.StatusCode:
    """Start the receiver, send one Export (of spans or of log records), stop it; returns the
    call's status code."""

    async def go() -> grpc.StatusCode:
        await receiver.start(host, 0, tls)
        target = host_port(host, receiver.port)
        channel = (grpc.aio.insecure_channel(target) if creds is None
                   else grpc.aio.secure_channel(target, creds))
        try:
            stub: Any = (logs_service_pb2_grpc.LogsServiceStub(channel)
                         if isinstance(request, ExportLogsServiceRequest)
                         else trace_service_pb2_grpc.TraceServiceStub(channel))
            await stub.Export(request, metadata=metadata, timeout=5)
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        finally:
            await channel.close()
            await receiver.stop()

    return asyncio.run(go())


def test_samples_reach_the_callback_and_drops_are_counted(span_builders) -> None:
    attrs, span, export = span_builders
    got: list[Sample] = []
    rx = TraceReceiver(got.extend, None, LIMITS)
    spans = [span(attrs(gorgo__decision_id=f"d{k}")) for k in range(4)]
    spans += [span({"component": "jaeger-query"}), span(attrs(gorgo__rtt_ms="?"))]
    assert export_through(rx, export(spans)) == grpc.StatusCode.OK
    assert [s.decision_id for s in got] == ["d0", "d1", "d2", "d3"]
    assert rx.counts["samples"] == 4 and rx.counts["spans"] == 6
    assert rx.counts["foreign"] == 1 and rx.counts["malformed"] == 1


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback")
def test_an_ipv6_host_is_bound(span_builders) -> None:
    """`listen: "[::1]:0"` failed "Failed to bind to address ::1:0": gRPC wants brackets."""
    attrs, span, export = span_builders
    got: list[Sample] = []
    rx = TraceReceiver(got.extend, None, LIMITS)
    assert export_through(rx, export([span(attrs())]), host="::1") == grpc.StatusCode.OK
    assert len(got) == 1


def test_an_export_of_more_containers_than_any_senders_is_refused_unread(span_builders) -> None:
    """4M empty resources in one 8 MB export held the tuner's event loop 2.2 s while their spans
    were counted, and Envoy's exports meanwhile missed their 1 s deadline. Now refused before
    the walk with INVALID_ARGUMENT, which senders do not retry, and counted."""
    attrs, span, export = span_builders
    got: list[Sample] = []
    rx = TraceReceiver(got.extend, None, LIMITS)
    spans = export([span(attrs())])
    logs = make_log_export([make_record(attrs())])
    for _ in range(MAX_CONTAINERS):
        spans.resource_spans.add()
        logs.resource_logs.add()
    assert export_through(rx, spans) == grpc.StatusCode.INVALID_ARGUMENT
    assert export_through(rx, logs) == grpc.StatusCode.INVALID_ARGUMENT
    assert got == [] and rx.counts[OVERSIZED] == 2
    assert "exports" not in rx.counts and "log_exports" not in rx.counts


def test_a_failing_callback_does_not_fail_the_export(span_builders) -> None:
    attrs, span, export = span_builders

    def boom(_: list[Sample]) -> None:
        raise RuntimeError("tuner bug")

    rx = TraceReceiver(boom, None, LIMITS)
    assert export_through(rx, export([span(attrs())])) == grpc.StatusCode.OK
    assert rx.counts["callback_errors"] == 1


@pytest.mark.parametrize(("metadata", "code"), [
    (None, grpc.StatusCode.UNAUTHENTICATED),
    ((("authorization", "Bearer nope"),), grpc.StatusCode.UNAUTHENTICATED),
    ((("authorization", "tok-123"),), grpc.StatusCode.UNAUTHENTICATED),
    ((("authorization", "Bearer tok-123"),), grpc.StatusCode.OK),
    ((("authorization", "bearer tok-123"),), grpc.StatusCode.OK),
])
def test_token_is_required_when_configured(span_builders, metadata, code) -> None:
    attrs, span, export = span_builders
    got: list[Sample] = []
    rx = TraceReceiver(got.extend, "tok-123", LIMITS)
    assert export_through(rx, export([span(attrs())]), metadata=metadata) == code
    assert len(got) == (1 if code == grpc.StatusCode.OK else 0)
    assert rx.counts["unauthenticated"] == (0 if code == grpc.StatusCode.OK else 1)


@pytest.mark.parametrize(("metadata", "code"), [
    ((("authorization", "Bearer nope"),), grpc.StatusCode.UNAUTHENTICATED),
    ((("authorization", "Bearer tok-123"),), grpc.StatusCode.INVALID_ARGUMENT),  # parsed
])
def test_an_export_without_the_token_is_refused_before_it_is_parsed(metadata, code) -> None:
    """Bytes that are no protobuf message: refused for the token (never parsed; parsing first
    let unauthenticated senders take the tuner to gigabytes), a parse error with it."""
    rx = TraceReceiver(lambda _: None, "tok-123", LIMITS)

    async def go() -> grpc.StatusCode:
        await rx.start("127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{rx.port}") as channel:
                call = channel.unary_unary(
                    "/opentelemetry.proto.collector.trace.v1.TraceService/Export")
                await call(b"\xff\xff\xff\xff", metadata=metadata, timeout=5)
                return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        finally:
            await rx.stop()

    assert asyncio.run(go()) == code
    assert rx.counts["unparsable"] == (code == grpc.StatusCode.INVALID_ARGUMENT)


def test_an_export_without_the_token_is_refused_unread() -> None:
    """A sender without the token that never finishes its message is refused at once: the
    refusal was a unary handler, which waits for and buffers the whole message first (200
    such 7.9 MB exports at once: the tuner +1.9 GB)."""
    rx = TraceReceiver(lambda _: None, "tok-123", LIMITS)

    async def go() -> grpc.StatusCode:
        await rx.start("127.0.0.1", 0)
        never = asyncio.Event()

        async def half_sent() -> Any:
            await never.wait()  # the message never comes
            yield b""
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{rx.port}") as channel:
                call = channel.stream_unary(
                    "/opentelemetry.proto.collector.trace.v1.TraceService/Export")
                await call(half_sent(), metadata=(("authorization", "Bearer nope"),),
                           timeout=30)
                return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        finally:
            await rx.stop()

    assert asyncio.run(go()) == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_tls(tmp_path: Path, span_builders) -> None:
    attrs, span, export = span_builders
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
         "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True)
    got: list[Sample] = []
    tls = (cert.read_bytes(), key.read_bytes())
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    assert export_through(TraceReceiver(got.extend, None, LIMITS), export([span(attrs())]),
                          creds=creds, tls=tls) == grpc.StatusCode.OK
    assert len(got) == 1
    # A plaintext client cannot talk to the TLS port.
    assert export_through(TraceReceiver(got.extend, None, LIMITS), export([span(attrs())]),
                          tls=tls) == grpc.StatusCode.UNAVAILABLE
    assert len(got) == 1


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_spans_beyond_the_export_and_rate_limits_are_rejected_not_parsed(span_builders) -> None:
    """One huge export once blocked the tuner for 9.4 s (issue 12, finding 10): now at most
    max_spans of an export are parsed, and at most spans_per_s over time; the rest get OTLP's
    partial success, which a sender does not retry."""
    attrs, span, export = span_builders
    got: list[Sample] = []
    clock = Clock()
    rx = TraceReceiver(got.extend, None, ExportLimits(600_000.0, max_spans=10, spans_per_s=5.0),
                       clock)

    def send(n: int):
        req = export([span(attrs(gorgo__decision_id=f"d{k}")) for k in range(n)])
        return asyncio.run(rx.Export(req, None))

    r = send(25)
    assert len(got) == 10 and r.partial_success.rejected_spans == 15
    assert "10 spans per export" in r.partial_success.error_message
    assert send(3).partial_success.rejected_spans == 3  # the bucket is empty
    clock.now = 1.0  # 5 spans' worth refilled
    r = send(8)
    assert len(got) == 15 and r.partial_success.rejected_spans == 3
    clock.now = 100.0  # refilled to one export's worth, no more
    assert not send(10).HasField("partial_success") and len(got) == 25
    assert rx.counts[REJECTED] == 21 and rx.counts["samples"] == 25


def test_every_export_is_a_source_of_its_own(span_builders) -> None:
    attrs, span, export = span_builders
    got: list[Sample] = []
    rx = TraceReceiver(got.extend, None, LIMITS)
    for _ in range(3):
        asyncio.run(rx.Export(export([span(attrs()), span(attrs())]), None))
    assert [s.source for s in got] == [1, 1, 2, 2, 3, 3]
