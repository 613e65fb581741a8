"""The OTLP/gRPC receiver: samples out, foreign/malformed spans counted, token and TLS enforced."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from tuner.receiver import TraceReceiver
from tuner.samples import Sample


def export_through(receiver: TraceReceiver, request, *, metadata=None, creds=None,
                   tls: tuple[bytes, bytes] | None = None) -> grpc.StatusCode:
    """Start the receiver, send one Export, stop it; returns the call's status code."""

    async def go() -> grpc.StatusCode:
        await receiver.start("127.0.0.1", 0, tls)
        target = f"127.0.0.1:{receiver.port}"
        channel = (grpc.aio.insecure_channel(target) if creds is None
                   else grpc.aio.secure_channel(target, creds))
        try:
            stub = trace_service_pb2_grpc.TraceServiceStub(channel)
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
    rx = TraceReceiver(got.extend)
    spans = [span(attrs(gorgo__decision_id=f"d{k}")) for k in range(4)]
    spans += [span({"component": "jaeger-query"}), span(attrs(gorgo__rtt_ms="?"))]
    assert export_through(rx, export(spans)) == grpc.StatusCode.OK
    assert [s.decision_id for s in got] == ["d0", "d1", "d2", "d3"]
    assert rx.counts["samples"] == 4 and rx.counts["spans"] == 6
    assert rx.counts["foreign"] == 1 and rx.counts["malformed"] == 1


def test_a_failing_callback_does_not_fail_the_export(span_builders) -> None:
    attrs, span, export = span_builders

    def boom(_: list[Sample]) -> None:
        raise RuntimeError("tuner bug")

    rx = TraceReceiver(boom)
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
    rx = TraceReceiver(got.extend, token="tok-123")
    assert export_through(rx, export([span(attrs())]), metadata=metadata) == code
    assert len(got) == (1 if code == grpc.StatusCode.OK else 0)
    assert rx.counts["unauthenticated"] == (0 if code == grpc.StatusCode.OK else 1)


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
    assert export_through(TraceReceiver(got.extend), export([span(attrs())]), creds=creds,
                          tls=tls) == grpc.StatusCode.OK
    assert len(got) == 1
    # A plaintext client cannot talk to the TLS port.
    assert export_through(TraceReceiver(got.extend), export([span(attrs())]),
                          tls=tls) == grpc.StatusCode.UNAVAILABLE
    assert len(got) == 1
