"""The cost model's arithmetic on a small fleet: RTT + queue wait + uncached prefill, in ms."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gorgo.core.cost import CostTerms, cost_terms
from gorgo.core.features import RequestFeatures, extract_features
from gorgo.core.fleet import FleetSpec, parse_fleet
from gorgo.core.state import FleetState
from gorgo.core.weights import Weights


def spec() -> FleetSpec:
    # One character per token and 4-token blocks keep the arithmetic by hand simple.
    return parse_fleet({
        "regions": {"near": {}, "far": {}},
        "block_tokens": 4,
        "chars_per_token": 1.0,
        "replicas": [
            {"name": "a", "engine": "sim", "region": "near", "address": "h:1",
             "prefill_rate": 1000},
            {"name": "b", "engine": "sim", "region": "far", "address": "h:2", "prefill_rate": 2000},
        ],
    })


def prompt(text: str, s: FleetState) -> RequestFeatures:
    return extract_features("/v1/completions", {}, json.dumps({"prompt": text}).encode(), s.tok)


def test_exact_terms() -> None:
    s = FleetState(spec())
    s.observe_rtt(0, 10.0)
    s.observe_rtt(1, 50.0)
    s.now = 0.0
    s.add_inflight(0, prompt_tokens=500, uncached=500)  # 500 tokens waiting on a at 1000/s
    s.add_inflight(1, prompt_tokens=300, uncached=300)  # 300 tokens waiting on b at 2000/s
    shared = prompt("x" * 8, s)
    s.record_sent(1, shared, 0)  # b caches 2 blocks of the next prompt
    s.release_inflight(1, shared.prompt_tokens)
    f = prompt("x" * 8 + "y" * 12, s)  # 20 tokens
    t = cost_terms(f, s)
    np.testing.assert_allclose(t["rtt"], [10.0, 50.0])
    np.testing.assert_allclose(t["queue"], [500.0, 150.0])  # 500/1000 s, 300/2000 s
    np.testing.assert_array_equal(t.uncached_tokens, [20, 12])
    np.testing.assert_allclose(t["prefill"], [20.0, 6.0])  # 20/1000 s, 12/2000 s
    # The predicted TTFT (latency terms only); the objective's total adds the congestion term.
    np.testing.assert_allclose(t.total(Weights(), latency_only=True), [530.0, 206.0])
    np.testing.assert_allclose(t.total(Weights({"rtt": 2.0, "queue": 0.5}), latency_only=True),
                               [290.0, 181.0])
    np.testing.assert_allclose(t.total(Weights({"rtt": 0.0, "queue": 0.0}), latency_only=True),
                               [20.0, 6.0])
    np.testing.assert_allclose(t.total(Weights()), np.array([530.0, 206.0]) + t["congestion"])


def test_queue_term_follows_the_clock() -> None:
    s = FleetState(spec())
    s.now = 1.0
    s.add_inflight(0, 1000, 1000)
    f = prompt("abcd", s)
    assert cost_terms(f, s)["queue"][0] == pytest.approx(1000.0)
    s.now = 1.4  # 400 of 1000 tokens prefilled
    assert cost_terms(f, s)["queue"][0] == pytest.approx(600.0)


def test_unprobed_rtt_is_worst_known() -> None:
    s = FleetState(spec())
    s.observe_rtt(1, 80.0)
    np.testing.assert_allclose(cost_terms(prompt("a", s), s)["rtt"], [80.0, 80.0])


def test_prefill_rate_update_changes_terms() -> None:
    s = FleetState(spec())
    f = prompt("a" * 40, s)
    np.testing.assert_allclose(cost_terms(f, s)["prefill"], [40.0, 20.0])
    s.set_weights(Weights(version=1), {"a": 4000.0})
    np.testing.assert_allclose(cost_terms(f, s)["prefill"], [10.0, 20.0])


def test_memoised_per_request_and_invalidated_by_writes() -> None:
    s = FleetState(spec())
    f = prompt("a" * 12, s)
    first = cost_terms(f, s)
    assert cost_terms(f, s) is first
    other = prompt("a" * 12, s)  # equal text, different request
    assert cost_terms(other, s) is not first
    s.record_sent(0, f, 12)
    after = cost_terms(f, s)
    assert after is not first
    np.testing.assert_array_equal(after.uncached_tokens, [4, 12])  # cached whole: last block


def test_total_is_weighted_sum() -> None:
    t = CostTerms(
        values={"rtt": np.array([1.0, 2.0]), "queue": np.array([10.0, 20.0]),
                "admission": np.array([0.0, 50.0]), "prefill": np.array([100.0, 200.0]),
                "congestion": np.array([0.0, 5.0]), "penalty": np.array([0.0, 1000.0])},
        uncached_tokens=np.array([1, 2]),
    )
    np.testing.assert_allclose(t.total(Weights({"rtt": 3.0, "queue": 0.1})), [104.0, 1263.0])
