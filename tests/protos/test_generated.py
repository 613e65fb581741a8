"""The generated ext_proc stubs in gorgo._xds: wire round trips and the gRPC service surface."""

from __future__ import annotations

import pickle
import sys
from collections.abc import Iterator
from concurrent import futures

import grpc
from google.protobuf import descriptor_pool, struct_pb2

from gorgo._xds.envoy.config.core.v3 import base_pb2
from gorgo._xds.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from gorgo._xds.envoy.service.ext_proc.v3.external_processor_pb2_grpc import (
    ExternalProcessorServicer,
    ExternalProcessorStub,
    add_ExternalProcessorServicer_to_server,
)

ROUTE_HEADER = "x-gorgo-replica"


def _headers_request() -> ep.ProcessingRequest:
    headers = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions"),
            base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"),
        ]
    )
    return ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(headers=headers, end_of_stream=False)
    )


def _body_request(body: bytes) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))


def _routing_response(replica: str) -> ep.ProcessingResponse:
    metadata = struct_pb2.Struct()
    metadata.update({"gorgo": {"replica": replica, "predicted_ttft_ms": 41.5}})
    mutation = ep.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=ROUTE_HEADER, raw_value=replica.encode()),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
        ]
    )
    return ep.ProcessingResponse(
        request_body=ep.BodyResponse(
            response=ep.CommonResponse(header_mutation=mutation, clear_route_cache=True)
        ),
        dynamic_metadata=metadata,
    )


def test_request_headers_round_trip() -> None:
    parsed = ep.ProcessingRequest.FromString(_headers_request().SerializeToString())
    assert parsed.WhichOneof("request") == "request_headers"
    pairs = [(h.key, h.raw_value) for h in parsed.request_headers.headers.headers]
    assert pairs == [(":path", b"/v1/chat/completions"), ("content-type", b"application/json")]
    assert not parsed.request_headers.end_of_stream


def test_request_body_round_trip() -> None:
    body = b'{"messages": [{"role": "user", "content": "' + b"x" * 4096 + b'"}]}'
    parsed = ep.ProcessingRequest.FromString(_body_request(body).SerializeToString())
    assert parsed.WhichOneof("request") == "request_body"
    assert parsed.request_body.body == body
    assert parsed.request_body.end_of_stream


def test_request_oneof_keeps_only_last_phase() -> None:
    request = _headers_request()
    request.request_body.body = b"{}"
    assert request.WhichOneof("request") == "request_body"
    assert not request.HasField("request_headers")


def test_response_mutation_route_cache_and_metadata_round_trip() -> None:
    parsed = ep.ProcessingResponse.FromString(_routing_response("eu-1/r3").SerializeToString())
    assert parsed.WhichOneof("response") == "request_body"
    common = parsed.request_body.response
    assert common.clear_route_cache
    (option,) = common.header_mutation.set_headers
    assert option.header.key == ROUTE_HEADER
    assert option.header.raw_value == b"eu-1/r3"
    assert option.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    assert isinstance(parsed.dynamic_metadata, struct_pb2.Struct)
    gorgo = parsed.dynamic_metadata["gorgo"]
    assert gorgo["replica"] == "eu-1/r3"
    assert gorgo["predicted_ttft_ms"] == 41.5


def test_messages_live_in_the_private_package() -> None:
    module = "gorgo._xds.envoy.service.ext_proc.v3.external_processor_pb2"
    assert ep.ProcessingRequest.__module__ == module
    assert pickle.loads(pickle.dumps(_routing_response("r1"))) == _routing_response("r1")
    leaked = {name for name in sys.modules if name.split(".")[0] in {"xds", "udpa", "validate"}}
    assert not leaked
    assert not any(name.startswith("envoy.service") for name in sys.modules)


def test_coexists_with_opentelemetry_proto() -> None:
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    pool = descriptor_pool.Default()
    assert pool.FindMessageTypeByName("envoy.service.ext_proc.v3.ProcessingRequest") is (
        ep.ProcessingRequest.DESCRIPTOR
    )
    assert trace_service_pb2.ExportTraceServiceRequest().SerializeToString() == b""


class _Router(ExternalProcessorServicer):
    """Answers every body with a routing decision, like the real server's last phase."""

    def Process(
        self, request_iterator: Iterator[ep.ProcessingRequest], context: grpc.ServicerContext
    ) -> Iterator[ep.ProcessingResponse]:
        for request in request_iterator:
            yield _routing_response(f"replica-{len(request.request_body.body)}")


def test_servicer_serves_the_bidi_stream() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    add_ExternalProcessorServicer_to_server(_Router(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = ExternalProcessorStub(channel)
            bodies = [_body_request(b"a" * 3), _body_request(b"b" * 7)]
            replies = list(stub.Process(iter(bodies), timeout=10))
    finally:
        server.stop(grace=None)
    replicas = [
        r.request_body.response.header_mutation.set_headers[0].header.raw_value for r in replies
    ]
    assert replicas == [b"replica-3", b"replica-7"]
