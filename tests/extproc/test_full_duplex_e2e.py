"""FULL_DUPLEX_STREAMED request bodies (how Istio and kgateway run an InferencePool's picker) with
real Envoy, in endpoint-picker mode.

Envoy streams the body to the router and drains it; the router answers once the body is whole and
hands it back, so the checks are that requests reach the picked endpoint with their body intact
(hash echoed by the upstream), however the client sent it, and that errors and fail-open behave as
in BUFFERED mode.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import h2.config
import h2.connection
import h2.events
import pytest
import yaml

from gorgo.core.contract import LIVE_SERVICE
from gorgo.core.fleet import load_fleet
from gorgo.envoy_config import EXTPROC_CLUSTER, PICKER_CLUSTER, render_bootstrap
from gorgo.harness.envoy_proc import EnvoyProcess, envoy_binary
from gorgo.harness.procs import BIN, free_port, wait_for
from tests.support.e2e import (
    GorgoMetrics,
    Stack,
    chat,
    get,
    post,
    start_stack,
    stop_stack,
)

pytestmark = pytest.mark.envoy

LIMIT = 1 << 20


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _stack(tmp: Path, n: int = 3, trailers: str = "send", **extra: object) -> Stack:
    """``trailers``: the fleet's extproc.response_trailers (``send``: the router's stream
    lasts the whole response, what most of these tests look at)."""
    return start_stack(tmp, n=n, body_mode="full-duplex", endpoint_picker=True,
                       limits={"max_body_bytes": LIMIT}, extproc={"response_trailers": trailers},
                       **extra)


@pytest.fixture(scope="module")
def st(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = _stack(tmp_path_factory.mktemp("duplex"))
    yield stack
    stop_stack(stack)


def _body(content: str) -> bytes:
    return json.dumps(chat(content)).encode()


def _streams_held(st: Stack, hold: asyncio.Event, k: int, **fields: Any) -> list[Any]:
    """``k`` streaming answers (their bodies with ``fields``) whose replicas send their headers
    and first chunk, then wait for ``hold``: the futures of their (status, headers, body, ...)
    once they end."""
    for u in st.upstreams:
        u.hold = hold
    before = sum(len(u.served) for u in st.upstreams)
    body = json.dumps({**chat("streaming"), "stream": True, **fields}).encode()
    held = [asyncio.run_coroutine_threadsafe(
        post(st.url + "/v1/chat/completions", body, {}), st.lt.loop) for _ in range(k)]
    assert wait_for(lambda: sum(len(u.served) for u in st.upstreams) == before + k, 10)
    return held


def _ended_whole(st: Stack, hold: asyncio.Event, held: list[Any]) -> bool:
    """Let the held answers end: whether each was a 200 that reached its end."""
    st.lt.loop.call_soon_threadsafe(hold.set)
    answers = [h.result(timeout=30) for h in held]
    return all(a[0] == 200 and a[2].endswith(b"data: [DONE]\n\n") for a in answers)


async def _post_chunked(url: str, pieces: list[bytes]) -> tuple[int, dict, bytes]:
    """POST with Transfer-Encoding: chunked, one chunk per piece (no Content-Length)."""
    async def gen() -> AsyncIterator[bytes]:
        for p in pieces:
            yield p

    async with aiohttp.ClientSession() as s, s.post(
            url, data=gen(), headers={"x-gorgo-policy": "round-robin"}) as r:
        return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read()


def test_rendered_full_duplex_config_passes_envoy_validate(tmp_path: Path, st: Stack) -> None:
    out = tmp_path / "envoy.yaml"
    subprocess.run([str(BIN / "gorgo"), "envoy-config", str(st.fleet_path), "--picker",
                    "--body-mode", "full-duplex", "-o", str(out)], check=True, timeout=60)
    boot = yaml.safe_load(out.read_text())
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    mode = hcm["typed_config"]["http_filters"][0]["typed_config"]["processing_mode"]
    assert mode["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert mode["request_trailer_mode"] == "SEND"  # Envoy refuses full duplex without it
    (extproc,) = [c for c in boot["static_resources"]["clusters"] if c["name"] == EXTPROC_CLUSTER]
    # gRPC, not a TCP connect: a hung router still completes the handshake
    assert extproc["health_checks"][0]["grpc_health_check"] == {"service_name": LIVE_SERVICE}
    check = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(out),
                            "--base-id", "4243"], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def test_requests_reach_the_picked_endpoint_with_their_body_intact(st: Stack) -> None:
    served = []
    for k in range(6):
        body = _body(f"duplex {k} " * 40)
        status, headers, _, _ = st.post(body, {"x-gorgo-policy": "round-robin"})
        assert status == 200
        assert headers["x-served-by"] == headers["x-gorgo-replica"]
        assert headers["x-body-sha256"] == _sha(body)
        served.append(headers["x-served-by"])
    assert set(served) == {"r0", "r1", "r2"}
    name = f"cluster.{PICKER_CLUSTER}.upstream_rq_completed"
    assert st.envoy.stats(name).get(name, 0) >= 6
    # A body-less request is routed on its headers.
    status, headers, _, _ = st.lt.run(get(st.url + "/v1/models"))
    assert status == 200 and headers["x-served-by"] == headers["x-gorgo-replica"]


def test_chunked_upload_and_a_large_body_arrive_intact(st: Stack) -> None:
    large = _body("a large prompt " * 14_000)
    assert len(large) > 200_000
    status, headers, _, _ = st.post(large, {"x-gorgo-policy": "round-robin"})
    assert status == 200 and headers["x-body-sha256"] == _sha(large)
    assert headers["x-served-by"] == headers["x-gorgo-replica"]
    pieces = [large[:100], large[100:70_000], large[70_000:]]
    status, headers, _ = st.lt.run(_post_chunked(st.url + "/v1/chat/completions", pieces))
    assert status == 200 and headers["x-body-sha256"] == _sha(large)
    assert int(headers["x-body-bytes"]) == len(large)
    assert headers["x-served-by"] == headers["x-gorgo-replica"]


def test_malformed_and_oversized_bodies_get_openai_errors(st: Stack) -> None:
    status, headers, body, _ = st.post(b'{"model": "m", "messages": [')
    assert status == 400 and headers["content-type"].startswith("application/json")
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
    # Chunked, so no Content-Length: refused once the streamed body passes the limit.
    blob = b"x" * (LIMIT // 4)
    status, headers, body = st.lt.run(_post_chunked(st.url + "/v1/chat/completions",
                                                    [blob] * 5))
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"


def _trailers_request(port: int, body: bytes) -> tuple[int, dict[str, str], bytes]:
    """HTTP/1.1 chunked upload ending with a trailer; Connection: close ends the answer."""
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gorgo\r\nConnection: close\r\n"
            b"Transfer-Encoding: chunked\r\nTrailer: x-checksum\r\n"
            b"x-gorgo-policy: round-robin\r\n\r\n")
    chunked = b"%x\r\n%s\r\n0\r\nx-checksum: %s\r\n\r\n" % (len(body), body, _sha(body).encode())
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head + chunked)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    top, _, rest = data.partition(b"\r\n\r\n")
    lines = top.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, rest


@pytest.mark.parametrize("mode", ["picker", "plain"])
def test_request_trailers_are_answered_after_the_body(mode: str, st: Stack,
                                                      plain: Stack) -> None:
    """Envoy forwards HTTP/1 trailers only with enable_trailers: a second Envoy with it on."""
    st = st if mode == "picker" else plain
    listen = free_port()
    boot = render_bootstrap(load_fleet(st.fleet_path), listen=f"127.0.0.1:{listen}",
                            extproc=f"127.0.0.1:{st.extproc.field('grpc')}",
                            admin=f"127.0.0.1:{free_port()}", body_mode="full-duplex")
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    hcm["typed_config"]["http_protocol_options"] = {"enable_trailers": True}
    with EnvoyProcess(boot):
        body = _body("with a trailer " * 100)
        status, headers, rest = _trailers_request(listen, body)
    assert status == 200, rest
    assert headers["x-served-by"] == headers["x-gorgo-replica"]
    assert headers["x-body-sha256"] == _sha(body)


def _h2_request(port: int, body: bytes, trailers: bool) -> tuple[dict[str, str], bytes]:
    """An HTTP/2 (prior knowledge, h2c) upload, ended by trailers as gRPC clients send, or by its
    last data frame; the body goes out as the flow-control windows allow."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.send_headers(1, [(":method", "POST"), (":scheme", "http"), (":authority", "gorgo"),
                          (":path", "/v1/chat/completions"),
                          ("content-type", "application/json"),
                          ("x-gorgo-policy", "round-robin")])
    headers: dict[str, str] = {}
    data = b""
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        while True:
            while sent < len(body) and (window := min(conn.local_flow_control_window(1),
                                                      conn.max_outbound_frame_size)) > 0:
                piece = body[sent:sent + window]
                sent += len(piece)
                conn.send_data(1, piece, end_stream=not trailers and sent == len(body))
                if trailers and sent == len(body):
                    conn.send_headers(1, [("x-checksum", _sha(body))], end_stream=True)
            s.sendall(conn.data_to_send())
            chunk = s.recv(65536)
            assert chunk, "Envoy closed the connection before the answer ended"
            for ev in conn.receive_data(chunk):
                if isinstance(ev, h2.events.ResponseReceived):
                    headers = {k.decode(): v.decode() for k, v in ev.headers}
                elif isinstance(ev, h2.events.DataReceived):
                    data += ev.data
                    conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                elif isinstance(ev, h2.events.StreamEnded | h2.events.StreamReset):
                    return headers, data


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Full duplex in cluster-header mode, with the retry route (on by default)."""
    stack = start_stack(tmp_path_factory.mktemp("duplex-plain"), n=3, body_mode="full-duplex",
                        limits={"max_body_bytes": LIMIT}, extproc={"response_trailers": "send"})
    yield stack
    stop_stack(stack)


@pytest.mark.parametrize("mode", ["picker", "plain"])
def test_http2_uploads_with_and_without_trailers_reach_the_upstream_once(
        mode: str, st: Stack, plain: Stack) -> None:
    """Envoy sent a body that ended with trailers twice on its retry route (a 500 from the
    upstream's JSON parser): such a request now takes the route without a retry."""
    stack = st if mode == "picker" else plain
    port = int(stack.url.rsplit(":", 1)[1])
    for trailers in (True, False):
        for size in (10, 2_000):  # one body message, and several
            body = _body("h2 upload " * size)
            headers, rest = _h2_request(port, body, trailers)
            assert headers[":status"] == "200", rest
            assert headers["x-served-by"] == headers["x-gorgo-replica"]
            assert headers["x-body-sha256"] == _sha(body)
            assert int(headers["x-body-bytes"]) == len(body)


@pytest.mark.parametrize("mode", ["picker", "plain"])
def test_a_streaming_answer_stays_booked_until_it_ends(mode: str, st: Stack,
                                                       plain: Stack) -> None:
    """Envoy closed the router's stream at the response headers (response trailers skipped),
    and the router released the booking there, with the answer still streaming: every replica
    looked idle and concurrent streams all went to one."""
    stack = st if mode == "picker" else plain
    hold = asyncio.Event()
    try:
        held = _streams_held(stack, hold, 3)
        time.sleep(0.5)  # the answers' first chunks are out; their ends are held
        assert GorgoMetrics(stack).total("gorgo_open_decisions") == 3
        assert _ended_whole(stack, hold, held)
        assert wait_for(lambda: GorgoMetrics(stack).total("gorgo_open_decisions") == 0, 10)
    finally:
        stack.lt.loop.call_soon_threadsafe(hold.set)
        for u in stack.upstreams:
            u.hold = None


def test_a_stopped_router_drains_its_streams_and_envoy_fails_new_ones_open(
        tmp_path: Path) -> None:
    """SIGTERM during a rolling restart: Envoy cannot fail a full-duplex stream open once the
    body went to the router, so the router must not cut the streams it has (they were 500s
    after a 1 s grace), and it answers NOT_SERVING so Envoy stops opening new ones."""
    st = _stack(tmp_path, n=2)
    try:
        for u in st.upstreams:
            u.delay_s = 2.0
        held = [asyncio.run_coroutine_threadsafe(
            post(st.url + "/v1/chat/completions", _body(f"held {k}"), {}), st.lt.loop)
            for k in range(4)]
        assert wait_for(lambda: sum(len(u.served) for u in st.upstreams) == 4, 10)
        os.kill(st.extproc.p.pid, signal.SIGTERM)  # the router alone, as a deployment does
        name = f"cluster.{EXTPROC_CLUSTER}.membership_healthy"
        assert wait_for(lambda: st.envoy.stats(name).get(name) == 0, 10)
        for u in st.upstreams:
            u.delay_s = 0.0
        status, headers, _, _ = st.post(_body("after the drain began"))
        assert status == 200 and "x-gorgo-replica" not in headers  # failed open, not failed
        answers = [h.result(timeout=30) for h in held]
        assert [a[0] for a in answers] == [200] * 4
        assert all(a[1]["x-gorgo-replica"] == a[1]["x-served-by"] for a in answers)
        assert st.extproc.p.wait(30) == 0
    finally:
        stop_stack(st)


def test_a_stop_lets_the_answers_streaming_through_the_router_end_whole(tmp_path: Path) -> None:
    """The router's stream lasts as long as the response (the response trailers are sent to
    it), and closing it earlier fails the response: a stop waits for the answers to end."""
    st = _stack(tmp_path, n=2)
    hold = asyncio.Event()
    try:
        held = _streams_held(st, hold, 2)
        time.sleep(0.5)  # the response headers and first chunks are out
        os.kill(st.extproc.p.pid, signal.SIGTERM)
        time.sleep(2.5)  # past the drain's quiet time: the streams still hold it
        assert st.extproc.p.poll() is None
        assert _ended_whole(st, hold, held)
        assert st.extproc.p.wait(30) == 0
    finally:
        st.lt.loop.call_soon_threadsafe(hold.set)
        stop_stack(st)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_by_default_answers_streaming_outlive_the_router(tmp_path: Path,
                                                         how: signal.Signals) -> None:
    """With the response trailers sent, Envoy kept the router's stream for the whole response:
    a router that died, or stopped past --drain-s, cut every answer still streaming (3 of 3).
    By default they are skipped: the stream ends at the response headers, and the booking
    is held past it for the answer's predicted decoding (it ended there: 9 concurrent streams
    went to one replica); 20,000 tokens take longer than this test."""
    st = _stack(tmp_path, n=2, trailers="skip", extproc_args=("--drain-s", "1"))
    hold = asyncio.Event()
    try:
        held = _streams_held(st, hold, 3, max_tokens=20_000)
        streams = f"cluster.{EXTPROC_CLUSTER}.upstream_rq_active"
        assert wait_for(lambda: st.envoy.stats(streams).get(streams) == 0, 10)  # closed
        assert GorgoMetrics(st).total("gorgo_open_decisions") == 3  # still booked
        os.kill(st.extproc.p.pid, how)
        st.extproc.p.wait(30)
        assert _ended_whole(st, hold, held)
    finally:
        st.lt.loop.call_soon_threadsafe(hold.set)
        stop_stack(st)


@pytest.mark.slow
def test_fails_open_to_the_default_cluster_once_the_router_is_down(tmp_path: Path) -> None:
    """Envoy ignores failure_mode_allow once it has streamed body to the router, so the rendered
    health check must take the dead router out before requests fail open."""
    st = _stack(tmp_path, n=2)
    try:
        status, headers, _, _ = st.post(_body("before"), {"x-gorgo-policy": "round-robin"})
        assert status == 200 and headers["x-served-by"] == headers["x-gorgo-replica"]
        st.extproc.kill()
        name = f"cluster.{EXTPROC_CLUSTER}.membership_healthy"
        assert wait_for(lambda: st.envoy.stats(name).get(name) == 0, 10)
        for k in range(3):
            body = _body(f"after the router died {k} " * 300)
            status, headers, _, _ = st.post(body)
            assert status == 200 and headers["x-served-by"] == "r0"
            assert "x-gorgo-replica" not in headers
            assert headers["x-body-sha256"] == _sha(body)
    finally:
        stop_stack(st)
