"""FULL_DUPLEX_STREAMED request bodies without Envoy: the order of the answers, the body handed
back, and decisions, errors and accounting identical to BUFFERED mode."""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import pytest

from extproc import messages
from extproc.service import ExtProcService, _Stream
from extproc.telemetry import RouterMetrics
from gorgo._xds.envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from gorgo._xds.envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import (
    ProcessingMode,
)
from gorgo._xds.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from gorgo.core.decision import Decision
from gorgo.core.fleet import parse_fleet
from gorgo.core.router import Router

CHAT = "/v1/chat/completions"


def _router(**extra: Any) -> Router:
    return Router(parse_fleet({
        "regions": {"near": {}},
        "replicas": [{"name": f"r{i}", "region": "near", "address": f"10.0.0.{i + 1}:8000",
                      "engine": "sglang"} for i in range(3)],
        "allow_policy_override": True,
        "endpoint_picker": True,
        "limits": {"max_body_bytes": 300_000},
        **extra,
    }))


def _headers(pairs: dict[str, str], end: bool = False) -> pb.HttpHeaders:
    return pb.HttpHeaders(end_of_stream=end, headers=HeaderMap(headers=[
        HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]))


def _request_headers(mode: int, path: str = CHAT, end: bool = False,
                     extra: dict[str, str] | None = None) -> pb.ProcessingRequest:
    hdrs = {":path": path, ":method": "GET" if end else "POST", "x-gorgo-policy": "round-robin",
            **(extra or {})}
    return pb.ProcessingRequest(
        request_headers=_headers(hdrs, end),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=mode))


def _body(content: str = "hello") -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode()


def _duplex(body: bytes, cuts: list[int], trailers: bool = False,
            extra: dict[str, str] | None = None) -> list[pb.ProcessingRequest]:
    """Envoy's full-duplex messages for ``body`` cut at ``cuts``; as Envoy 1.40 does for HTTP/1,
    the end of stream comes on an empty last chunk (or on the trailers)."""
    edges = [0, *cuts, len(body)]
    reqs = [_request_headers(ProcessingMode.FULL_DUPLEX_STREAMED, extra=extra)]
    reqs += [pb.ProcessingRequest(request_body=pb.HttpBody(body=body[a:b]))
             for a, b in itertools.pairwise(edges)]
    if trailers:
        reqs.append(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    else:
        reqs.append(pb.ProcessingRequest(request_body=pb.HttpBody(end_of_stream=True)))
    return reqs


def _buffered(body: bytes, extra: dict[str, str] | None = None) -> list[pb.ProcessingRequest]:
    return [_request_headers(ProcessingMode.BUFFERED, extra=extra),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))]


def _run(router: Router, reqs: list[pb.ProcessingRequest], *,
         fail: bool = False) -> tuple[list[pb.ProcessingResponse], ExtProcService]:
    service = ExtProcService(router, RouterMetrics(router.state, lambda: router.open_requests))
    if fail:
        def broken(*_: Any) -> None:
            raise RuntimeError("boom")
        router.route = broken  # type: ignore[method-assign]

    async def go() -> list[pb.ProcessingResponse]:
        async def it():
            for r in reqs:
                yield r
        return [a async for a in service.Process(it(), None)]

    return asyncio.run(go()), service


