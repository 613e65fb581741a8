"""Real Envoy + `gorgo extproc` + streaming upstreams + an OTLP receiver, all on dynamic ports.

Every test runs twice: with Envoy's three ext_proc messages per request (the default), and with
one (the fleet's extproc.request_headers and response_headers both skip: the body message
carries the headers as attributes, Envoy routes from the decision's metadata)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from gorgo.core.contract import DECISION_FIELDS, PROXY_REGION_ATTR
from gorgo.core.contract import TTFT_ATTR as TTFT_TAG
from gorgo.core.fleet import load_fleet
from gorgo.envoy_config import EXTPROC_CLUSTER, OTLP_CLUSTER
from gorgo.harness.procs import wait_for
from tests.support.e2e import (
    CHUNK_GAP_S,
    CHUNKS,
    GorgoMetrics,
    Stack,
    chat,
    get,
    post,
    start_stack,
    stop_stack,
)

pytestmark = pytest.mark.envoy
MODES = {"three-messages": {},
         "one-message": {"extproc": {"request_headers": "skip", "response_headers": "skip"}}}


@pytest.fixture(scope="module", params=list(MODES))
def mode(request: pytest.FixtureRequest) -> dict:
    return MODES[request.param]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, mode: dict) -> Iterator[Stack]:
    st = start_stack(tmp_path_factory.mktemp("stack"), **mode)
    yield st
    stop_stack(st)


@pytest.mark.slow
def test_request_lands_on_the_replica_the_policy_chose(stack: Stack) -> None:
    for k in range(6):
        status, headers, _, _ = stack.post(chat(f"question {k} " * 50),
                                           {"x-gorgo-policy": "round-robin"})
        assert status == 200
        assert headers["x-gorgo-replica"] == headers["x-served-by"]
    # A repeated long prompt goes back to the replica that has its prefix cached.
    prompt = "shared long context " * 2000
    first = stack.post(chat(prompt))[1]["x-gorgo-replica"]
    for _ in range(3):
        assert stack.post(chat(prompt + " and a follow-up"))[1]["x-gorgo-replica"] == first


def test_client_cannot_pick_the_cluster(stack: Stack) -> None:
    for _ in range(4):
        status, headers, _, _ = stack.post(chat("let me choose " * 30),
                                           {"x-gorgo-cluster": "gorgo_extproc",
                                            "x-gorgo-policy": "round-robin"})
        assert status == 200 and headers["x-served-by"] == headers["x-gorgo-replica"]


def test_sse_chunks_stream_through_one_by_one(stack: Stack) -> None:
    status, _, body, arrivals = stack.post(chat("stream me"))
    assert status == 200
    assert body.count(b"data: ") == CHUNKS + 1
    assert len(arrivals) >= CHUNKS  # not buffered into one piece
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert sum(g >= CHUNK_GAP_S * 0.6 for g in gaps) >= CHUNKS - 2


def test_spans_carry_ttft_and_every_decision_field(stack: Stack) -> None:
    did = stack.post(chat("traced request " * 100))[1]["x-gorgo-decision-id"]
    assert wait_for(lambda: any(s.get("gorgo.decision_id") == did for s in stack.sink.spans), 15)
    span = next(s for s in stack.sink.spans if s.get("gorgo.decision_id") == did)
    ttft_us = int(span[TTFT_TAG])
    assert 0 < ttft_us < 5_000_000
    for key in DECISION_FIELDS:
        assert span.get(f"gorgo.{key}") not in (None, ""), key
    assert span["gorgo.policy"] == "gorgo"
    assert span[PROXY_REGION_ATTR] == load_fleet(stack.fleet_path).proxy_region
    assert float(span["gorgo.predicted_ttft_ms"]) > 0
    assert int(span["gorgo.prompt_tokens"]) >= 350


def test_bad_inputs_get_openai_errors(stack: Stack) -> None:
    status, _, body, _ = stack.post(b"{not json")
    assert status == 400
    err = json.loads(body)["error"]
    assert err["type"] == "invalid_request_error" and "JSON" in err["message"]

    status, _, body, _ = stack.post({"model": "m", "messages": "nope"})
    assert status == 400 and json.loads(body)["error"]["param"] == "messages"

    status, headers, body, _ = stack.post(chat("x" * 70000))
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    assert headers["content-type"].startswith("application/json")

    status, headers, body, _ = stack.lt.run(get(stack.url + "/v1/models"))
    assert status == 200 and headers["x-gorgo-replica"] == headers["x-served-by"]


def test_chunked_body_over_limit_is_413_json(stack: Stack) -> None:
    async def gen():
        for _ in range(20):
            yield b"x" * 8192

    async def go():
        async with aiohttp.ClientSession() as s, s.post(
            stack.url + "/v1/chat/completions", data=gen()
        ) as r:
            return r.status, await r.read()

    status, body = stack.lt.run(go())
    assert status == 413
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_a_request_is_in_flight_until_its_stream_ends(stack: Stack) -> None:
    """Envoy holds the ext_proc stream open for the whole HTTP stream, in either mode: the
    router books a request from its decision to its last byte."""
    inflight = lambda: sum(GorgoMetrics(stack).values("gorgo_inflight_requests").values())  # noqa: E731
    assert wait_for(lambda: inflight() == 0, 5)
    hold = stack.lt.run(_event())
    for u in stack.upstreams:
        u.hold = hold
    try:
        answer = asyncio.run_coroutine_threadsafe(
            post(stack.url + "/v1/chat/completions", chat("a long answer"), {}), stack.lt.loop)
        assert wait_for(lambda: any(u.served for u in stack.upstreams) and inflight() == 1, 10)
        time.sleep(0.3)  # the stream is held open: the booking stays
        assert inflight() == 1 and not answer.done()
    finally:
        stack.lt.loop.call_soon_threadsafe(hold.set)
        for u in stack.upstreams:
            u.hold = None
    status, headers, body, _ = answer.result(timeout=30)
    assert status == 200 and headers["x-gorgo-replica"] == headers["x-served-by"]
    assert body.count(b"data: ") == CHUNKS + 1
    assert wait_for(lambda: inflight() == 0, 5)


async def _event() -> asyncio.Event:
    return asyncio.Event()


def test_the_router_reads_the_session_and_policy_headers(stack: Stack) -> None:
    session = {"x-gorgo-policy": "session-affinity", "x-session-id": "user-42"}
    served = {stack.post(chat(f"turn {k}"), session)[1]["x-served-by"] for k in range(4)}
    assert len(served) == 1
    rr = {"x-gorgo-policy": "round-robin"}
    assert len({stack.post(chat(f"rr {k}"), rr)[1]["x-served-by"] for k in range(6)}) > 1


def test_no_healthy_replica_is_503_with_retry_after(tmp_path: Path, mode: dict) -> None:
    st = start_stack(tmp_path, n=2, **mode)
    try:
        for u in st.upstreams:
            u.healthy = False
        assert wait_for(lambda: sum(GorgoMetrics(st).values("gorgo_replica_healthy").values())
                        == 0, 10)
        status, headers, body, _ = st.post(chat("anyone there?"))
        assert status == 503
        assert int(headers["retry-after"]) >= 1
        assert json.loads(body)["error"]["code"] == "no_healthy_replica"
        for u in st.upstreams:
            u.healthy = True
        assert wait_for(lambda: st.post(chat("back?"))[0] == 200, 10)
    finally:
        stop_stack(st)


def test_a_non_streamed_answer_may_take_longer_than_the_idle_timeout(tmp_path: Path,
                                                                      mode: dict) -> None:
    """A non-streamed answer sends no byte until it is whole: its route waits for the whole
    request (timeouts.request_s), while a stream silent as long is still ended at idle_s, and a
    client's own stream header changes neither."""
    st = start_stack(tmp_path, n=2, timeouts={"idle_s": 1, "request_s": 30}, **mode)
    try:
        for u in st.upstreams:
            u.delay_s = 2.5
        status, headers, body, _ = st.post(chat("answer whole", stream=False))
        assert status == 200 and headers["x-served-by"] in {"r0", "r1"}
        assert body.count(b"data: ") == CHUNKS + 1
        for claim in ({}, {"x-gorgo-stream": "false"}):
            status, _, body, _ = st.post(chat("answer streamed"), claim)
            assert status == 504 and json.loads(body)["error"]["code"] == "timeout"
        assert wait_for(lambda: sum(GorgoMetrics(st).values("gorgo_inflight_requests").values())
                        == 0, 10)
        # With the router down the request fails open, and its answer is still waited for
        # whole (the fail-open route's idle timeout cut it: a 504).
        st.extproc.kill()
        status, headers, body, _ = st.post(chat("answer whole, router down", stream=False))
        assert status == 200 and headers["x-served-by"] == "r0"
        assert body.count(b"data: ") == CHUNKS + 1
    finally:
        stop_stack(st)


