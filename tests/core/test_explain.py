"""explain() reports every replica's terms without changing routing state."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from gorgo.core.decision import Decision
from gorgo.core.explain import explain
from gorgo.core.features import extract_features
from gorgo.core.fleet import parse_fleet
from gorgo.core.policies import REGISTRY
from gorgo.core.router import Router


def _router() -> Router:
    spec = parse_fleet({
        "regions": {"a": {"sim": {"rtt_ms": 10}}, "b": {"sim": {"rtt_ms": 200}}},
        "replicas": [{"name": "a0", "engine": "sim", "region": "a", "address": "127.0.0.1:1",
                      "prefill_rate": 1000},
                     {"name": "b0", "engine": "sim", "region": "b", "address": "127.0.0.1:2",
                      "prefill_rate": 1000}],
    })
    r = Router(spec)
    r.state.observe_rtt(0, 10.0)
    r.state.observe_rtt(1, 200.0)
    return r


def test_explain_names_winner_and_leaves_state_alone() -> None:
    r = _router()
    body = json.dumps({"messages": [{"role": "user", "content": "x" * 4000}]}).encode()
    f = extract_features("/v1/chat/completions", {}, body, r.state.tok)
    exp = explain(r, f, 0.0)
    assert exp.winner == "a0"
    rows = {row["replica"]: row for row in exp.rows}
    assert rows["a0"]["rtt_ms"] == 10.0 and rows["b0"]["rtt_ms"] == 200.0
    assert rows["a0"]["prefill_ms"] == 1000.0  # 1000 tokens at 1000 tokens/s
    assert "a0 wins" in exp.reason and "mostly rtt" in exp.reason
    assert r.open_requests == 0 and r.state.inflight_reqs.sum() == 0
    assert "a0" in exp.table()


def test_explain_when_nothing_is_routable() -> None:
    r = _router()
    r.state.healthy[:] = False
    f = extract_features("/v1/models", {}, b"", r.state.tok)
    exp = explain(r, f, 0.0)
    assert exp.winner is None and "no replica" in exp.reason


def test_explain_says_when_routing_sheds_the_request() -> None:
    spec = parse_fleet({"regions": {"a": {}}, "chars_per_token": 1.0, "shedding": {"slo_ms": 10},
                        "replicas": [{"name": "r0", "engine": "sim", "region": "a",
                                      "address": "127.0.0.1:1", "prefill_rate": 1000}]})
    r = Router(spec)
    body = json.dumps({"prompt": "x" * 400}).encode()  # 400 ms of prefill, past the 10 ms SLO
    f = extract_features("/v1/completions", {}, body, r.state.tok)
    exp = explain(r, f, 1.0)
    assert exp.winner is None and "refuses it (429)" in exp.reason
    assert r.shed_count == 0  # explaining sheds nothing
    assert r.route(f, 1.0).status == 429 and r.shed_count == 1


def test_explain_considers_only_the_replicas_routing_would() -> None:
    """A replica too small for the request, or not serving its model, never wins the
    explanation: it skipped the model and KV checks, so it named replicas routing never chose,
    and explained a request routing refuses."""
    spec = parse_fleet({
        "regions": {"a": {}, "b": {}},
        "chars_per_token": 1.0,
        "replicas": [{"name": "near", "engine": "sim", "region": "a", "address": "h:1",
                      "prefill_rate": 1000, "kv_capacity_tokens": 1000,
                      "models": ["m", "small"]},
                     {"name": "far", "engine": "sim", "region": "b", "address": "h:2",
                      "prefill_rate": 1000, "kv_capacity_tokens": 5000, "models": ["m"]}],
    })
    r = Router(spec)
    r.state.observe_rtt(0, 10.0)
    r.state.observe_rtt(1, 200.0)

    def explained(prompt: int, max_tokens: int, model: str = "m") -> tuple[str | None, str]:
        body = {"model": model, "prompt": "x" * prompt, "max_tokens": max_tokens}
        f = extract_features("/v1/completions", {}, json.dumps(body).encode(), r.state.tok)
        exp = explain(r, f, 0.0)
        d = r.route(f, 0.0)
        routed = r.state.names[d.replica] if isinstance(d, Decision) else None
        if isinstance(d, Decision):
            r.complete(d.id)
        assert exp.winner == routed
        return exp.winner, exp.reason

    assert explained(100, 100)[0] == "near"
    assert explained(900, 400)[0] == "far"  # 1300 tokens: only far's pool holds them
    winner, reason = explained(4000, 2000)
    assert winner is None and "refuses it (400)" in reason and "holds 5000" in reason
    winner, reason = explained(100, 100, model="other")
    assert winner is None and "refuses it (404)" in reason


def _routes(policy: str, explaining: bool) -> list[int]:
    base = _router().spec
    r = Router(replace(base, policy=policy))
    r.state.observe_rtt(0, 10.0)
    r.state.observe_rtt(1, 200.0)
    r.tick(0.0)
    out = []
    for k in range(10):
        text = f"user {k % 3} " + "y" * (400 * (k % 4 + 1))
        headers = {"x-session-id": f"s{k % 3}"} if k % 2 == 0 else {}
        body = json.dumps({"messages": [{"role": "user", "content": text}]}).encode()
        f = extract_features("/v1/chat/completions", headers, body, r.state.tok)
        now = 0.3 * k
        if explaining:
            explain(r, f, now)
            explain(r, f, now)
        d = r.route(f, now)
        out.append(d.replica)
        r.tick(now)
        if k % 2:
            r.complete(d.id)
    return out


@pytest.mark.parametrize("policy", sorted(REGISTRY))
def test_explaining_changes_no_decision(policy: str) -> None:
    """Explain decides on a deep copy: generators (random, irb), cursors and counters stay put."""
    assert _routes(policy, explaining=True) == _routes(policy, explaining=False)
