"""Retries without Envoy: the fleet option, the next-best choice and the ext_proc answers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import numpy as np
import pytest

from extproc import messages
from extproc.service import ExtProcService
from extproc.telemetry import RouterMetrics
from gorgo._xds.envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from gorgo._xds.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from gorgo.core.decision import Decision, next_best
from gorgo.core.fleet import FleetError, Retries, parse_fleet
from gorgo.core.router import Router


def _doc(hosts: list[str], **extra) -> dict:
    return {
        "regions": {"near": {}},
        "replicas": [{"name": f"r{i}", "region": "near", "address": f"{h}:{8000 + i}",
                      "engine": "sglang"} for i, h in enumerate(hosts)],
        "allow_policy_override": True,
        **extra,
    }


def test_retries_default_on_for_ip_fleets_and_off_for_dns_names() -> None:
    assert parse_fleet(_doc(["10.0.0.1", "10.0.0.2"])).retries == Retries()
    assert parse_fleet(_doc(["10.0.0.1", "engine.internal"])).retries.enabled is False
    spec = parse_fleet(_doc(["10.0.0.1"], retries={"budget_percent": 5,
                                                  "min_retry_concurrency": 1}))
    assert spec.retries == Retries(enabled=True, budget_percent=5.0, min_retry_concurrency=1)


@pytest.mark.parametrize(("retries", "hosts", "field"), [
    ({"enabled": True}, ["10.0.0.1", "engine.internal"], "fleet.retries.enabled"),
    ({"enabled": "yes"}, ["10.0.0.1"], "fleet.retries.enabled"),
    ({"budget_percent": 0}, ["10.0.0.1"], "fleet.retries.budget_percent"),
    ({"budget_percent": 150}, ["10.0.0.1"], "fleet.retries.budget_percent"),
    ({"min_retry_concurrency": 1.5}, ["10.0.0.1"], "fleet.retries.min_retry_concurrency"),
    ({"budget": 20}, ["10.0.0.1"], "fleet.retries.budget"),
])
def test_retries_errors_name_the_field(retries: dict, hosts: list[str], field: str) -> None:
    with pytest.raises(FleetError, match=rf"^{field}:"):
        parse_fleet(_doc(hosts, retries=retries))


def test_next_best_is_the_lowest_other_routable_score() -> None:
    scores = np.array([3.0, 1.0, np.inf, 2.0])
    assert next_best(Decision(replica=1, policy="p", scores=scores)) == 3
    # A tie broken towards a replica that is not the argmin still falls back to the other.
    assert next_best(Decision(replica=3, policy="p", scores=np.array([2.0, np.inf, 9, 2.0]))) == 0
    assert next_best(Decision(replica=0, policy="p", scores=np.array([1.0, np.inf]))) is None
    assert next_best(Decision(replica=0, policy="p")) is None


def test_next_best_falls_back_to_a_routable_replica_the_policy_scored_infinite() -> None:
    # Policies score a replica they do not prefer infinite; a retry there beats none.
    scores = np.array([np.inf, 10.0, np.inf, np.inf])
    routable = np.array([True, True, False, True])
    picks = {next_best(Decision(replica=1, policy="p", id=f"d-{k}", scores=scores,
                                routable=routable)) for k in range(40)}
    assert picks == {0, 3}  # spread over them, never the chosen or an unroutable one
    alone = np.array([False, True, False, False])
    assert next_best(Decision(replica=1, policy="p", scores=scores, routable=alone)) is None


def _headers(pairs: dict[str, str], end: bool = False) -> pb.HttpHeaders:
    return pb.HttpHeaders(end_of_stream=end, headers=HeaderMap(headers=[
        HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]))


def _exchange(spec_doc: dict, response: dict[str, str],
              between: Callable[[Router, ExtProcService], None] | None = None,
              ) -> tuple[list, Router]:
    """One request through the servicer (round robin), then ``response`` as its headers
    (``between`` runs before they come)."""
    router = Router(parse_fleet(spec_doc))
    service = ExtProcService(router, RouterMetrics(router.state, lambda: 0))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    reqs = [
        pb.ProcessingRequest(request_headers=_headers({
            ":path": "/v1/chat/completions", ":method": "POST",
            "x-gorgo-policy": "round-robin"})),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=json.dumps(body).encode(),
                                                      end_of_stream=True)),
        pb.ProcessingRequest(response_headers=_headers(response)),
    ]

    async def run() -> list:
        async def it():
            for k, r in enumerate(reqs):
                if k == 2 and between is not None:
                    between(router, service)
                yield r
        return [a async for a in service.Process(it(), None)]

    return asyncio.run(run()), router


def _set_headers(common: pb.CommonResponse) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode()
            for h in common.header_mutation.set_headers}


def test_answer_names_chosen_then_next_best_and_attributes_the_retry() -> None:
    doc = _doc(["10.0.0.1", "10.0.0.2", "10.0.0.3"])
    answers, router = _exchange(doc, {":status": "200", "x-envoy-attempt-count": "2"})
    routed = _set_headers(answers[1].request_body.response)
    chosen, fallback = routed[messages.ENDPOINTS_HEADER].split(",")
    names = {r.address: r.name for r in router.spec.replicas}
    assert routed[messages.CLUSTER_HEADER] == names[chosen]
    assert chosen != fallback
    tagged = _set_headers(answers[2].response_headers.response)
    assert tagged[messages.REPLICA_HEADER] == names[fallback]  # the retry served it
    s = router.state
    assert s.failures[s.names.index(names[chosen])] == 1  # the first attempt failed
    assert s.penalty_ms[s.names.index(names[chosen])] > 0


@pytest.mark.parametrize("count", ["²", "9" * 5000])
def test_an_attempt_count_that_is_no_plain_number_is_no_retry(count: str) -> None:
    """'²' passes `isdigit` and 5,000 digits pass it too; `int` refused both, and the stream's
    answer to the response headers was lost in a ValueError (no tag, no penalty)."""
    doc = _doc(["10.0.0.1", "10.0.0.2", "10.0.0.3"])
    answers, router = _exchange(doc, {":status": "200", "x-envoy-attempt-count": count})
    routed = _set_headers(answers[1].request_body.response)
    chosen = routed[messages.ENDPOINTS_HEADER].split(",")[0]
    names = {r.address: r.name for r in router.spec.replicas}
    assert _set_headers(answers[2].response_headers.response)[messages.REPLICA_HEADER] \
        == names[chosen]  # served where it was sent
    assert not router.state.failures.any()


def test_no_list_without_a_second_routable_replica_or_with_retries_off() -> None:
    for doc in (_doc(["10.0.0.1"]),
                _doc(["10.0.0.1", "10.0.0.2"], retries={"enabled": False})):
        answers, router = _exchange(doc, {":status": "200"})
        routed = _set_headers(answers[1].request_body.response)
        assert messages.ENDPOINTS_HEADER not in routed
        assert routed[messages.CLUSTER_HEADER] in router.state.clusters
        assert _set_headers(answers[2].response_headers.response)[messages.REPLICA_HEADER]


@pytest.mark.parametrize("response", [{":status": "200", "x-envoy-attempt-count": "2"},
                                      {":status": "503"}, {":status": "200"}])
def test_a_replica_replaced_mid_stream_is_credited_with_nothing_of_the_old_ones(
        response: dict[str, str]) -> None:
    """A reload that points a name at another address makes a new replica (unroutable until
    probed, no load, no cache); the old one's stream answering after it must not make the new
    one healthy, penalise it, or book the request and its prompt on it."""
    doc = _doc(["10.0.0.1", "10.0.0.2", "10.0.0.3"])
    moved = {"replicas": [{**r, "address": f"10.9.9.{k}:9000"}
                          for k, r in enumerate(doc["replicas"])]}

    def replace_all(router: Router, service: ExtProcService) -> None:
        router.reload(parse_fleet({**doc, **moved}))
        service.reloaded()

    _, router = _exchange(doc, response, replace_all)
    s = router.state
    assert not s.healthy.any()
    assert s.failures.tolist() == [0, 0, 0] and s.penalty_ms.tolist() == [0, 0, 0]
    assert s.inflight_reqs.tolist() == [0, 0, 0]
    assert [s.prefix.blocks_held(i) for i in range(s.n)] == [0, 0, 0]


def _stream(router: Router, reqs: list[pb.ProcessingRequest]) -> list:
    service = ExtProcService(router, RouterMetrics(router.state, lambda: 0))

    async def run() -> list:
        async def it():
            for r in reqs:
                yield r
        return [a async for a in service.Process(it(), None)]

    return asyncio.run(run())


def _request() -> list[pb.ProcessingRequest]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    return [pb.ProcessingRequest(request_headers=_headers({
                ":path": "/v1/chat/completions", "x-gorgo-policy": "round-robin"})),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=json.dumps(body).encode(),
                                                          end_of_stream=True))]


def _response(status: str, attempts: int = 1) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_headers=_headers(
        {":status": status, "x-envoy-attempt-count": str(attempts)}))


def test_a_second_request_on_a_stream_books_nothing_more() -> None:
    # Envoy opens a stream per request; a client of the gRPC API sending a second one booked it
    # again and leaked the first booking.
    router = Router(parse_fleet(_doc(["10.0.0.1", "10.0.0.2", "10.0.0.3"])))
    again = pb.ProcessingRequest(request_headers=_headers({":path": "/health"}, end=True))
    _stream(router, [*_request(), again, _response("200")])
    assert router.open_requests == 0 and router.state.inflight_reqs.sum() == 0


def test_a_second_response_headers_message_charges_nothing_more() -> None:
    # One failed attempt, one failure: a repeated message charged the chosen replica again,
    # then the fallback that served a 200.
    router = Router(parse_fleet(_doc(["10.0.0.1", "10.0.0.2", "10.0.0.3"])))
    _stream(router, [*_request(), _response("503"), _response("200", 2), _response("200", 2)])
    assert router.state.failures.sum() == 1
