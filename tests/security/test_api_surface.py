"""Issue 12, the client's side of Envoy, replayed against the real processes: `gorgo sim fleet` +
`gorgo extproc` + real Envoy (LiveStack), all on loopback.

One test per finding: any path reaching the engines (1), clients choosing their priority and
policy (4), and of the smaller ones (10) headers near Envoy's limit, the client's authorization
reaching the router, and a second router sharing the first one's port. Every wait is bounded in
count and time; every process is the stack's or the test's own, stopped by it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from extproc import messages
from extproc.main import ExtProcServer, add_arguments
from gorgo.core.contract import API_PATHS, HEALTH_PATH, ROUTER_READS
from gorgo.core.router import Router
from gorgo.envoy_config import render_bootstrap
from gorgo.harness.envoy_proc import EnvoyProcess
from gorgo.harness.procs import BIN, LoopThread, free_ports, wait_for
from gorgo.harness.stack import LiveStack, StackOptions, with_free_ports
from gorgo.sim.presets import fleet_document
from tests.support.e2e import http_call as call

pytestmark = [pytest.mark.envoy, pytest.mark.slow]

LINKS = {"near": {"rtt_ms": 2.0, "jitter_ms": 0.2}, "far": {"rtt_ms": 20.0, "jitter_ms": 1.0}}
ENVOY_MAX_HEADERS = 100  # Envoy's default max_headers_count, which the rendered config keeps
# What a real SGLang serves on the API port besides the API, and ways around an exact match.
ENGINE_PATHS = [
    ("GET", "/metrics"), ("GET", "/server_info"), ("GET", "/get_server_info"),
    ("GET", "/get_load"), ("POST", "/flush_cache"), ("POST", "/update_weights_from_disk"),
    ("POST", "/v1/chat/completions/render"), ("GET", "/health_generate"),
    ("GET", "/v1/models/../metrics"), ("GET", "//metrics"), ("GET", "/metrics?x=1"),
    ("GET", "/%6detrics"), ("GET", "/v1/models/"), ("GET", "/METRICS"), ("GET", "/"),
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    # LiveStack allows per-request policy overrides: the worst case for finding 4.
    doc = fleet_document({"near": 1, "far": 1}, profile="h100-llama3-8b", links=LINKS,
                         name="surface")
    doc["signals"] = {"probe_interval_s": 0.5, "scrape_interval_s": 0.5}
    with LiveStack(with_free_ports(doc), tmp_path_factory.mktemp("surface"),
                   StackOptions()) as s:
        yield s


def chat(text: str = "hello there") -> dict[str, Any]:
    return {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": text}]}


def raw_get(url: str, path: str, extra: int) -> tuple[int, bytes]:
    """A GET over a raw socket with ``extra`` padding headers (urllib adds its own headers)."""
    pads = "".join(f"x-pad-{i}: v\r\n" for i in range(extra))
    request = f"GET {path} HTTP/1.1\r\nhost: gorgo\r\nconnection: close\r\n{pads}\r\n"
    head, _, body = _raw(url, request.encode()).partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def _raw(url: str, request: bytes) -> bytes:
    """``request`` over a raw socket, and everything read until Envoy closes it."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(request)
        data = b""
        for _ in range(10_000):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return data


def is_openai_error(body: bytes, code: str) -> bool:
    err = json.loads(body)["error"]
    return set(err) == {"message", "type", "param", "code"} and err["code"] == code


# --- finding 1: every path reached the engines ---------------------------------------------------


