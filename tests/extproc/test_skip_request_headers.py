"""The request-headers message skipped (fleet extproc.request_headers: skip): the router reads the
headers from the body message's request attributes and publishes where it routes in the decision's
metadata, from which Envoy sets the routing headers. Without Envoy: the service on body-first
streams, and the rendered filters and routes."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from google.protobuf.struct_pb2 import Struct, Value

from extproc import messages
from extproc.service import ExtProcService
from extproc.telemetry import RouterMetrics
from gorgo._xds.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from gorgo.core.contract import (
    ATTRIBUTES_FILTER,
    CLUSTER_FIELD,
    CLUSTER_HEADER,
    ENDPOINTS_FIELD,
    ENDPOINTS_HEADER,
    METADATA_NAMESPACE,
    PICKER_HEADER,
    REQUEST_ATTRIBUTES,
    STREAM_HEADER,
)
from gorgo.core.fleet import FleetError, parse_fleet
from gorgo.core.router import Router
from gorgo.envoy_config import render_bootstrap
from gorgo.errors import UserError

SKIP = {"request_headers": "skip", "response_headers": "skip"}
DOC: dict[str, Any] = {
    "name": "skip",
    "regions": {"near": {}},
    "replicas": [{"name": f"r{i}", "region": "near", "address": f"10.0.0.{i + 1}:8000",
                  "engine": "sglang"} for i in range(3)],
    "allow_policy_override": True,
    "retries": {"enabled": False},
    "extproc": SKIP,
}
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello " * 200}]})


def _attributes(headers: dict[str, str]) -> dict[str, Struct]:
    """What Envoy sends: each configured expression with a value, keyed by the expression."""
    by_header = {h: expr for expr, h in REQUEST_ATTRIBUTES.items()}
    fields = {by_header[h]: Value(string_value=v) for h, v in headers.items()}
    return {ATTRIBUTES_FILTER: Struct(fields=fields)}


def _body_first(router: Router, headers: dict[str, str],
                body: bytes) -> list[pb.ProcessingResponse]:
    service = ExtProcService(router, RouterMetrics(router.state, lambda: router.open_requests))
    req = pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True),
                               attributes=_attributes(headers))

    async def go() -> list[pb.ProcessingResponse]:
        async def it():
            yield req
        return [a async for a in service.Process(it(), None)]

    return asyncio.run(go())


def _gorgo_metadata(answer: pb.ProcessingResponse) -> dict[str, Any]:
    md = answer.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value
    return {k: v.string_value or v.number_value for k, v in md.fields.items()}


@pytest.mark.parametrize(("policy", "session"), [("round-robin", None),
                                                 ("session-affinity", "user-7")])
def test_a_body_first_stream_routes_on_the_headers_its_attributes_carry(
        policy: str, session: str | None) -> None:
    router = Router(parse_fleet(DOC))
    headers = {":path": "/v1/chat/completions", "x-gorgo-policy": policy,
               **({"x-session-id": session} if session else {})}
    replicas = set()
    for _ in range(3):
        (answer,) = _body_first(router, headers, BODY.encode())
        md = _gorgo_metadata(answer)
        assert md["policy"] == policy  # the policy header arrived as an attribute
        replica = router.spec.replicas[router.state.index[md["replica"]]]
        assert md[CLUSTER_FIELD] == replica.cluster
        assert ENDPOINTS_FIELD not in md  # retries are off in DOC
        replicas.add(md["replica"])
    # Round robin moves on; the session's requests stay together.
    assert len(replicas) == (1 if session else 3)
    assert router.open_requests == 0  # each stream's end released its decision


def test_with_retries_the_metadata_names_both_endpoints() -> None:
    router = Router(parse_fleet({**DOC, "retries": {"enabled": True}}))
    (answer,) = _body_first(router, {":path": "/v1/chat/completions"}, BODY.encode())
    md = _gorgo_metadata(answer)
    first, second = md[ENDPOINTS_FIELD].split(",")
    chosen = router.spec.replicas[router.state.index[md["replica"]]]
    assert first == chosen.address and second != first


def test_a_body_first_models_request_gets_the_fleet_list_and_a_bad_body_a_400() -> None:
    doc = {**DOC, "replicas": [{**r, "models": ["alpha"]} for r in DOC["replicas"]]}
    router = Router(parse_fleet(doc))
    (answer,) = _body_first(router, {":path": "/v1/models"}, b"{}")
    assert answer.immediate_response.status.code == 200
    assert [m["id"] for m in json.loads(answer.immediate_response.body)["data"]] == ["alpha"]
    (answer,) = _body_first(router, {":path": "/v1/chat/completions"}, b"{not json")
    assert answer.immediate_response.status.code == 400
    assert json.loads(answer.immediate_response.body)["error"]["type"] == "invalid_request_error"


def test_attribute_headers_keep_only_what_the_router_reads() -> None:
    req = pb.ProcessingRequest(attributes={ATTRIBUTES_FILTER: Struct(fields={
        "request.path": Value(string_value="/v1/completions"),
        "request.headers['x-session-id']": Value(string_value="s1"),
        "request.headers['authorization']": Value(string_value="Bearer secret"),
        "request.headers['x-gorgo-priority']": Value(number_value=3),  # not a string: dropped
    })})
    assert messages.attribute_headers(req) == {":path": "/v1/completions", "x-session-id": "s1"}
    assert messages.attribute_headers(pb.ProcessingRequest()) == {}


def _filters(boot: dict) -> list[dict]:
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    return hcm["typed_config"]["http_filters"]


def _routes(boot: dict) -> list[dict]:
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    return hcm["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]


@pytest.mark.parametrize(("extra", "picker", "headers"), [
    ({}, False, [CLUSTER_HEADER, STREAM_HEADER]),
    ({"retries": {"enabled": True}}, False, [CLUSTER_HEADER, STREAM_HEADER, ENDPOINTS_HEADER]),
    ({}, True, [CLUSTER_HEADER, STREAM_HEADER, PICKER_HEADER]),
])
def test_the_render_holds_the_headers_until_the_body_is_answered(
        extra: dict, picker: bool, headers: list[str]) -> None:
    boot = render_bootstrap(parse_fleet({**DOC, **extra}), picker=picker)
    filters = _filters(boot)
    assert [f["name"] for f in filters] == [
        "envoy.filters.http.ext_proc", "envoy.filters.http.buffer",
        "envoy.filters.http.header_mutation", "envoy.filters.http.router"]
    ext = filters[0]["typed_config"]
    assert ext["processing_mode"]["request_header_mode"] == "SKIP"
    assert ext["processing_mode"]["request_body_mode"] == "BUFFERED"
    assert ext["request_attributes"] == list(REQUEST_ATTRIBUTES)
    mutations = filters[2]["typed_config"]["mutations"]["request_mutations"]
    assert [m["append"]["header"]["key"] for m in mutations] == headers
    assert all("%DYNAMIC_METADATA(" in m["append"]["header"]["value"] for m in mutations)
    # A request without a body (a GET) still sends its headers, on a route of its own.
    (get_route,) = [r for r in _routes(boot) if "processing_mode" in r.get(
        "typed_per_filter_config", {}).get("envoy.filters.http.ext_proc", {}).get("overrides", {})]
    (method,) = get_route["match"]["headers"]
    assert method["string_match"] == {"exact": "POST"} and method["invert_match"]
    override = get_route["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["overrides"]
    assert override["processing_mode"]["request_header_mode"] == "SEND"


def test_the_default_render_sends_the_request_headers() -> None:
    boot = render_bootstrap(parse_fleet({**DOC, "extproc": {}}))
    ext = _filters(boot)[0]["typed_config"]
    assert ext["processing_mode"]["request_header_mode"] == "SEND"
    assert "request_attributes" not in ext
    assert [f["name"] for f in _filters(boot)] == ["envoy.filters.http.ext_proc",
                                                   "envoy.filters.http.buffer",
                                                   "envoy.filters.http.router"]


def test_full_duplex_needs_the_request_headers_and_a_bad_mode_names_its_field() -> None:
    with pytest.raises(UserError, match="request_headers: send"):
        render_bootstrap(parse_fleet(DOC), body_mode="full-duplex")
    with pytest.raises(FleetError, match=r"extproc\.request_headers: must be one of send, skip"):
        parse_fleet({**DOC, "extproc": {"request_headers": "never"}})
