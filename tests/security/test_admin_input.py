"""Issue 12, finding 8 (the router's side), replayed against a real `gorgo extproc` on loopback:
hostile input to the admin API never gets a 500, never applies, and leaves the router serving.

Every process is the test's own, stopped by it.
"""

from __future__ import annotations

import json
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from extproc.admin import WEIGHTS_MAX_BYTES
from gorgo.core.contract import VERSION_MAX
from gorgo.harness.procs import GorgoProcess, free_port

TOKEN = "s3cret-admin-token"


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, GorgoProcess]]:
    tmp = tmp_path_factory.mktemp("admin")
    fleet = tmp / "fleet.yaml"
    fleet.write_text(json.dumps({"regions": {"r": {}}, "replicas": [{
        "name": "a", "region": "r", "engine": "sglang", "address": f"127.0.0.1:{free_port()}"}]}))
    token = tmp / "token"
    token.write_text(TOKEN)
    proc = GorgoProcess(["extproc", "--fleet", str(fleet), "--port", "0", "--metrics-port", "0",
                         "--admin-token-file", str(token)])
    try:
        yield f"http://127.0.0.1:{proc.field('metrics')}", proc
    finally:
        proc.stop()


def send(url: str, method: str, data: bytes | None = None,
         auth: bytes | None = b"Bearer " + TOKEN.encode()) -> tuple[int, Any]:
    """One request over a raw socket, so a header may carry bytes urllib would refuse."""
    host, port = url.removeprefix("http://").split("/", 1)[0].split(":")
    path = "/" + url.split("/", 3)[3]
    head = f"{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n".encode()
    if auth is not None:
        head += b"authorization: " + auth + b"\r\n"
    if data is not None:
        head += f"content-type: application/json\r\ncontent-length: {len(data)}\r\n".encode()
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(head + b"\r\n" + (data or b""))
        raw = b""
        for _ in range(100_000):
            chunk = s.recv(65536)
            if not chunk:
                break
            raw += chunk
    status_line, _, rest = raw.partition(b"\r\n")
    body = rest.partition(b"\r\n\r\n")[2]
    try:
        return int(status_line.split()[1]), json.loads(body)
    except ValueError:
        return int(status_line.split()[1]), body


def weights(version: Any) -> bytes:
    return b'{"rtt": 1.5, "queue": 1.0, "version": ' + str(version).encode() + b"}"


def version_now(base: str) -> int:
    return send(base + "/admin/weights", "GET")[1]["version"]


def deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


ATTACKS = [
    # An unbounded version used to be applied: /metrics then answered 500, every stream failed
    # open, and no later PUT could lower it.
    ("PUT", "/admin/weights", weights("1" + "0" * 400), 400),
    ("PUT", "/admin/weights", weights(VERSION_MAX + 1), 400),
    # Unhandled 500s: a 5,000-digit version (past Python's int parsing limit), 100k-deep bodies.
    ("PUT", "/admin/weights", weights("9" * 5000), 400),
    ("PUT", "/admin/weights", deep(100_000), 400),
    ("POST", "/admin/explain", deep(100_000), 400),
    ("POST", "/admin/explain", b'{"body": "' + b"[" * 100_000 + b'"}', 400),
    ("POST", "/admin/explain", b'{"headers": {"x-gorgo-priority": "' + b"9" * 5000 + b'"}}', 400),
    ("POST", "/admin/explain", b'{"headers": {"x-gorgo-policy": "nope"}}', 400),
    ("PUT", "/admin/weights", b"{" + b" " * (WEIGHTS_MAX_BYTES + 1) + b"}", 413),
    ("PUT", "/admin/weights", b"\xff\xfe", 400),
    # A weight or a rate of 401 digits: float() overflowed, a bare 500 with a traceback.
    ("PUT", "/admin/weights", b'{"version": 9, "rtt": 1' + b"0" * 400 + b"}", 400),
    ("PUT", "/admin/weights", b'{"version": 9, "prefill_rate": {"r0": 1' + b"0" * 400 + b"}}",
     400),
]


@pytest.mark.parametrize(("method", "path", "data", "want"), ATTACKS,
                         ids=[f"{m} {p} {len(d)}B" for m, p, d, _ in ATTACKS])
def test_hostile_bodies_are_clean_4xx(router: tuple[str, GorgoProcess], method: str, path: str,
                                      data: bytes, want: int) -> None:
    base, proc = router
    before = version_now(base)
    status, doc = send(base + path, method, data)
    assert status == want, (status, str(doc)[:300])
    assert isinstance(doc, dict) and isinstance(doc["error"]["message"], str)
    assert version_now(base) == before
    assert "Traceback" not in "".join(proc.lines)


@pytest.mark.parametrize("auth", [
    "Bearer tökén".encode(), b"Bearer \xff\xfe\xfd", "Bearer s3cret-admin-tokén".encode(),
    b"Bearer " + TOKEN.encode() + b"\x80",
])
def test_a_non_ascii_token_is_401(router: tuple[str, GorgoProcess], auth: bytes) -> None:
    base, proc = router
    for method, data in (("GET", None), ("PUT", weights(10**6))):
        status, doc = send(base + "/admin/weights", method, data, auth=auth)
        assert status == 401 and "token" in doc["error"]["message"], (auth, status, doc)
    assert "Traceback" not in "".join(proc.lines)


def test_the_router_keeps_serving_after_the_attacks(router: tuple[str, GorgoProcess]) -> None:
    """After everything above: /metrics answers, and the operator can still publish (the largest
    version the contract allows is applied, and nothing can go past it)."""
    base, proc = router
    for name, data, want in (("max", weights(VERSION_MAX), 200),
                             ("past max", weights(VERSION_MAX + 1), 400),
                             ("stale", weights(VERSION_MAX - 1), 409)):
        assert send(base + "/admin/weights", "PUT", data)[0] == want, name
    assert version_now(base) == VERSION_MAX
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        assert r.status == 200 and b"gorgo_" in r.read()
    assert "Traceback" not in "".join(proc.lines)


def test_a_non_ascii_token_file_is_refused_at_start(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_bytes("tökén".encode())
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(json.dumps({"regions": {"r": {}}, "replicas": [{
        "name": "a", "region": "r", "engine": "sglang", "address": "127.0.0.1:1"}]}))
    with pytest.raises(RuntimeError, match="printable ASCII"):
        GorgoProcess(["extproc", "--fleet", str(fleet), "--port", "0", "--metrics-port", "0",
                      "--admin-token-file", str(token)])


def test_every_version_the_contract_allows_travels_exactly_as_a_double() -> None:
    # Envoy's metadata, its access log and Prometheus carry the version as a double: 2^53 + 1
    # came back to the tuner as 2^53, a version it never issued.
    assert int(float(VERSION_MAX)) == VERSION_MAX
    assert int(float(VERSION_MAX + 2)) != VERSION_MAX + 2
