"""Many models and membership changes with real Envoy in cluster mode (filesystem CDS), on one
module-scoped stack: each model reaches only its replicas, an unknown model is the router's 404,
`/v1/models` lists the fleet's models; a replica added, drained and removed under a bounded load
loses no request and leaves the others' state alone, with the same Envoy process throughout; a
broken fleet file leaves routing as it was."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from gorgo.harness.procs import wait_for
from gorgo.harness.stack import LiveStack, StackOptions, with_free_ports
from gorgo.sim.presets import fleet_document

pytestmark = [pytest.mark.envoy, pytest.mark.slow]

MODELS = {"near-0": ["alpha"], "near-1": ["alpha"], "near-2": ["beta"], "near-3": ["alpha"]}
FIRST = ("near-0", "near-1", "near-2")  # the router's fleet at start; near-3 is added later


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    doc = fleet_document({"near": 4}, profile="h100-llama3-8b",
                         links={"near": {"rtt_ms": 2.0, "jitter_ms": 0.2}}, name="models")
    doc["signals"] = {"probe_interval_s": 0.5, "scrape_interval_s": 0.5}
    for r in doc["replicas"]:
        r["models"] = MODELS[r["name"]]
    opts = StackOptions(policy="round-robin", stream_interval=16, cds=True,
                        router_replicas=FIRST)
    with LiveStack(with_free_ports(doc), tmp_path_factory.mktemp("models"), opts) as s:
        yield s


def call(url: str, body: Any = None) -> tuple[int, dict[str, str], Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    if data is not None:
        req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, json.loads(err.read())


def chat(model: str, text: str = "hello there") -> dict[str, Any]:
    return {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": text}]}


def served_by(stack: LiveStack, model: str, n: int) -> set[str]:
    out = set()
    for k in range(n):
        status, headers, _ = call(stack.url + "/v1/chat/completions",
                                  chat(model, f"q{k} " * 200))
        assert status == 200
        out.add(headers["x-gorgo-replica"])
    return out


def test_each_model_reaches_only_its_replicas_and_an_unknown_one_is_404(stack: LiveStack) -> None:
    status, _, listing = call(stack.url + "/v1/models")
    assert status == 200 and [m["id"] for m in listing["data"]] == ["alpha", "beta"]
    assert served_by(stack, "alpha", 6) == {"near-0", "near-1"}
    assert served_by(stack, "beta", 3) == {"near-2"}
    status, headers, err = call(stack.url + "/v1/chat/completions", chat("gamma"))
    assert status == 404 and err["error"]["code"] == "model_not_found"
    assert "alpha, beta" in err["error"]["message"] and "x-gorgo-replica" not in headers


class Load:
    """Two clients sending `alpha` requests back to back until stopped (at most ``limit``)."""

    def __init__(self, stack: LiveStack, limit: int = 400) -> None:
        self.stack = stack
        self.limit = limit
        self.answers: list[tuple[float, int, str]] = []  # (sent at, status, replica)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(c,)) for c in range(2)]

    def _run(self, client: int) -> None:
        k = 0
        while not self._stop.is_set() and len(self.answers) < self.limit:
            sent = time.monotonic()
            status, headers, _ = call(self.stack.url + "/v1/chat/completions",
                                      chat("alpha", f"client {client} turn {k % 4} " * 30))
            self.answers.append((sent, status, headers.get("x-gorgo-replica", "")))
            k += 1

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

    def served_since(self, t0: float) -> set[str]:
        return {r for sent, _, r in self.answers if sent >= t0}


def _replica(status: dict[str, Any], name: str) -> dict[str, Any]:
    return next(r for r in status["replicas"] if r["name"] == name)


def test_add_drain_remove_under_load_loses_nothing_without_restarting_envoy(
        stack: LiveStack) -> None:
    assert stack.envoy is not None and stack.envoy.proc is not None
    envoy_pid = stack.envoy.proc.pid
    before = stack.fleet()
    assert _replica(before, "near-1")["prefix_blocks"] > 0  # the previous test's requests
    new = next(r for r in yaml.safe_load(stack.fleet_path.read_text())["replicas"]
               if r["name"] == "near-3")
    with Load(stack) as load:
        added_at = time.monotonic()
        out = stack.fleet("POST", "/replicas", new)
        assert out["added"] == ["near-3"]
        assert wait_for(lambda: "near-3" in load.served_since(added_at), 20, 0.1)
        kept = _replica(stack.fleet(), "near-1")
        old = _replica(before, "near-1")
        assert kept["rtt_samples"] >= old["rtt_samples"] and kept["rtt_ms"] is not None
        assert kept["prefix_blocks"] >= old["prefix_blocks"]
        stack.fleet("POST", "/replicas/near-0/drain", {"drain": True})
        drained_at = time.monotonic()
        assert wait_for(lambda: len(load.served_since(drained_at)) >= 1
                        and _replica(stack.fleet(), "near-0")["inflight"] == 0, 20, 0.1)
        out = stack.fleet("DELETE", "/replicas/near-0")
        assert out["removed"] == ["near-0"]
        removed_at = time.monotonic()
        assert wait_for(lambda: len([a for a in load.answers if a[0] >= removed_at]) >= 6,
                        20, 0.1)
    assert load.answers and {s for _, s, _ in load.answers} == {200}, load.answers[-5:]
    assert "near-0" not in load.served_since(drained_at)
    assert load.served_since(removed_at) <= {"near-1", "near-3"}
    assert 'replica="near-0"' not in stack.router_metrics()
    assert stack.cds_path is not None and "near-0" not in stack.cds_path.read_text()
    assert stack.envoy.proc.pid == envoy_pid and stack.envoy.proc.poll() is None


def test_a_broken_fleet_file_on_reload_leaves_routing_unchanged(stack: LiveStack) -> None:
    status = stack.fleet()
    errors = stack.metric_values("gorgo_fleet_reloads_total").get('{result="error"}', 0.0)
    path = stack.router_fleet_path
    tmp = path.with_suffix(".tmp")
    tmp.write_text("replicas: [\n")
    os.replace(tmp, path)
    assert wait_for(lambda: stack.metric_values("gorgo_fleet_reloads_total").get(
        '{result="error"}', 0.0) > errors, 10, 0.1)
    after = stack.fleet()
    assert "not valid YAML" in after["last_error"]
    assert after["generation"] == status["generation"]
    assert [r["name"] for r in after["replicas"]] == [r["name"] for r in status["replicas"]]
    assert served_by(stack, "alpha", 4) <= {"near-1", "near-3"}
