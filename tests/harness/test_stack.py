"""`LiveStack` and `ProxyPerRegion` start again on new ports when one they drew was taken before
their child bound it (a parallel `make test` lost a run that way)."""

from __future__ import annotations

import json
import socket
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gorgo.harness import stack as stack_module
from gorgo.harness.multiproxy import ProxyPerRegion
from gorgo.harness.stack import LiveStack, StackOptions, with_free_ports
from gorgo.sim.presets import fleet_document

pytestmark = [pytest.mark.envoy, pytest.mark.slow]


@contextmanager
def listening(port: int) -> Iterator[None]:
    """Someone else's socket on ``port`` while the block runs."""
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
        s.listen()
        yield
    finally:
        s.close()


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _answered(url: str) -> bool:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status == 200 and bool(json.loads(r.read())["choices"])


def _doc() -> dict:
    return with_free_ports(fleet_document({"near": 1, "far": 1}, name="clash", links={
        "near": {"rtt_ms": 2.0}, "far": {"rtt_ms": 4.0}}))


def test_a_stack_whose_replica_port_was_taken_starts_on_new_ones(tmp_path: Path) -> None:
    doc = _doc()
    taken = _port(doc["replicas"][0]["address"])
    with listening(taken), LiveStack(doc, tmp_path, StackOptions()) as stack:
        addresses = [r.address for r in stack.spec.replicas]
        assert _port(addresses[0]) != taken
        assert stack.rtt_known()  # the router measured the replicas on their new ports
        assert _answered(stack.url)


def test_a_stack_whose_envoy_listener_was_taken_starts_on_another(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = stack_module.free_ports
    first = real(6)  # the router's first draw: its 5th port, Envoy's listener, is taken
    draws: list[list[int]] = []

    def drawn(n: int) -> list[int]:
        ports = first if n == 6 and not draws else real(n)
        draws.append(ports)
        return ports

    doc = _doc()
    monkeypatch.setattr(stack_module, "free_ports", drawn)
    with listening(first[4]), LiveStack(doc, tmp_path, StackOptions()) as stack:
        router_draws = [d for d in draws if len(d) == 6]
        assert len(router_draws) == 2
        assert stack.url == f"http://127.0.0.1:{router_draws[1][4]}"
        assert _answered(stack.url)


def test_a_proxy_per_region_whose_view_port_was_taken_starts_on_new_ones(
        tmp_path: Path) -> None:
    proxies = ProxyPerRegion(_doc(), tmp_path, StackOptions())
    view = proxies.docs["far"]
    taken = _port(view["replicas"][1]["address"])
    with listening(taken), proxies:
        assert _port(proxies.docs["far"]["replicas"][1]["address"]) != taken
        assert set(proxies.stacks) == {"near", "far"}
        assert all(s.rtt_known() and _answered(s.url) for s in proxies.stacks.values())