@pytest.mark.slow
def test_killing_extproc_fails_open_to_default_cluster(tmp_path: Path, mode: dict) -> None:
    st = start_stack(tmp_path, n=3, **mode)
    try:
        assert st.post(chat("before"))[0] == 200
        st.extproc.kill()
        statuses = [st.post(chat(f"after {k}")) for k in range(5)]
        assert all(s[0] == 200 for s in statuses)
        assert {s[1]["x-served-by"] for s in statuses} == {"r0"}  # the default cluster
        assert "x-gorgo-replica" not in statuses[0][1]
        # The body limit holds without the router: any size went on to r0 before.
        status, _, body, _ = st.post(chat("x" * 70_000))
        assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    finally:
        stop_stack(st)


def test_a_header_value_that_is_not_utf8_is_routed_or_refused_never_unrouted(
        stack: Stack, mode: dict) -> None:
    """With the request headers skipped they reach the router as string attributes, which
    protobuf refuses when a value is not UTF-8: the message did not parse, Envoy failed the
    request open, past shedding, the model check and the booking. Now it is the router's 400;
    the three-message mode carries the header as bytes and routes."""
    body = json.dumps(chat("bytes")).encode()
    host, port = stack.url.rsplit("/", 1)[1].split(":")
    raw = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gorgo\r\nConnection: close\r\n"
           b"Content-Type: application/json\r\nx-session-id: \xff\xfe\r\n"
           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

    async def send() -> bytes:
        r, w = await asyncio.open_connection(host, int(port))
        w.write(raw)
        await w.drain()
        data = await r.read()
        w.close()
        return data

    head, _, answer = stack.lt.run(send()).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    if mode:  # one message
        assert status == 400, answer
        assert json.loads(answer)["error"]["code"] == "invalid_header"
    else:
        assert status == 200 and headers["x-gorgo-replica"] == headers["x-served-by"]