def test_only_the_inference_api_reaches_the_engines(stack: LiveStack) -> None:
    """`curl <envoy>/metrics` returned the engine's metrics, and on a real SGLang the same port
    serves /flush_cache and /update_weights_from_disk. Now every path but the API and the health
    path is Envoy's own 404, decided before the router is asked."""
    engine = stack.spec.replicas[0].address
    status, _, body = call(f"http://{engine}/metrics")
    assert status == 200 and b"# TYPE" in body  # what the attack used to reach
    for method, path in ENGINE_PATHS:
        status, headers, body = call(stack.url + path, method, {} if method == "POST" else None)
        assert status == 404, (method, path, status)
        assert headers["content-type"] == "application/json", path
        assert is_openai_error(body, "not_found"), (path, body[:200])
        assert "x-gorgo-decision-id" not in headers, path  # the router was not asked
    # The API and the health path still work, through the router.
    for path in (HEALTH_PATH, "/v1/models", "/v1/models?limit=1"):
        status, headers, _ = call(stack.url + path)
        assert status == 200 and "x-gorgo-decision-id" in headers, path
    status, headers, body = call(stack.url + "/v1/chat/completions", "POST", chat())
    assert status == 200 and "x-gorgo-decision-id" in headers
    assert set(API_PATHS) >= {"/v1/chat/completions", "/v1/completions", "/v1/responses"}


