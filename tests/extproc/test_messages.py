"""The ext_proc answers the router builds from pieces it keeps (`extproc.messages`): each answer is
the message the plain nested constructors give, and no answer shares a piece with another."""

from __future__ import annotations

from google.protobuf.struct_pb2 import Struct

from extproc import messages
from gorgo._xds.envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from gorgo._xds.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from gorgo.core.contract import (
    CLUSTER_FIELD,
    CLUSTER_HEADER,
    DECISION_HEADER,
    ENDPOINTS_FIELD,
    ENDPOINTS_HEADER,
    METADATA_NAMESPACE,
    PICKER_HEADER,
    PICKER_NAMESPACE,
    REPLICA_HEADER,
    STREAM_HEADER,
)

FIELDS = {"decision_id": "d-1", "replica": "r0", "policy": "gorgo", "predicted_ttft_ms": 12.5,
          "prompt_tokens": 100, "stream": "true"}


def _set(key: str, value: str) -> HeaderValueOption:
    return HeaderValueOption(header=HeaderValue(key=key, raw_value=value.encode()),
                             append_action=HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def _expected(kind: str, endpoint: str | None) -> pb.ProcessingResponse:
    headers = [_set(CLUSTER_HEADER, "c0"), _set(STREAM_HEADER, "true")]
    if endpoint:
        headers.append(_set(PICKER_HEADER, endpoint))
    headers.append(_set(ENDPOINTS_HEADER, "a:1,b:2"))
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=headers),
                               clear_route_cache=True)
    md = Struct()
    md.update({METADATA_NAMESPACE: {**FIELDS, CLUSTER_FIELD: "c0", ENDPOINTS_FIELD: "a:1,b:2"}})
    if endpoint:
        md.update({PICKER_NAMESPACE: {PICKER_HEADER: endpoint}})
    answer = (pb.BodyResponse if kind == "request_body" else pb.HeadersResponse)(response=common)
    return pb.ProcessingResponse(**{kind: answer}, dynamic_metadata=md)


def test_routing_answers_are_what_the_nested_constructors_build() -> None:
    for endpoint in (None, "10.0.0.1:8000"):
        body = messages.route_on_body("c0", FIELDS, endpoint, ["a:1", "b:2"])
        assert body == _expected("request_body", endpoint)
        head = messages.route_on_headers("c0", FIELDS, endpoint, ["a:1", "b:2"])
        assert head == _expected("request_headers", endpoint)


def test_an_answer_changed_after_it_is_built_leaves_the_next_answers_as_they_were() -> None:
    first = messages.route_on_body("c0", FIELDS, None, ["a:1", "b:2"])
    first.request_body.response.header_mutation.set_headers[0].header.raw_value = b"other"
    first.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields.clear()
    assert messages.route_on_body("c0", FIELDS, None, ["a:1", "b:2"]) == _expected(
        "request_body", None)
    tag = messages.tag_response("r0", "d-1")
    tag.response_headers.response.header_mutation.set_headers[0].header.raw_value = b"other"
    again = messages.tag_response("r0", "d-2")
    assert again == pb.ProcessingResponse(response_headers=pb.HeadersResponse(
        response=pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=[
            _set(REPLICA_HEADER, "r0"), _set(DECISION_HEADER, "d-2")]))))
