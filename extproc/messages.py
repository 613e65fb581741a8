"""Builders for the few ext_proc answers the router sends, so the servicer reads as flow."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

from google.protobuf.struct_pb2 import Struct

from gorgo._xds.envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from gorgo._xds.envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import (
    ProcessingMode,
)
from gorgo._xds.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from gorgo._xds.envoy.type.v3.http_status_pb2 import HttpStatus
from gorgo.core.contract import (
    ATTRIBUTES_FILTER,
    CLUSTER_FIELD,
    CLUSTER_HEADER,
    DECISION_HEADER,
    ENDPOINTS_FIELD,
    ENDPOINTS_HEADER,
    METADATA_NAMESPACE,
    PICKER_HEADER,
    PICKER_NAMESPACE,
    REPLICA_HEADER,
    REQUEST_ATTRIBUTES,
    STREAM_FIELD,
    STREAM_HEADER,
)

CONTINUE_REQUEST_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
CONTINUE_RESPONSE_HEADERS = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
CONTINUE_REQUEST_BODY = pb.ProcessingResponse(request_body=pb.BodyResponse())
CONTINUE_REQUEST_TRAILERS = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
# The request body mode Envoy reports in ProcessingRequest.protocol_config (1.34+) when it streams
# the body to the router without waiting for the headers answer (the endpoint-picker protocol).
FULL_DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED
# In that mode the body is handed back to Envoy in pieces of at most this size.
STREAM_CHUNK_BYTES = 64 * 1024


def _set(key: str, value: str) -> HeaderValueOption:
    return HeaderValueOption(
        header=HeaderValue(key=key, raw_value=value.encode()),
        append_action=HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _route_common(
    cluster: str, endpoint: str | None, endpoints: Sequence[str] | None, stream: str | None
) -> pb.CommonResponse:
    return _routing(cluster, endpoint, tuple(endpoints) if endpoints else None, stream)


@functools.lru_cache(maxsize=4096)
def _routing(
    cluster: str, endpoint: str | None, endpoints: tuple[str, ...] | None, stream: str | None
) -> pb.CommonResponse:
    """The routing headers, built once per destination and stream mode: a fleet has few, and the
    answers copy them (never change them)."""
    headers = [_set(CLUSTER_HEADER, cluster)]
    if stream is not None:
        headers.append(_set(STREAM_HEADER, stream))
    if endpoint is not None:
        headers.append(_set(PICKER_HEADER, endpoint))
    if endpoints:
        headers.append(_set(ENDPOINTS_HEADER, ",".join(endpoints)))
    return pb.CommonResponse(
        header_mutation=pb.HeaderMutation(set_headers=headers), clear_route_cache=True
    )


def _fill(out: Struct, fields: dict[str, Any]) -> None:
    # Set in place, field by field: 3x faster than building a Value per field (7 against 21 us
    # for a decision's 21 fields), and Struct.update goes through slow pure-Python helpers.
    values = out.fields
    for k, v in fields.items():
        if isinstance(v, str):
            values[k].string_value = v
        else:
            values[k].number_value = v


def _fill_metadata(out: Struct, fields: dict[str, Any], endpoint: str | None, cluster: str,
                   endpoints: Sequence[str] | None) -> None:
    """The decision's fields, plus where it routes: with the request headers skipped, Envoy sets
    the routing headers from these once the body is answered. Filled in the answer's own Struct:
    a Struct built apart and passed to the answer was copied whole (7 of the 19 us an answer
    took)."""
    decision = out.fields[METADATA_NAMESPACE].struct_value
    _fill(decision, fields)
    _fill(decision, {CLUSTER_FIELD: cluster,
                     **({ENDPOINTS_FIELD: ",".join(endpoints)} if endpoints else {})})
    if endpoint is not None:
        _fill(out.fields[PICKER_NAMESPACE].struct_value, {PICKER_HEADER: endpoint})


def _route(
    message: str, cluster: str, fields: dict[str, Any], endpoint: str | None,
    endpoints: Sequence[str] | None,
) -> pb.ProcessingResponse:
    """The routing answer to the ``message`` kind (request_headers or request_body)."""
    out = pb.ProcessingResponse()
    getattr(out, message).response.CopyFrom(
        _route_common(cluster, endpoint, endpoints, fields.get(STREAM_FIELD)))
    _fill_metadata(out.dynamic_metadata, fields, endpoint, cluster, endpoints)
    return out


def route_on_body(
    cluster: str, fields: dict[str, Any], endpoint: str | None = None,
    endpoints: Sequence[str] | None = None,
) -> pb.ProcessingResponse:
    """Answer the request body: send it to ``cluster`` (and, in endpoint-picker mode, name the
    endpoint too; with retries, the ordered ``endpoints`` the attempts go to; an inference
    request's stream mode picks its route's idle timeout) and publish the decision as metadata."""
    return _route("request_body", cluster, fields, endpoint, endpoints)


def route_on_headers(
    cluster: str, fields: dict[str, Any], endpoint: str | None = None,
    endpoints: Sequence[str] | None = None,
) -> pb.ProcessingResponse:
    """Answer the headers of a body-less request (GET /v1/models, /health)."""
    return _route("request_headers", cluster, fields, endpoint, endpoints)


def stream_body(body: bytes, end_of_stream: bool) -> list[pb.ProcessingResponse]:
    """Hand the request body back in FULL_DUPLEX_STREAMED mode: Envoy drained it on the way to the
    router, so the upstream gets exactly what these answers carry. ``end_of_stream`` marks the last
    piece, unless trailers end the request instead."""
    pieces = [body[i:i + STREAM_CHUNK_BYTES] for i in range(0, len(body), STREAM_CHUNK_BYTES)]
    pieces = pieces or [b""]
    return [
        pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
            body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                body=piece, end_of_stream=end_of_stream and k == len(pieces) - 1)))))
        for k, piece in enumerate(pieces)
    ]


@functools.lru_cache(maxsize=4096)
def _replica_tag(replica: str) -> HeaderValueOption:
    """The replica header of a response, built once per replica (the answers copy it)."""
    return _set(REPLICA_HEADER, replica)


def tag_response(replica: str, decision_id: str) -> pb.ProcessingResponse:
    """Answer the response headers, telling the client which replica served it and why (built
    in place: each message passed to a parent's constructor is copied, 7.8 against 4.2 us)."""
    out = pb.ProcessingResponse()
    headers = out.response_headers.response.header_mutation.set_headers
    headers.append(_replica_tag(replica))
    headers.append(_set(DECISION_HEADER, decision_id))
    return out


def immediate(
    status: int, body: dict[str, Any], details: str, headers: dict[str, str] | None = None
) -> pb.ProcessingResponse:
    """Answer the client directly (errors): JSON body, status, extra headers."""
    hdrs = {"content-type": "application/json", **(headers or {})}
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=HttpStatus(code=status),
            headers=pb.HeaderMutation(set_headers=[_set(k, v) for k, v in hdrs.items()]),
            body=json.dumps(body).encode(),
            details=details,
        )
    )


def header_dict(headers: pb.HttpHeaders) -> dict[str, str]:
    """Envoy's header map as a lower-case dict (Envoy sends values in raw_value)."""
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


def attribute_headers(req: pb.ProcessingRequest) -> dict[str, str]:
    """The request headers the router reads, from the request attributes Envoy sends with the
    body when the headers message is skipped (an absent header is no attribute)."""
    attrs = req.attributes.get(ATTRIBUTES_FILTER)
    if attrs is None:
        return {}
    return {REQUEST_ATTRIBUTES[k]: v.string_value for k, v in attrs.fields.items()
            if k in REQUEST_ATTRIBUTES and v.HasField("string_value")}