def test_other_methods_and_http_1_0_reach_an_engine_as_they_would_alone(
        stack: LiveStack) -> None:
    # A CORS preflight (or a GET) on an inference path was the router's 400 "Request body is
    # empty"; now the engine answers it (the simulated one: 405), the router not asked.
    for method in ("OPTIONS", "GET"):
        status, headers, body = call(stack.url + "/v1/chat/completions", method)
        assert status == 405, (method, status, body[:200])
        assert "x-gorgo-decision-id" not in headers
    # HTTP/1.0 (nginx's default to its upstreams) got an empty reply: the codec refused it.
    body = json.dumps(chat()).encode()
    answer = _raw(stack.url, b"POST /v1/chat/completions HTTP/1.0\r\nhost: gorgo\r\n"
                  b"content-type: application/json\r\ncontent-length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
    assert answer.startswith(b"HTTP/1.0 200"), answer[:200]
    assert b"x-gorgo-decision-id" in answer  # routed by the router
    # ... and without a Host header (HAProxy's `option httpchk` sends none): it was a 400
    answer = _raw(stack.url, b"GET /health HTTP/1.0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.0 200"), answer[:200]


# --- finding 4: clients chose their priority and policy ------------------------------------------


FORGED = [
    {"x-gorgo-policy": "no-such-policy"},
    {"x-gorgo-policy": "session-affinity"},
    {"x-gorgo-priority": "1" + "0" * 400},  # overflowed the shedding limit, 11-line traceback
    {"x-gorgo-priority": "100"},
    {"x-gorgo-priority": "-5"},
]


def test_clients_cannot_choose_their_priority_or_policy(stack: LiveStack) -> None:
    """The fleet allows policy overrides, yet a client's control headers never reach the router:
    every forged value is stripped by Envoy (a value the router saw would be a 400 for the unknown
    policy and the out-of-range priorities, see the trusted peer below)."""
    for headers in FORGED:
        status, got, body = call(stack.url + "/v1/chat/completions", "POST", chat(), headers)
        assert status == 200, (headers, body[:300])
        assert "x-gorgo-decision-id" in got
    assert "Traceback" not in "".join(stack.procs["extproc"].lines)


@pytest.mark.parametrize(("request_headers", "trusted"),
                         [("send", True), ("skip", True), ("skip", False)])
def test_a_trusted_peer_sets_bounded_control_headers(
        stack: LiveStack, request_headers: str, trusted: bool) -> None:
    """The operator's way (control_headers.trusted_peers): a second Envoy in front of the same
    router trusts loopback; its control headers reach the router, which bounds them (400, clean
    OpenAI-style errors) and names an unknown policy instead of ignoring it. With the request
    headers skipped (extproc.request_headers: skip) they reach it as request attributes, read
    after Envoy stripped an untrusted client's: from a peer it does not trust, none arrive."""
    spec = replace(stack.spec, extproc=replace(stack.spec.extproc, request_headers=request_headers),
                   control_headers=replace(stack.spec.control_headers,
                                           trusted_peers=("127.0.0.0/8",) if trusted else ()))
    listen, admin = free_ports(2)
    extproc = stack.procs["extproc"].args[stack.procs["extproc"].args.index("--port") + 1]
    envoy = EnvoyProcess(render_bootstrap(spec, listen=f"127.0.0.1:{listen}",
                                          extproc=f"127.0.0.1:{extproc}",
                                          admin=f"127.0.0.1:{admin}")).start()
    try:
        url = f"http://127.0.0.1:{listen}/v1/chat/completions"
        want = {"no-such-policy": "unknown_policy"}
        # A trusted gateway sends X-Forwarded-For: Envoy counts such a request as external, and
        # its control headers were stripped as a client's.
        for headers, forwarded in itertools.product(FORGED, ({}, {"x-forwarded-for": "10.9.8.7"})):
            status, got, body = call(url, "POST", chat(), {**headers, **forwarded})
            value = next(iter(headers.values()))
            if not trusted or value in ("session-affinity", "100"):
                assert status == 200 and "x-gorgo-decision-id" in got, (headers, body[:300])
            else:
                assert status == 400 and is_openai_error(body, want.get(value, "invalid_priority"))
    finally:
        envoy.stop()
    assert "Traceback" not in "".join(stack.procs["extproc"].lines)


# --- finding 10: the smaller ones -----------------------------------------------------------------


def test_headers_near_envoys_limit_get_a_clean_431(stack: LiveStack) -> None:
    """88-95 client headers (under Envoy's limit of 100) got a bare 500 once the router added its
    routing headers. Every count up to the limit is now a 200 or a clean, OpenAI-style 431."""
    seen = {}
    for extra in range(80, ENVOY_MAX_HEADERS - 1):  # + host and connection: up to the limit
        status, body = raw_get(stack.url, "/v1/models", extra)
        seen[extra] = status
        assert status in (200, 431), (extra, status, body[:200])
        if status == 431:
            assert is_openai_error(body, "request_header_fields_too_large"), body[:200]
    assert seen[80] == 200 and seen[ENVOY_MAX_HEADERS - 2] == 431, seen


@pytest.mark.parametrize(("head", "status", "code"), [
    (b"POST /v1/chat/completions HTTP/1.1\r\nx-foo: a\x01b\r\n", 400, "bad_request"),
    (b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 5\r\n", 400, "bad_request"),
    (b"FOO /v1/chat/completions HTTP/1.1\r\n", 400, "bad_request"),
    (b"POST /v1/chat/completions HTTP/1.1\r\nx-big: " + b"A" * 70_000 + b"\r\n", 431,
     "request_header_fields_too_large"),
])
def test_a_request_that_is_not_valid_http_gets_an_openai_style_error(
        stack: LiveStack, head: bytes, status: int, code: str) -> None:
    """Envoy's codec refuses these before any route; with the router's filter on every stream
    the refusal waited for the router's response-headers call and was never written (an empty
    reply). The router's filter is now off except on the forwarding routes."""
    body = json.dumps(chat()).encode()
    request = (head + b"host: gorgo\r\nconnection: close\r\ncontent-type: application/json\r\n"
               + f"content-length: {len(body)}\r\n\r\n".encode() + body)
    reply_head, _, reply = _raw(stack.url, request).partition(b"\r\n\r\n")
    assert reply_head.split()[1:2] == [str(status).encode()], reply_head[:200]
    assert is_openai_error(reply, code), reply[:200]


@pytest.mark.parametrize(("request_bytes", "status"), [
    # a transfer coding Envoy does not take: 501 text/plain "Not Implemented" before
    (b"POST /v1/chat/completions HTTP/1.1\r\nhost: gorgo\r\nconnection: close\r\n"
     b"transfer-encoding: gzip, chunked\r\n\r\n0\r\n\r\n", 501),
    # a WebSocket upgrade, which no route forwards: 403 with an empty body before
    (b"GET /v1/chat/completions HTTP/1.1\r\nhost: gorgo\r\nconnection: upgrade\r\n"
     b"upgrade: websocket\r\nsec-websocket-version: 13\r\n"
     b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n", 403),
    # a fragment in the path, which Envoy will not normalise: a 400 with an empty body before
    (b"POST /v1/chat/completions#frag HTTP/1.1\r\nhost: gorgo\r\nconnection: close\r\n"
     b"content-type: application/json\r\ncontent-length: 2\r\n\r\n{}", 400),
    (b"GET /v1/models?x=1#y HTTP/1.1\r\nhost: gorgo\r\nconnection: close\r\n\r\n", 400),
])
def test_every_refusal_of_envoys_codec_is_an_openai_style_error(
        stack: LiveStack, request_bytes: bytes, status: int) -> None:
    reply_head, _, reply = _raw(stack.url, request_bytes).partition(b"\r\n\r\n")
    assert reply_head.split()[1:2] == [str(status).encode()], reply_head[:200]
    assert b"application/json" in reply_head.lower(), reply_head[:300]
    assert is_openai_error(reply, "bad_request"), reply[:200]


def test_the_router_sees_only_the_headers_it_reads(stack: LiveStack) -> None:
    """`authorization` (and every other header) was forwarded to the router, which reads none of
    them. Envoy's ext_proc forward rules now send only what the router reads: an in-process router
    on the same fleet, behind the rendered Envoy, records what it gets."""
    lt = LoopThread()
    server = ExtProcServer(Router(stack.spec))
    seen: list[dict[str, str]] = []
    for name in ("_on_request_headers", "_on_response_headers"):
        handler = getattr(server.service, name)

        def spy(st: Any, msg: Any, handler: Any = handler) -> Any:
            seen.append(messages.header_dict(msg))
            return handler(st, msg)

        setattr(server.service, name, spy)
    envoy = None
    try:
        grpc_port, listen, admin = free_ports(3)
        lt.run(server.start("127.0.0.1", grpc_port, metrics_port=-1))
        envoy = EnvoyProcess(render_bootstrap(stack.spec, listen=f"127.0.0.1:{listen}",
                                              extproc=f"127.0.0.1:{grpc_port}",
                                              admin=f"127.0.0.1:{admin}")).start()
        assert wait_for(lambda: bool(server.router.state.routable().any()), 20)
        status, _, _ = call(f"http://127.0.0.1:{listen}/v1/chat/completions", "POST", chat(), {
            "authorization": "Bearer sk-secret", "cookie": "session=s3cret",
            "x-api-key": "sk-other", "x-session-id": "s1", "x-gorgo-priority": "3"})
        assert status == 200
        assert wait_for(lambda: len(seen) >= 2, 10)
    finally:
        if envoy is not None:
            envoy.stop()
        lt.run(server.stop(0))
        lt.close()
    names = {k for headers in seen for k in headers}
    assert names <= set(ROUTER_READS), names - set(ROUTER_READS)
    assert {":path", "x-session-id", ":status"} <= names
    assert "x-gorgo-priority" not in names  # a client's control header, stripped before ext_proc


def test_a_second_router_cannot_share_the_port(stack: LiveStack) -> None:
    """A second `gorgo extproc` on a port in use started and silently shared it (SO_REUSEPORT), so
    a forgotten router kept part of the traffic with its own state. Now it exits with one line."""
    port = stack.procs["extproc"].args[stack.procs["extproc"].args.index("--port") + 1]
    out = subprocess.run(
        [str(BIN / "gorgo"), "extproc", "--fleet", str(stack.fleet_path), "--port", port,
         "--metrics-port", "-1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and port in lines[0] and "Traceback" not in out.stderr, out.stderr
    # The first router still answers alone.
    assert call(stack.url + "/v1/chat/completions", "POST", chat())[0] == 200


def test_default_ports_stay_on_loopback_and_off_node_exporter() -> None:
    """Both ports bind loopback unless told otherwise (the SGLang router binds 0.0.0.0), and the
    metrics port is not node_exporter's 9100 nor in Prometheus' exporter range."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--fleet", "f.yaml"])
    assert args.host == args.metrics_host == "127.0.0.1"
    assert not 9100 <= args.metrics_port <= 9999 and args.metrics_port != args.port