@pytest.mark.slow
@pytest.mark.parametrize("ratio", [1, 3])
def test_envoy_keeps_the_fleets_connections_to_a_replica_per_open_stream(tmp_path: Path,
                                                                         ratio: int) -> None:
    """One stream open on the only replica: with `upstream.preconnect_ratio` 3 Envoy opens two
    more connections to it for the requests to come (one stream per HTTP/1.1 connection; on a
    WAN each new one costs a round trip), with 1 only the stream's own."""
    st = start_stack(tmp_path, n=1, upstream={"preconnect_ratio": ratio})
    hold = st.lt.run(_event())
    st.upstreams[0].hold = hold  # the stream stays open while the pool is read

    def replica_connections() -> int:
        stats = st.envoy.stats("upstream_cx_total")
        return sum(v for k, v in stats.items()
                   if k.split(".")[1] not in (EXTPROC_CLUSTER, OTLP_CLUSTER))

    try:
        answer = asyncio.run_coroutine_threadsafe(
            post(st.url + "/v1/chat/completions", chat("one request"), {}), st.lt.loop)
        assert wait_for(lambda: st.upstreams[0].served, 10)
        assert wait_for(lambda: replica_connections() >= ratio, 10)
    finally:
        st.lt.loop.call_soon_threadsafe(hold.set)
    try:
        status, _, body, _ = answer.result(timeout=30)
        assert status == 200 and body.endswith(b"data: [DONE]\n\n")
        assert replica_connections() == ratio
    finally:
        stop_stack(st)
