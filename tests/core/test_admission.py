"""Admission control (load shedding) and the anomaly penalty."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gorgo.core.decision import SHED, Decision, Rejection
from gorgo.core.features import extract_features
from gorgo.core.fleet import parse_fleet
from gorgo.core.router import Router


def _router(**extra) -> Router:
    spec = parse_fleet({
        "regions": {"a": {"sim": {"rtt_ms": 10}}, "b": {"sim": {"rtt_ms": 100}}},
        "replicas": [
            {"name": "a0", "engine": "sim", "region": "a", "address": "127.0.0.1:1",
             "prefill_rate": 1000},
            {"name": "b0", "engine": "sim", "region": "b", "address": "127.0.0.1:2",
             "prefill_rate": 1000},
        ],
        **extra,
    })
    r = Router(spec)
    r.state.observe_rtt(0, 10.0)
    r.state.observe_rtt(1, 100.0)
    return r


def _features(r: Router, tokens: int, priority: int | None = None, text: str = "x"):
    body = json.dumps({"messages": [{"role": "user", "content": text * (4 * tokens)}]}).encode()
    headers = {} if priority is None else {"x-gorgo-priority": str(priority)}
    return extract_features("/v1/chat/completions", headers, body, r.state.tok)


def test_no_shedding_when_disabled() -> None:
    r = _router()
    assert r.spec.shedding.slo_ms == 0  # the default: admission control off
    decisions = [r.route(_features(r, 2000, priority=0, text=chr(97 + k)), 0.0)
                 for k in range(20)]
    # 20 x 2000 tokens on two 1000 tokens/s replicas: tens of seconds of predicted TTFT at the
    # lowest priority, which any SLO would shed; with shedding off every request is routed.
    assert all(isinstance(d, Decision) for d in decisions), decisions
    assert all(0 <= d.replica < r.state.n for d in decisions)
    assert decisions[-1].predicted_ms > 10_000
    assert r.shed_count == 0
    assert r.open_requests == 20


def test_sheds_only_past_the_slo_and_lowest_priority_first() -> None:
    r = _router(shedding={"slo_ms": 1500, "default_priority": 1, "priority_step": 0.5})
    # 1000 tokens at 1000 tokens/s on an idle fleet: 10 + 1000 ms, within the SLO.
    d = r.route(_features(r, 1000, text="a"), 0.0)
    assert d.predicted_ms == pytest.approx(1010.0)
    # Now both replicas have a backlog; the best is a0 or b0 at about 1000+ ms queue + 1000 ms.
    r.route(_features(r, 1000, text="b"), 0.0)
    f_low = _features(r, 1000, priority=0, text="c")
    shed = r.route(f_low, 0.0)
    assert isinstance(shed, Rejection) and shed.reason == SHED and shed.status == 429
    assert "limit 1500 ms" in shed.message and shed.retry_after_s >= 1 and shed.priority == 0
    # Priority 2: limit 1500 * (1 + 0.5 * 2) = 3000 ms: admitted.
    d = r.route(_features(r, 1000, priority=2, text="d"), 0.0)
    assert d.predicted_ms <= 3000
    assert r.shed_count == 1
    # Shed requests leave no accounting behind.
    assert r.open_requests == 3


def test_a_request_that_meets_the_slo_is_never_shed() -> None:
    r = _router(shedding={"slo_ms": 1500, "default_priority": 0})
    # Backlog: 1200 tokens on each replica (priority 10 is never shed here).
    r.route(_features(r, 1200, priority=10, text="a"), 0.0)
    r.route(_features(r, 1200, priority=10, text="b"), 0.0)
    # 1200 ms queue + 10 ms RTT + 10 tokens: within 1500 ms, admitted at the lowest priority.
    d = r.route(_features(r, 10, priority=0, text="z"), 0.0)
    assert d.predicted_ms <= 1500
    # 1200 ms queue + 400 ms prefill on the best replica: shed at the lowest priority.
    shed = r.route(_features(r, 400, priority=0, text="y"), 0.0)
    assert isinstance(shed, Rejection) and shed.reason == SHED
    assert r.shed_count == 1


def test_failed_responses_penalise_and_the_penalty_decays() -> None:
    r = _router(penalties={"error_ms": 1000, "half_life_s": 10})
    s = r.state
    s.record_failed_response(0, now=0.0)
    s.now = 0.0
    assert s.penalty()[0] == pytest.approx(1000.0)
    s.now = 10.0
    assert s.penalty()[0] == pytest.approx(500.0)
    # While penalised, a0 (10 ms RTT) loses to b0 (100 ms RTT) for a short prompt.
    d = r.route(_features(r, 10, text="p"), 10.0)
    assert d.replica == 1 and d.terms["penalty"] == 0.0
    s.now = 100.0
    assert s.penalty()[0] < 1.0
    d = r.route(_features(r, 10, text="q"), 100.0)
    assert d.replica == 0


def test_three_failed_responses_eject() -> None:
    r = _router()
    for _ in range(3):
        r.state.record_failed_response(0, now=0.0)
    assert not r.state.healthy[0]
    d = r.route(_features(r, 10, text="e"), 0.1)
    assert d.replica == 1


def test_a_fleet_back_from_an_outage_is_not_shed_for_its_failures() -> None:
    """Issue 12, finding 9: every replica failed its probes for 4 s, then came back idle. Their
    penalties (seconds of them, decaying over tens of seconds) rank them, but they are no wait:
    admission prices only the latency terms, so nothing is shed once one probe succeeds."""
    r = _router(shedding={"slo_ms": 500}, penalties={"error_ms": 1000, "half_life_s": 10})
    s = r.state
    for t in (0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5):  # both down, probed every 0.5 s
        for i in range(s.n):
            if s.probe_due(t)[i]:
                s.record_failed_probe(i, t)
    assert not s.healthy.any()
    s.now = 4.0
    assert s.penalty().min() > 3000  # far past the 500 ms SLO
    assert s.retry_at.min() > 30  # the backoff grew with every failure ...
    np.testing.assert_array_equal(s.probe_due(4.0), [True, True])  # ... none up: probe all
    s.record_success(0)  # the first probe after the outage answers
    d = r.route(_features(r, 10, text="back"), 4.0)
    assert isinstance(d, Decision) and d.replica == 0, d
    assert d.terms["penalty"] > 3000 and d.predicted_ms < 500  # reported as itself, not shed
    assert r.shed_count == 0


def test_the_penalty_still_ranks_replicas() -> None:
    r = _router(shedding={"slo_ms": 500})
    r.state.record_failed_response(0, now=0.0)
    d = r.route(_features(r, 10, text="rank"), 0.0)
    assert isinstance(d, Decision) and d.replica == 1  # a0 is nearer, but penalised