def _set(common: pb.CommonResponse) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def _sample(service: ExtProcService, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(s.value for m in service.metrics.registry.collect() for s in m.samples
               if s.name == name and labels.items() <= s.labels.items())


def _streamed(answers: list[pb.ProcessingResponse]) -> list[pb.StreamedBodyResponse]:
    return [a.request_body.response.body_mutation.streamed_response for a in answers
            if a.WhichOneof("response") == "request_body"]


def test_answers_wait_for_the_whole_body_then_route_and_hand_it_back() -> None:
    body = _body("x" * 1000)
    router = _router()
    reqs = [*_duplex(body, [10, 500]),
            pb.ProcessingRequest(response_headers=_headers({":status": "200"}))]
    answers, service = _run(router, reqs)
    kinds = [a.WhichOneof("response") for a in answers]
    assert kinds == ["request_headers", "request_body", "response_headers"]
    head = answers[0]
    routed = _set(head.request_headers.response)
    assert head.request_headers.response.clear_route_cache
    assert routed[messages.CLUSTER_HEADER] in router.state.clusters
    endpoint = routed[messages.PICKER_HEADER]
    md = head.dynamic_metadata.fields
    assert md[messages.PICKER_NAMESPACE].struct_value.fields[
        messages.PICKER_HEADER].string_value == endpoint
    assert md[messages.METADATA_NAMESPACE].struct_value.fields["replica"].string_value
    (piece,) = _streamed(answers)
    assert piece.body == body and piece.end_of_stream
    tagged = _set(answers[2].response_headers.response)
    assert tagged[messages.REPLICA_HEADER] == routed[messages.CLUSTER_HEADER]
    assert router.open_requests == 0  # released when the stream closed
    assert _sample(service, "gorgo_decision_seconds_count") == 1


def test_a_large_body_goes_back_whole_in_pieces() -> None:
    body = _body("y" * 200_000)
    answers, _ = _run(_router(), _duplex(body, [147_000]))
    pieces = _streamed(answers)
    assert len(pieces) == -(-len(body) // messages.STREAM_CHUNK_BYTES)
    assert all(len(p.body) <= messages.STREAM_CHUNK_BYTES for p in pieces)
    assert b"".join(p.body for p in pieces) == body
    assert [p.end_of_stream for p in pieces] == [False] * (len(pieces) - 1) + [True]


def test_trailers_end_the_body_and_are_answered_last() -> None:
    body = _body()
    answers, _ = _run(_router(), _duplex(body, [7], trailers=True))
    kinds = [a.WhichOneof("response") for a in answers]
    assert kinds == ["request_headers", "request_body", "request_trailers"]
    (piece,) = _streamed(answers)
    assert piece.body == body and not piece.end_of_stream  # the trailers end the stream


def test_a_request_ending_in_trailers_takes_no_retry_route() -> None:
    """Envoy sends such a body twice on its retry route (envoyproxy/envoy#45470): the router
    names no next-best replica for it, and still does for one that ends on its last chunk."""
    body = _body()
    for trailers, retried in ((True, False), (False, True)):
        router = _router(endpoint_picker=False, retries={"enabled": True})
        answers, _ = _run(router, _duplex(body, [7], trailers=trailers))
        routed = _set(answers[0].request_headers.response)
        assert (messages.ENDPOINTS_HEADER in routed) == retried
        assert routed[messages.CLUSTER_HEADER] in router.state.clusters


def test_a_body_less_request_is_routed_on_its_headers() -> None:
    router = _router()
    req = _request_headers(ProcessingMode.FULL_DUPLEX_STREAMED, "/v1/models", end=True)
    answers, _ = _run(router, [req])
    assert len(answers) == 1
    assert messages.CLUSTER_HEADER in _set(answers[0].request_headers.response)


def _error(answer: pb.ProcessingResponse) -> tuple[int, dict]:
    imm = answer.immediate_response
    return imm.status.code, json.loads(imm.body)["error"]


def test_a_body_over_the_limit_is_refused_as_soon_as_it_is_too_large() -> None:
    body = _body("z" * 400_000)
    reqs = _duplex(body, [100_000, 200_000, 310_000])
    answers, service = _run(_router(), reqs)
    assert len(answers) == 1  # nothing answers the chunks still in flight
    status, err = _error(answers[0])
    assert (status, err["code"]) == (413, "request_too_large")
    assert _sample(service, "gorgo_rejected_requests_total", status="413") == 1
    # A declared length over the limit is refused on the headers, as in BUFFERED mode.
    answers, _ = _run(_router(), _duplex(body, [], extra={"content-length": str(len(body))}))
    assert len(answers) == 1 and _error(answers[0])[0] == 413


@pytest.mark.parametrize("case", ["malformed", "too_large", "no_replica"])
def test_error_answers_match_buffered_mode(case: str) -> None:
    body = {"malformed": b'{"model": "m", "messages": [', "too_large": _body("w" * 310_000),
            "no_replica": _body()}[case]
    results = []
    for reqs in (_buffered(body), _duplex(body, [len(body) // 2])):
        router = _router()
        if case == "no_replica":
            router.state.healthy[:] = False
        answers, service = _run(router, reqs)
        answer = answers[-1]
        assert answer.WhichOneof("response") == "immediate_response"
        imm = answer.immediate_response
        rejected = {s: _sample(service, "gorgo_rejected_requests_total", status=s)
                    for s in ("400", "413", "503")}
        headers = {h.header.key: h.header.raw_value for h in imm.headers.set_headers}
        results.append((imm.status.code, imm.body, headers, imm.details, rejected,
                        router.open_requests))
    assert results[0] == results[1]
    assert results[0][0] == {"malformed": 400, "too_large": 413, "no_replica": 503}[case]


def test_decisions_and_metrics_match_buffered_mode() -> None:
    def fields(answer: pb.ProcessingResponse, common: pb.CommonResponse) -> tuple:
        gorgo = answer.dynamic_metadata.fields[messages.METADATA_NAMESPACE].struct_value.fields
        return (_set(common), {k: v for k, v in gorgo.items() if k != "decision_id"})

    body = _body("the same prompt " * 50)
    buffered, sb = _run(_router(), _buffered(body))
    duplex, sd = _run(_router(), _duplex(body, [100]))
    assert fields(buffered[1], buffered[1].request_body.response) == \
        fields(duplex[0], duplex[0].request_headers.response)
    for service in (sb, sd):
        assert _sample(service, "gorgo_decisions_total", policy="round-robin", replica="r0") == 1


def test_a_router_error_fails_open_and_still_hands_the_body_back() -> None:
    body = _body()
    answers, service = _run(_router(), _duplex(body, [5]), fail=True)
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body"]
    assert not answers[0].request_headers.HasField("response")  # no route: the default one
    assert _streamed(answers)[0].body == body
    assert _sample(service, "gorgo_fail_open_total") == 1


def test_buffered_mode_is_unchanged_without_protocol_config() -> None:
    body = _body()
    reqs = [pb.ProcessingRequest(request_headers=_headers({":path": CHAT, ":method": "POST"})),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))]
    answers, _ = _run(_router(), reqs)
    assert answers[0] == messages.CONTINUE_REQUEST_HEADERS
    assert messages.CLUSTER_HEADER in _set(answers[1].request_body.response)


def test_one_decision_per_request_whatever_the_body_chunks() -> None:
    # STREAMED or BUFFERED_PARTIAL (a hand-written Envoy config): each chunk a body message; a
    # second decision once overwrote the first, whose booking then never closed
    body = _body()
    reqs = [_request_headers(ProcessingMode.STREAMED),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body)),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))]
    router = _router()
    answers, service = _run(router, reqs)
    assert messages.CLUSTER_HEADER in _set(answers[1].request_body.response)
    assert answers[2] == messages.CONTINUE_REQUEST_BODY
    assert router.open_requests == 0 and _sample(service, "gorgo_decisions_total") == 1


