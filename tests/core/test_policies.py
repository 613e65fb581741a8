"""Each policy on small hand-built states, plus the shared masking and tie-break."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from gorgo.core.decision import NoReplicaAvailable, next_best
from gorgo.core.features import RequestFeatures, extract_features
from gorgo.core.fleet import FleetSpec, parse_fleet
from gorgo.core.policies import REGISTRY, make_policy
from gorgo.core.policies.base import PolicyBase, retry_after
from gorgo.core.policies.gorgo import Gorgo
from gorgo.core.policies.least_request import LeastRequest
from gorgo.core.policies.round_robin import RoundRobin
from gorgo.core.state import FAILURES_TO_EJECT, FleetState
from gorgo.core.weights import Weights


def spec(n: int = 3) -> FleetSpec:
    return parse_fleet({
        "regions": {"local": {}},
        "block_tokens": 4,
        "chars_per_token": 1.0,
        "replicas": [
            {"name": f"r{i}", "engine": "sim", "region": "local", "address": f"h:{i + 1}",
             "prefill_rate": 1000}
            for i in range(n)
        ],
    })


def prompt(text: str, s: FleetState) -> RequestFeatures:
    return extract_features("/v1/completions", {}, json.dumps({"prompt": text}).encode(), s.tok)


def eject(s: FleetState, i: int, now: float = 0.0) -> None:
    for _ in range(FAILURES_TO_EJECT):
        s.record_failure(i, now)


def test_registry_and_factory() -> None:
    assert {"round-robin", "least-request", "gorgo"} <= set(REGISTRY)
    assert isinstance(make_policy("gorgo", spec()), Gorgo)
    assert isinstance(make_policy("round-robin", spec()), RoundRobin)
    assert isinstance(make_policy("least-request", spec()), LeastRequest)
    with pytest.raises(ValueError, match="unknown policy 'no-such'"):
        make_policy("no-such", spec())


# --- round-robin ----------------------------------------------------------------------------


def test_round_robin_cycles() -> None:
    s = FleetState(spec())
    p = RoundRobin(s.spec)
    f = prompt("x", s)
    picks = [p.choose(f, s).replica for _ in range(9)]
    assert picks == [0, 1, 2] * 3
    assert p.choose(f, s).policy == "round-robin"


def test_round_robin_ignores_load_and_cache() -> None:
    s = FleetState(spec())
    p = RoundRobin(s.spec)
    f = prompt("abcdefgh", s)
    s.record_sent(0, f, 8)
    s.add_inflight(1, 10**6, 10**6)
    assert [p.choose(f, s).replica for _ in range(3)] == [0, 1, 2]


def test_round_robin_skips_unhealthy() -> None:
    s = FleetState(spec())
    eject(s, 1)
    p = RoundRobin(s.spec)
    f = prompt("x", s)
    picks = [p.choose(f, s).replica for _ in range(12)]
    assert 1 not in picks
    assert set(picks) == {0, 2}


def test_round_robin_shares_evenly_around_an_ejected_replica() -> None:
    s = FleetState(spec())
    eject(s, 1)
    p = RoundRobin(s.spec)
    f = prompt("x", s)
    counts = Counter(p.choose(f, s).replica for _ in range(12))
    assert counts == {0: 6, 2: 6}


# --- least-request --------------------------------------------------------------------------


def test_least_request_picks_fewest_in_flight() -> None:
    s = FleetState(spec())
    s.add_inflight(0, 1, 1)
    s.add_inflight(0, 1, 1)
    s.add_inflight(1, 1, 1)
    s.add_inflight(2, 1, 1)
    s.add_inflight(2, 1, 1)
    p = LeastRequest(s.spec)
    d = p.choose(prompt("x", s), s)
    assert d.replica == 1
    assert d.policy == "least-request"
    np.testing.assert_array_equal(d.scores, [2.0, 1.0, 2.0])


def test_least_request_skips_unhealthy() -> None:
    s = FleetState(spec())
    s.add_inflight(0, 1, 1)
    s.add_inflight(2, 1, 1)
    eject(s, 1)
    d = LeastRequest(s.spec).choose(prompt("x", s), s)
    assert d.replica in (0, 2)
    assert d.scores is not None and d.scores[1] == np.inf


# --- gorgo ----------------------------------------------------------------------------------


def test_gorgo_picks_lowest_cost() -> None:
    s = FleetState(spec())
    s.observe_rtt(0, 100.0)
    s.observe_rtt(1, 10.0)
    s.observe_rtt(2, 20.0)
    f = prompt("a" * 400, s)  # 400 ms of prefill anywhere uncached
    d = Gorgo(s.spec).choose(f, s)
    assert d.replica == 1
    assert d.policy == "gorgo"
    np.testing.assert_allclose(d.scores, [500.0, 410.0, 420.0])


def test_gorgo_prefers_cache_over_small_rtt_gap() -> None:
    s = FleetState(spec())
    for i, rtt in enumerate((10.0, 30.0, 10.0)):
        s.observe_rtt(i, rtt)
    f = prompt("a" * 400, s)
    s.record_sent(1, f, 400)
    s.release_inflight(1, f.prompt_tokens)
    s.now = 10.0  # the earlier request's prefill has drained
    assert Gorgo(s.spec).choose(f, s).replica == 1  # 30 ms vs 10 + 400 ms


def test_gorgo_avoids_queue() -> None:
    s = FleetState(spec())
    for i in range(3):
        s.observe_rtt(i, 5.0)
    s.add_inflight(0, 2000, 2000)  # 2 s of queued prefill
    s.add_inflight(2, 500, 500)
    assert Gorgo(s.spec).choose(prompt("q" * 10, s), s).replica == 1


def test_gorgo_uses_state_weights() -> None:
    s = FleetState(spec(2))
    s.observe_rtt(0, 100.0)
    s.observe_rtt(1, 10.0)
    s.add_inflight(1, 200, 200)  # 200 ms queue on the near replica
    f = prompt("z", s)
    p = Gorgo(s.spec)
    assert p.choose(f, s).replica == 0  # 100 + 0 + 1 vs 10 + 200 + 1
    s.set_weights(Weights({"rtt": 1.0, "queue": 0.0}, version=2))
    assert p.choose(f, s).replica == 1  # 101 vs 11
    s.set_weights(Weights({"rtt": 3.0, "queue": 1.0}, version=3))
    assert p.choose(f, s).replica == 1  # 301 vs 231
    s.set_weights(Weights({"rtt": 0.0, "queue": 1.0}, version=4))
    assert p.choose(f, s).replica == 0  # 1 vs 201


def test_gorgo_skips_unhealthy_even_when_cheapest() -> None:
    s = FleetState(spec())
    s.observe_rtt(0, 1.0)
    s.observe_rtt(1, 50.0)
    s.observe_rtt(2, 90.0)
    eject(s, 0)
    assert Gorgo(s.spec).choose(prompt("x", s), s).replica == 1


# --- shared plumbing ------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [Gorgo, LeastRequest])
def test_tie_break_rotates(cls: type[PolicyBase]) -> None:
    s = FleetState(spec())
    p = cls(s.spec)
    f = prompt("x", s)
    picks = [p.choose(f, s).replica for _ in range(6)]  # state unchanged: a 3-way tie
    assert sorted(picks) == [0, 0, 1, 1, 2, 2]
    assert picks[0] != picks[1]


def test_ties_rotate_among_themselves_whatever_the_choices_between_them() -> None:
    # the rotation counted every choice: a tie after each untied one always fell on one index
    s = FleetState(spec(2))
    p = LeastRequest(s.spec)
    f = prompt("x", s)
    picks = []
    for _ in range(10):
        picks.append(p.choose(f, s).replica)  # a tie
        s.add_inflight(0, 1, 1)
        p.choose(f, s)  # no tie: r1
        s.release_inflight(0, 1, 1)
    assert sorted(picks) == [0] * 5 + [1] * 5


def test_each_set_of_tied_replicas_rotates_on_its_own() -> None:
    # one counter for every set: two models' ties, alternating, each fell on one replica
    s = FleetState(spec(4))
    p = PolicyBase(s.spec)
    alpha, beta = np.array([0.0, 0.0, np.inf, np.inf]), np.array([np.inf, np.inf, 0.0, 0.0])
    picks = [p.pick_lowest(scores, s).replica for _ in range(10) for scores in (alpha, beta)]
    assert Counter(picks) == {0: 5, 1: 5, 2: 5, 3: 5}


def test_tie_break_only_among_tied() -> None:
    s = FleetState(spec())
    s.add_inflight(1, 1, 1)
    p = LeastRequest(s.spec)
    f = prompt("x", s)
    picks = [p.choose(f, s).replica for _ in range(4)]
    assert set(picks) == {0, 2}


def test_pick_lowest_tolerates_float_noise() -> None:
    s = FleetState(spec())
    p = PolicyBase(s.spec)
    picks = {p.pick_lowest(np.array([1.0, 1.0 + 1e-12, 5.0]), s).replica for _ in range(4)}
    assert picks == {0, 1}


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_no_replica_available_when_all_ejected(name: str) -> None:
    s = FleetState(spec())
    s.now = 100.0
    for i in range(3):
        eject(s, i, now=100.0)
    for _ in range(3):
        s.record_failure(2, now=100.0)  # a longer backoff on one of them
    with pytest.raises(NoReplicaAvailable) as info:
        make_policy(name, s.spec).choose(prompt("x", s), s)
    assert info.value.retry_after_s == pytest.approx(1.0)  # the earliest retry
    assert "retry after 1 s" in str(info.value)


def test_retry_after_is_at_least_one_second() -> None:
    s = FleetState(spec())
    for i in range(2):
        eject(s, i, now=0.0)
        s.record_failure(i, now=0.0)
        s.record_failure(i, now=0.0)  # retry at 4 s
    s.now = 1.5
    s.candidates = np.array([True, True, False])  # r2 healthy, but serves another model
    assert retry_after(s) == pytest.approx(2.5)  # not 1 s: r2 is no reason to come back
    s.candidates = None
    eject(s, 2, now=0.0)
    s.record_failure(2, now=0.0)
    s.record_failure(2, now=0.0)  # all ejected till 4 s, and all probed every interval
    assert retry_after(s) == pytest.approx(s.spec.signals.probe_interval_s)  # all probed
    s.now = 3.9
    assert retry_after(s) == 1.0


@pytest.mark.parametrize(("name", "fleet"), [
    *((name, {}) for name in sorted(REGISTRY)),
    ("gorgo", {"objective": "slo", "slo": {"ttft_ms": 500}}),
])
def test_every_policy_leaves_a_retry_replica_while_another_is_routable(
        name: str, fleet: dict) -> None:
    # Envoy retries a failed attempt on `next_best`: no fallback sent the 503 to the client.
    doc = {"regions": {"local": {}}, "block_tokens": 4, "chars_per_token": 1.0, **fleet,
           "replicas": [{"name": f"r{i}", "engine": "sim", "region": "local",
                         "address": f"h:{i + 1}", "prefill_rate": 1000 if i == 0 else 100}
                        for i in range(3)]}  # slow ones: irb weights them 0, an SLO misses
    s = FleetState(parse_fleet(doc))
    policy = make_policy(name, s.spec)
    s.prefix.insert(0, prompt("a" * 400, s).block_hashes)  # cached on r0 only
    d = policy.choose(prompt("a" * 400 + "b" * 40, s), s)
    d.id = "d-1"
    j = next_best(d)
    assert j is not None and j != d.replica


def test_retry_after_one_probe_interval_while_the_only_healthy_replicas_drain() -> None:
    s = FleetState(spec())
    s.draining[:] = [True, True, False]
    for _ in range(3):
        eject(s, 2, now=0.0)  # a long backoff: the fleet probes it each interval all the same
    s.now = 0.5
    assert retry_after(s) == pytest.approx(s.spec.signals.probe_interval_s)
    s.now = 50.0  # backoff over, not yet re-probed
    assert retry_after(s) == 1.0
    with pytest.raises(NoReplicaAvailable) as info:
        Gorgo(s.spec).choose(prompt("x", s), s)
    assert info.value.retry_after_s >= 1.0
