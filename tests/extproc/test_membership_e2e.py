"""Many models and membership changes with real Envoy, on one module-scoped stack per mode: cluster
mode (filesystem CDS, the router rewrites the clusters file) and endpoint-picker mode (ORIGINAL_DST:
Envoy connects to whatever IP:port the router names, so it needs no membership at all). In both,
each model reaches only its replicas, an unknown model is the router's 404, `/v1/models` lists the
fleet's models; a replica added, drained and removed under a bounded streamed load loses no
request and leaves the others' state alone, with the same Envoy process throughout; a broken fleet
file leaves routing as it was."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import yaml

from gorgo.envoy_config import PICKER_CLUSTER
from gorgo.harness.procs import wait_for
from gorgo.harness.stack import LiveStack, StackOptions, with_free_ports
from gorgo.sim.presets import fleet_document
from tests.support.e2e import http_call

pytestmark = [pytest.mark.envoy, pytest.mark.slow]

MODELS = {"near-0": ["alpha"], "near-1": ["alpha"], "near-2": ["beta"], "near-3": ["alpha"]}
FIRST = ("near-0", "near-1", "near-2")  # the router's fleet at start; near-3 is added later


@pytest.fixture(scope="module", params=["cluster", "picker"])
def stack(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    picker = request.param == "picker"
    doc = fleet_document({"near": 4}, profile="h100-llama3-8b",
                         links={"near": {"rtt_ms": 2.0, "jitter_ms": 0.2}}, name="models")
    doc["signals"] = {"probe_interval_s": 0.5, "scrape_interval_s": 0.5}
    doc["endpoint_picker"] = picker
    # Envoy's fail-open cluster: the clusters file keeps it, so near-0 (below) may leave
    doc["default_cluster"] = "near-2"
    for r in doc["replicas"]:
        r["models"] = MODELS[r["name"]]
    opts = StackOptions(policy="round-robin", stream_interval=4, cds=not picker,
                        router_replicas=FIRST)
    with LiveStack(with_free_ports(doc), tmp_path_factory.mktemp(request.param), opts) as s:
        yield s


def send(url: str, body: Any = None) -> tuple[int, dict[str, str], bytes]:
    """GET (no body) or POST JSON, read to the end: (status, lower-cased headers, raw body)."""
    return http_call(url, "GET" if body is None else "POST", body)


def call(url: str, body: Any = None) -> tuple[int, dict[str, str], Any]:
    status, headers, raw = send(url, body)
    return status, headers, json.loads(raw)


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
    # A browser's CORS preflight is the engine's to answer (the simulated one: 405), not the
    # router's list without the engine's access-control-allow-* headers.
    status, headers, raw = http_call(stack.url + "/v1/models", "OPTIONS", None)
    assert status == 405 and b"alpha" not in raw, (status, raw[:200])
    assert served_by(stack, "alpha", 6) == {"near-0", "near-1"}
    assert served_by(stack, "beta", 3) == {"near-2"}
    status, headers, err = call(stack.url + "/v1/chat/completions", chat("gamma"))
    assert status == 404 and err["error"]["code"] == "model_not_found"
    assert "alpha, beta" in err["error"]["message"] and "x-gorgo-replica" not in headers


def stream(url: str, body: dict[str, Any]) -> tuple[int, dict[str, str], bool]:
    """POST a streamed request and read it to its end: (status, headers, ended with [DONE])."""
    status, headers, raw = send(url, dict(body, stream=True))
    return status, headers, status == 200 and raw.endswith(b"data: [DONE]\n\n")


class Answer(NamedTuple):
    sent: float  # monotonic, when the request left the client
    status: int
    done: bool  # the stream ended with [DONE]
    replica: str  # the router's pick (x-gorgo-replica)
    served_by: str  # the replica that answered (the simulated engine's x-gorgo-served-by)


class Load:
    """Three clients streaming `alpha` requests back to back until stopped (at most ``limit``)."""

    def __init__(self, stack: LiveStack, limit: int = 400) -> None:
        self.stack = stack
        self.limit = limit
        self.answers: list[Answer] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(c,)) for c in range(3)]

    def _run(self, client: int) -> None:
        k = 0
        while not self._stop.is_set() and len(self.answers) < self.limit:
            sent = time.monotonic()
            body = dict(chat("alpha", f"client {client} turn {k % 4} " * 30), max_tokens=8)
            status, headers, done = stream(self.stack.url + "/v1/chat/completions", body)
            self.answers.append(Answer(sent, status, done, headers.get("x-gorgo-replica", ""),
                                       headers.get("x-gorgo-served-by", "")))
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
        """The replicas that answered a request sent at ``t0`` or later."""
        return {a.served_by for a in self.answers if a.sent >= t0}


def _replica(status: dict[str, Any], name: str) -> dict[str, Any]:
    return next(r for r in status["replicas"] if r["name"] == name)


def _assert_kept(before: dict[str, Any], after: dict[str, Any], names: tuple[str, ...]) -> None:
    """The named replicas kept their RTT samples and prefix blocks across a membership change."""
    for name in names:
        old, kept = _replica(before, name), _replica(after, name)
        assert kept["rtt_samples"] >= old["rtt_samples"] and kept["rtt_ms"] is not None, name
        assert kept["prefix_blocks"] >= old["prefix_blocks"], name


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
        _assert_kept(before, stack.fleet(), ("near-1", "near-2"))
        # Drain while near-0 has a stream open: that stream must still end with [DONE].
        assert wait_for(lambda: _replica(stack.fleet(), "near-0")["inflight"] > 0, 20, 0.01)
        stack.fleet("POST", "/replicas/near-0/drain", {"drain": True})
        drained_at = time.monotonic()
        assert wait_for(lambda: len(load.served_since(drained_at)) >= 1
                        and _replica(stack.fleet(), "near-0")["inflight"] == 0, 20, 0.1)
        out = stack.fleet("DELETE", "/replicas/near-0")
        assert out["removed"] == ["near-0"]
        removed_at = time.monotonic()
        assert wait_for(lambda: len([a for a in load.answers if a[0] >= removed_at]) >= 6,
                        20, 0.1)
    # Removing near-0 moved the others down one index: their state moved with them.
    _assert_kept(before, stack.fleet(), ("near-1", "near-2"))
    bad = [a for a in load.answers if (a.status, a.done) != (200, True)]
    assert load.answers and not bad, bad[:5]
    assert all(a.served_by == a.replica for a in load.answers)  # Envoy went where it was told
    assert "near-0" not in load.served_since(drained_at)
    assert load.served_since(removed_at) <= {"near-1", "near-3"}
    assert 'replica="near-0"' not in stack.router_metrics()
    if stack.spec.endpoint_picker:
        # Envoy has no cluster for near-3: every request went through the original-destination
        # cluster, to the address the router named.
        key = f"cluster.{PICKER_CLUSTER}.upstream_rq_completed"
        assert stack.envoy.stats(key).get(key, 0) >= len(load.answers)
    else:
        assert stack.cds_path is not None and "near-0" not in stack.cds_path.read_text()
        # near-2's cluster is where Envoy's routes fail open to: it stays in the clusters file
        with pytest.raises(urllib.error.HTTPError) as refused:
            stack.fleet("DELETE", "/replicas/near-2")
        assert refused.value.code == 400
        assert "default_cluster: 'near-2'" in refused.value.read().decode()
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