def test_an_answer_that_cannot_be_built_fails_open_counted_and_releases_its_booking(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_: Any) -> None:
        raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")

    monkeypatch.setattr(messages, "route_on_body", broken)
    router = _router()
    booked: list[int] = []
    complete = router.complete

    def spy(decision_id: str) -> None:
        booked.append(router.open_requests)
        complete(decision_id)

    router.complete = spy  # type: ignore[method-assign]
    answers, service = _run(router, _buffered(_body()))
    assert answers[1] == messages.CONTINUE_REQUEST_BODY  # the default route, as Envoy fails open
    assert _sample(service, "gorgo_fail_open_total") == 1
    assert booked == [1] and router.open_requests == 0  # released once, by the failure


@pytest.mark.parametrize(("duplex", "stream", "status", "trailers", "decode_ms", "held_s"), [
    (True, True, "200", "skip", 1500.0, 1.5),  # the stream closed while the answer decodes
    (True, True, "200", "skip", 1e12, 600.0),  # within the request timeout
    (True, False, "200", "skip", 1500.0, 0.0),  # a whole answer: done at its headers
    (True, True, "503", "skip", 1500.0, 0.0),  # an error decodes nothing
    (True, True, "", "skip", 1500.0, 0.0),  # no response through the router
    (True, True, "200", "send", 1500.0, 0.0),  # the stream lasts the response
    (False, True, "200", "skip", 1500.0, 0.0),  # buffered: likewise
    (True, True, "200", "skip", float("nan"), 0.0),
])
def test_a_booking_outlives_a_stream_closed_before_its_answer_decoded(
        duplex: bool, stream: bool, status: str, trailers: str, decode_ms: float,
        held_s: float) -> None:
    router = _router(extproc={"response_trailers": trailers})
    service = ExtProcService(router, RouterMetrics(router.state, lambda: 0))
    st = _Stream()
    st.duplex, st.stream, st.status = duplex, stream, status
    st.decision = Decision(0, "gorgo", terms={"decode": decode_ms})
    assert service._held_past_close(st) == pytest.approx(held_s)


@pytest.mark.parametrize(("response_headers", "status", "held_s"), [
    # Envoy closes the stream right after the request: every request looked finished once
    # routed (0 in flight while three answers ran). Its first token and decoding then.
    ("skip", "", 2.0),
    ("send", "", 0.0),  # sent, yet none came: the request failed
])
def test_with_the_response_headers_skipped_a_booking_outlives_the_request(
        response_headers: str, status: str, held_s: float) -> None:
    router = _router(extproc={"response_headers": response_headers})
    service = ExtProcService(router, RouterMetrics(router.state, lambda: 0))
    for stream in (True, False):  # a whole answer decodes too, after the stream closed
        st = _Stream()
        st.duplex, st.stream, st.status = True, stream, status
        st.decision = Decision(0, "gorgo", predicted_ms=500.0, terms={"decode": 1500.0})
        assert service._held_past_close(st) == pytest.approx(held_s)
