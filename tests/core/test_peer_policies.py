"""Peer policies on small hand-built states: each rule, its thresholds and its tie handling."""

from __future__ import annotations

import json
import string
from collections import Counter
from typing import Any

import numpy as np
import pytest

from gorgo.core.features import (
    EMPTY_HASHES,
    POLICY_HEADER,
    SESSION_HEADER,
    RequestFeatures,
    extract_features,
)
from gorgo.core.fleet import FleetSpec, parse_fleet
from gorgo.core.policies import REGISTRY, make_policy
from gorgo.core.policies.base import PolicyBase
from gorgo.core.policies.cache_aware import CacheAware
from gorgo.core.policies.cache_aware_tree import CacheAwareTree
from gorgo.core.policies.gorgo_paper import GorgoPaper
from gorgo.core.policies.irb import Irb, Plan, solve_weights
from gorgo.core.policies.kv_cost import KvCost
from gorgo.core.policies.least_load import LeastLoad
from gorgo.core.policies.prefix_cache import PrefixCache
from gorgo.core.policies.random_choice import RandomChoice
from gorgo.core.policies.session_affinity import SessionAffinity
from gorgo.core.router import Router
from gorgo.core.state import FAILURES_TO_EJECT, FleetState

PEERS = {"random", "least-load", "session-affinity", "prefix-cache", "cache-aware",
         "cache-aware-tree", "kv-cost", "gorgo-paper", "irb"}


def spec(n: int = 3, rates: list[float] | None = None, **extra: Any) -> FleetSpec:
    rates = rates or [1000.0] * n
    kv = extra.pop("kv", 4000)
    return parse_fleet({
        "regions": {"local": {}},
        "block_tokens": 4,
        "chars_per_token": 1.0,
        "replicas": [
            {"name": f"r{i}", "engine": "sim", "region": "local", "address": f"h:{i + 1}",
             "prefill_rate": rates[i], "kv_capacity_tokens": kv}
            for i in range(n)
        ],
        **extra,
    })


def text(n: int, seed: int = 0) -> str:
    """``n`` characters that share no block with text of another seed."""
    rng = np.random.default_rng(seed)
    return "".join(rng.choice(list(string.ascii_letters), n))


def req(body: str, s: FleetState, session: str | None = None) -> RequestFeatures:
    """A completion of ``body`` asking for one token (without max_tokens, the API's 16 would
    not fit the tests' 17-token KV pools beside a 16-token prompt)."""
    headers = {SESSION_HEADER: session} if session else {}
    raw = json.dumps({"prompt": body, "max_tokens": 1}).encode()
    return extract_features("/v1/completions", headers, raw, s.tok)


def keyed(session: str) -> RequestFeatures:
    """A bare request with a session key, for tests that hash thousands of keys."""
    return RequestFeatures("completions", None, False, None, session, 1, 1, EMPTY_HASHES)


def cache(s: FleetState, i: int, body: str) -> None:
    """Replica i caches ``body``'s blocks and holds nothing in flight or queued."""
    f = req(body, s)
    s.record_sent(i, f, f.prompt_tokens)
    s.release_inflight(i, f.prompt_tokens)
    s.backlog_tokens[i] = 0.0


def eject(s: FleetState, i: int) -> None:
    for _ in range(FAILURES_TO_EJECT):
        s.record_failure(i, s.now)


def test_registry_has_every_peer() -> None:
    assert set(REGISTRY) >= PEERS
    for name in PEERS:
        p = make_policy(name, spec())
        assert p.name == name
        assert isinstance(p, PolicyBase)


@pytest.mark.parametrize("name", sorted(PEERS))
def test_scores_are_what_was_ranked(name: str) -> None:
    s = FleetState(spec(4))
    for i, rtt in enumerate((30.0, 10.0, 20.0, 40.0)):
        s.observe_rtt(i, rtt)
    body = text(40, 1)
    cache(s, 2, body)
    s.add_inflight(0, 30, 30)
    eject(s, 3)
    p = make_policy(name, s.spec)
    d = p.choose(req(body, s, session="abc"), s)
    assert d.policy == name
    assert d.scores is not None and d.scores.shape == (4,)
    assert d.scores[3] == np.inf  # ejected
    assert d.scores[d.replica] == d.scores[:3].min()


def test_refresh_hook_defaults() -> None:
    s = FleetState(spec())
    for name in REGISTRY:
        p = make_policy(name, s.spec)
        p.refresh(s)
        assert p.refresh_interval_s >= 0
    assert PolicyBase.refresh_interval_s == 0
    assert Irb.refresh_interval_s > 0


# --- random ---------------------------------------------------------------------------------


def test_random_is_seeded_by_fleet_name_and_uniform() -> None:
    s = FleetState(spec(4))
    f = req("x", s)
    p1, p2 = RandomChoice(s.spec), RandomChoice(s.spec)
    picks1 = [p1.choose(f, s).replica for _ in range(4000)]
    picks2 = [p2.choose(f, s).replica for _ in range(4000)]
    assert picks1 == picks2
    counts = Counter(picks1)
    assert all(850 < counts[i] < 1150 for i in range(4))
    other = RandomChoice(spec(4, name="other"))
    assert [other.choose(f, s).replica for _ in range(50)] != picks1[:50]


def test_random_skips_unroutable() -> None:
    s = FleetState(spec(3))
    eject(s, 0)
    p = RandomChoice(s.spec)
    assert set(p.choose(req("x", s), s).replica for _ in range(200)) == {1, 2}


# --- least-load -----------------------------------------------------------------------------


def test_least_load_counts_tokens_not_requests() -> None:
    s = FleetState(spec(3))
    s.add_inflight(0, 5000, 0)  # one long prompt
    for _ in range(5):
        s.add_inflight(1, 300, 0)  # five short ones
    s.add_inflight(2, 1000, 0)
    s.add_inflight(2, 1000, 0)
    d = LeastLoad(s.spec).choose(req("x", s), s)
    assert d.replica == 1  # least-request would pick replica 0
    np.testing.assert_array_equal(d.scores, [5000, 1500, 2000])


# --- session-affinity -----------------------------------------------------------------------


def test_session_affinity_sticks_whatever_the_load() -> None:
    s = FleetState(spec(5))
    p = SessionAffinity(s.spec)
    first = p.choose(req("hello", s, session="user-7"), s).replica
    for k in range(30):
        s.add_inflight(first, 10_000, 10_000)
        assert p.choose(req(f"turn {k}", s, session="user-7"), s).replica == first
    assert SessionAffinity(s.spec).choose(req("x", s, session="user-7"), s).replica == first


def test_session_affinity_spreads_keys() -> None:
    s = FleetState(spec(4))
    p = SessionAffinity(s.spec)
    counts = Counter(p.choose(keyed(f"s{k}"), s).replica for k in range(4000))
    assert all(850 < counts[i] < 1150 for i in range(4))


def test_session_affinity_without_session_hashes_the_first_256_tokens() -> None:
    s = FleetState(spec(8))
    p = SessionAffinity(s.spec)
    head = text(256, 3)
    picks = {p.choose(req(head + text(50, k + 10), s), s).replica for k in range(20)}
    assert len(picks) == 1  # same head, different tails
    heads = {p.choose(req(text(300, k + 100), s), s).replica for k in range(40)}
    assert len(heads) > 3


def test_session_affinity_moves_only_the_ejected_replicas_keys() -> None:
    s = FleetState(spec(10))
    p = SessionAffinity(s.spec)
    keys = [f"k{k}" for k in range(2000)]
    before = [p.choose(keyed(k), s).replica for k in keys]
    eject(s, 3)
    after = [p.choose(keyed(k), s).replica for k in keys]
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    assert moved and all(b == 3 for b, _ in moved)
    assert len(moved) == before.count(3)
    assert len({a for _, a in moved}) > 5  # its keys spread, not dumped on one neighbour
    s.record_success(3)
    assert [p.choose(keyed(k), s).replica for k in keys] == before


def test_session_affinity_adding_a_replica_moves_keys_only_to_it() -> None:
    s10, s11 = FleetState(spec(10)), FleetState(spec(11))
    p10, p11 = SessionAffinity(s10.spec), SessionAffinity(s11.spec)
    keys = [f"k{k}" for k in range(2000)]
    old = [p10.choose(keyed(k), s10).replica for k in keys]
    new = [p11.choose(keyed(k), s11).replica for k in keys]
    changed = [n for o, n in zip(old, new, strict=True) if o != n]
    assert changed and set(changed) == {10}
    assert 100 < len(changed) < 280  # about 1/11 of the keys


# --- prefix-cache (AIBrix) ------------------------------------------------------------------


def test_prefix_cache_imbalance_switch_is_more_than_eight() -> None:
    body = text(40, 1)
    for running, expect in (([8, 0, 5], 0), ([9, 0, 5], 1)):
        s = FleetState(spec(3))
        cache(s, 0, body)
        s.inflight_reqs[:] = running
        d = PrefixCache(s.spec).choose(req(body, s), s)
        assert d.replica == expect, running


def test_prefix_cache_mean_plus_one_sd_filter() -> None:
    body = text(40, 2)  # 10 blocks
    s = FleetState(spec(4))
    cache(s, 0, body)  # 100 %
    cache(s, 2, body[:20])  # 50 %
    cache(s, 3, body[:12])  # 30 %
    # mean 2.5, sample sd sqrt(7) = 2.65: limit 5.15, so replica 0 (6 running) is skipped.
    s.inflight_reqs[:] = [6, 0, 3, 1]
    d = PrefixCache(s.spec).choose(req(body, s), s)
    assert d.replica == 2
    assert d.scores[0] == np.inf and d.scores[1] == np.inf  # overloaded; no match
    assert d.scores[2] == pytest.approx(50 + 3 / 7)
    assert d.scores[3] == pytest.approx(70 + 1 / 7)
    s.inflight_reqs[:] = [5, 0, 3, 2]  # mean 2.5, sd 2.08: limit 4.58, 5 still over
    assert PrefixCache(s.spec).choose(req(body, s), s).replica == 2
    s.inflight_reqs[:] = [4, 0, 3, 2]  # mean 2.25, sd 1.71: limit 3.96, 4 still over
    assert PrefixCache(s.spec).choose(req(body, s), s).replica == 2
    s.inflight_reqs[:] = [4, 1, 3, 4]  # mean 3, sd 1.41: limit 4.41, 4 passes
    assert PrefixCache(s.spec).choose(req(body, s), s).replica == 0


def test_prefix_cache_integer_percent_then_fewest_running() -> None:
    body = text(12, 4)  # 3 blocks
    s = FleetState(spec(3))
    cache(s, 0, body[:8])  # 66 %
    cache(s, 1, body[:8])  # 66 %
    cache(s, 2, body[:4])  # 33 %
    s.inflight_reqs[:] = [2, 1, 0]
    d = PrefixCache(s.spec).choose(req(body, s), s)
    assert d.replica == 1  # tied percentage: fewer running
    np.testing.assert_allclose(d.scores, [34 + 2 / 3, 34 + 1 / 3, 67.0])


def test_prefix_cache_no_match_is_least_request() -> None:
    s = FleetState(spec(3))
    cache(s, 0, text(40, 5))
    s.inflight_reqs[:] = [3, 1, 2]
    d = PrefixCache(s.spec).choose(req(text(40, 6), s), s)
    assert d.replica == 1
    np.testing.assert_array_equal(d.scores, [3, 1, 2])


def test_prefix_cache_running_uses_fresh_scrapes_only() -> None:
    body = text(40, 7)
    s = FleetState(spec(3))
    cache(s, 0, body)
    s.now = 100.0
    s.observe_engine(0, 100.0, queue_reqs=0, running_reqs=20, kv_usage=0.1)  # another router
    assert PrefixCache(s.spec).choose(req(body, s), s).replica != 0  # 20 - 0 > 8
    s.now = 100.0 + s.spec.signals.metrics_stale_s + 1
    assert PrefixCache(s.spec).choose(req(body, s), s).replica == 0  # stale: own count (0)


# --- cache-aware (SGLang) -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("loads", "imbalanced"),
    [
        ([70, 5, 0], True),  # 70 > 64 and 70 > 0
        ([64, 5, 0], False),  # 64 is not > 64
        ([200, 150, 100], True),  # 100 > 64 and 200 > 150
        ([240, 200, 170], False),  # 70 > 64 but 240 <= 1.5 * 170
        ([150, 120, 100], False),  # 50 <= 64
    ],
)
def test_cache_aware_imbalance_needs_both_thresholds(loads: list[int], imbalanced: bool) -> None:
    body = text(40, 8)
    s = FleetState(spec(3))
    cache(s, 0, body)
    s.inflight_reqs[:] = loads
    d = CacheAware(s.spec).choose(req(body, s), s)
    assert d.replica == (int(np.argmin(loads)) if imbalanced else 0)
    if imbalanced:
        np.testing.assert_array_equal(d.scores, loads)


def test_cache_aware_imbalance_counts_unhealthy_workers() -> None:
    body = text(40, 9)
    s = FleetState(spec(3))
    cache(s, 0, body)
    s.inflight_reqs[:] = [70, 10, 0]
    eject(s, 2)  # idle and ejected: SGLang still counts its load of 0
    assert CacheAware(s.spec).choose(req(body, s), s).replica == 1


def miss_state() -> tuple[FleetState, str]:
    """A prompt whose best match (replica 1, 3 of 10 blocks) is a miss: rate 0.3, not above.
    Replica 2 holds the smallest tree but the most requests in flight."""
    body = text(40, 10)  # 40 tokens
    s = FleetState(spec(3))
    cache(s, 0, text(24, 11))  # 6 unrelated blocks
    cache(s, 1, body[:12])
    cache(s, 2, text(8, 12))  # 2 unrelated blocks
    s.inflight_reqs[:] = [1, 3, 5]
    return s, body


def test_cache_aware_miss_goes_to_the_least_loaded_worker() -> None:
    s, body = miss_state()
    d = CacheAware(s.spec).choose(req(body, s), s)
    assert d.replica == 0  # fewest in flight, although its tree is the largest
    np.testing.assert_array_equal(d.scores, [1, 3, 5])
    s.inflight_reqs[:] = [2, 2, 5]
    policy = CacheAware(s.spec)
    assert {policy.choose(req(body, s), s).replica for _ in range(2)} == {0, 1}  # ties rotate
    cache(s, 1, body[:16])  # 4 blocks: rate 0.4, a hit
    d = CacheAware(s.spec).choose(req(body, s), s)
    assert d.replica == 1
    np.testing.assert_allclose(d.scores, [1.0, 0.6, 1.0])


def test_cache_aware_tree_variant_miss_goes_to_the_smallest_tree() -> None:
    s, body = miss_state()
    d = CacheAwareTree(s.spec).choose(req(body, s), s)
    assert d.policy == "cache-aware-tree"
    assert d.replica == 2  # smallest tree, although it has the most in flight
    np.testing.assert_array_equal(d.scores, [6, 3, 2])
    cache(s, 1, body[:16])  # the hit and the imbalance paths are cache-aware's
    assert CacheAwareTree(s.spec).choose(req(body, s), s).replica == 1
    s.inflight_reqs[:] = [70, 5, 0]
    assert CacheAwareTree(s.spec).choose(req(body, s), s).replica == 2


def test_cache_aware_skips_an_unhealthy_best_match() -> None:
    body = text(40, 13)
    s = FleetState(spec(3))
    cache(s, 0, body)
    cache(s, 1, body[:20])
    eject(s, 0)
    assert CacheAware(s.spec).choose(req(body, s), s).replica == 1


# --- kv-cost (Dynamo) -----------------------------------------------------------------------


def dynamo_state() -> tuple[FleetState, RequestFeatures]:
    s = FleetState(spec(3, kv=400))  # 100 blocks each
    body = text(20, 14)  # 20 tokens, 5 blocks
    cache(s, 0, body[:12])  # 3 blocks cached
    s.now = 100.0
    s.add_inflight(1, 40, 0)  # 10 active blocks, nothing to prefill
    s.add_inflight(2, 8, 8)  # 2 active blocks, 8 tokens waiting for prefill
    return s, req(body, s)


def test_kv_cost_formula() -> None:
    s, f = dynamo_state()
    d = KvCost(s.spec).choose(f, s)
    # r0: 1.0 * (20 - 12 + 0) / 4 + (0 + 5) = 7
    # r1: 1.0 * (20 + 0) / 4 + (10 + 5) = 20
    # r2: 1.0 * (20 + 8) / 4 + (2 + 5) = 14
    np.testing.assert_allclose(d.scores, [7.0, 20.0, 14.0])
    assert d.replica == 0
    p = KvCost(s.spec)
    p.overlap_score_weight = 2.0
    np.testing.assert_allclose(p.choose(f, s).scores, [9.0, 25.0, 21.0])


def test_kv_cost_fresh_kv_usage_raises_active_blocks() -> None:
    s, f = dynamo_state()
    s.observe_engine(0, s.now, queue_reqs=0, running_reqs=3, kv_usage=0.5)  # 50 blocks in use
    d = KvCost(s.spec).choose(f, s)
    assert d.scores[0] == pytest.approx(2 + 50 + 5)
    assert d.replica == 2
    s.now += s.spec.signals.metrics_stale_s + 1  # stale: back to our own count
    assert KvCost(s.spec).choose(f, s).scores[0] == pytest.approx(7.0)


def test_kv_cost_ties_go_to_the_smaller_tree() -> None:
    s = FleetState(spec(3))
    cache(s, 0, text(24, 15))
    cache(s, 2, text(8, 16))
    p = KvCost(s.spec)
    f = req(text(12, 17), s)
    assert [p.choose(f, s).replica for _ in range(4)] == [1, 1, 1, 1]
    cache(s, 1, text(40, 18))
    assert [p.choose(f, s).replica for _ in range(4)] == [2, 2, 2, 2]


# --- gorgo-paper ----------------------------------------------------------------------------


def test_gorgo_paper_exact_score() -> None:
    s = FleetState(spec(3))
    for i, rtt in enumerate((100.0, 10.0, 20.0)):
        s.observe_rtt(i, rtt)
    s.add_inflight(1, 1000, 0)
    f = req(text(400, 19), s)
    d = GorgoPaper(s.spec).choose(f, s)
    np.testing.assert_allclose(d.scores, [27.6 + 400, 2.76 + 400 + 500, 5.52 + 400])
    assert d.replica == 2
    cache(s, 0, text(400, 19)[:200])  # 200 tokens cached on the far replica
    d = GorgoPaper(s.spec).choose(f, s)
    assert d.scores[0] == pytest.approx(27.6 + 200)
    assert d.replica == 0


def test_gorgo_paper_router_keeps_an_unbounded_index() -> None:
    paper = Router(spec(1, kv=17, policy="gorgo-paper"))  # KV holds 4 blocks (and a token)
    assert paper.state.prefix.capacity is None
    bounded = Router(spec(1, kv=17, policy="gorgo", allow_policy_override=True))
    assert bounded.state.prefix.capacity == [4]
    body = text(16, 20)
    for r in (paper, bounded):
        for sent in (body, text(16, 21)):  # the second evicts the first from a bounded index
            d = r.route(req(sent, r.state), now=0.0)
            r.complete(d.id)
    # cached whole: the engine computes the last block again (blocks of 4 tokens)
    assert paper.route(req(body, paper.state), now=100.0).uncached_tokens == 4
    f = extract_features("/v1/completions", {POLICY_HEADER: "gorgo-paper"},
                         json.dumps({"prompt": body, "max_tokens": 1}).encode(), bounded.state.tok)
    d = bounded.route(f, now=100.0)
    assert d.policy == "gorgo-paper" and d.uncached_tokens == 16  # override: bounded index


# --- irb ------------------------------------------------------------------------------------


def drive(s: FleetState, rate: float, seconds: float, tokens: int = 100, i: int = 0) -> None:
    """Requests at ``rate``/s for ``seconds``, counted in flight then released."""
    for k in range(int(rate * seconds)):
        s.now = k / rate
        s.add_inflight(i, tokens, 0)
        s.release_inflight(i, tokens)


def test_demand_estimate() -> None:
    s = FleetState(spec())
    assert s.demand() == (0.0, 0.0)
    drive(s, 20.0, 10.0)
    rate, tokens = s.demand()
    assert rate == pytest.approx(20.0, rel=0.05)
    assert tokens == pytest.approx(100.0)
    s.now += 60.0
    assert s.demand()[0] < 0.1


def irb_state(rates: list[float] | None = None, rtts: tuple[float, ...] = (10.0, 50.0, 100.0),
              ) -> FleetState:
    s = FleetState(spec(3, rates=rates))
    for i, rtt in enumerate(rtts):
        s.observe_rtt(i, rtt)
    return s


def test_irb_weights_respect_capacity_and_prefer_low_latency() -> None:
    s = irb_state()
    drive(s, 20.0, 10.0)  # 2000 prompt tokens/s against 3 x 850 of capped capacity
    p = Irb(s.spec)
    p.refresh(s)
    assert p.plan is not None and not p.plan.overloaded
    w = p.plan.weights
    rate, tokens = s.demand()
    assert w.sum() == pytest.approx(1.0)
    assert np.all(w * rate * tokens <= 0.85 * s.prefill_rate + 1e-6)
    assert w[0] >= w[1] >= w[2] and w[0] > w[2]  # near saturation: all three carry load
    mid = irb_state()
    drive(mid, 5.0, 10.0)
    p.refresh(mid)
    w = p.plan.weights
    assert w[0] > w[1] > w[2] == 0.0  # the far replica is not worth its RTT yet
    low = irb_state()
    drive(low, 1.0, 10.0)
    p.refresh(low)
    np.testing.assert_allclose(p.plan.weights, [1.0, 0.0, 0.0])


def test_irb_queueing_spreads_load_before_capacity() -> None:
    # Equal RTT: the convex queue term splits demand evenly rather than filling one replica.
    w, overloaded, expected = solve_weights(10.0, 100.0, np.full(3, 1000.0), np.zeros(3),
                                            np.ones(3, dtype=bool))
    np.testing.assert_allclose(w, [1 / 3] * 3, atol=0.05)
    assert not overloaded and expected > 100.0  # at least one 100 ms prefill


def test_irb_overload_is_proportional_to_capacity() -> None:
    s = irb_state(rates=[1000.0, 2000.0, 1000.0])
    drive(s, 50.0, 10.0)  # 5000 tokens/s > 0.85 * 4000
    p = Irb(s.spec)
    p.refresh(s)
    assert p.plan is not None and p.plan.overloaded
    np.testing.assert_allclose(p.plan.weights, [0.25, 0.5, 0.25])


def test_irb_solve_leaves_out_unroutable_replicas() -> None:
    s = irb_state()
    drive(s, 5.0, 10.0)
    eject(s, 0)
    p = Irb(s.spec)
    p.refresh(s)
    assert p.plan is not None and p.plan.weights[0] == 0.0
    assert p.plan.weights[1] > 0.5


def test_irb_weighted_hashing_splits_by_weight_and_sticks() -> None:
    s = irb_state()
    p = Irb(s.spec)
    p.plan = Plan(np.array([0.5, 0.3, 0.2]), 1.0, 100.0, False, 0.0, 0.0)
    picks = [p.choose(keyed(f"u{k}"), s).replica for k in range(10000)]
    counts = Counter(picks)
    for i, w in enumerate((0.5, 0.3, 0.2)):
        assert counts[i] / 10000 == pytest.approx(w, abs=0.02)
    assert all(p.choose(req("y", s, session=f"u{k}"), s).replica == picks[k] for k in range(200))
    # An ejected replica's sessions spread by weight; the others stay put.
    eject(s, 0)
    after = [p.choose(keyed(f"u{k}"), s).replica for k in range(2000)]
    assert all(a == b for a, b in zip(after, picks, strict=False) if b != 0)
    moved = Counter(a for a, b in zip(after, picks, strict=False) if b == 0)
    assert moved[1] / (moved[1] + moved[2]) == pytest.approx(0.6, abs=0.06)


def test_irb_choose_solves_only_when_never_solved() -> None:
    s = irb_state()
    p = Irb(s.spec)
    assert p.plan is None
    p.choose(req("x", s), s)
    plan = p.plan
    assert plan is not None
    drive(s, 50.0, 10.0)
    p.choose(req("x", s), s)
    assert p.plan is plan  # choose reads; refresh solves
    p.refresh(s)
    assert p.plan is not plan and p.plan.overloaded


def test_irb_falls_back_to_capacity_when_weighted_replicas_are_ejected() -> None:
    s = irb_state(rates=[1000.0, 3000.0, 1000.0])
    p = Irb(s.spec)
    p.plan = Plan(np.array([1.0, 0.0, 0.0]), 1.0, 100.0, False, 0.0, 0.0)
    eject(s, 0)
    picks = Counter(p.choose(keyed(f"u{k}"), s).replica for k in range(4000))
    assert set(picks) == {1, 2}
    assert picks[1] / 4000 == pytest.approx(0.75, abs=0.03)


def test_irb_is_deterministic() -> None:
    s = irb_state()
    drive(s, 20.0, 5.0)
    a, b = Irb(s.spec), Irb(s.spec)
    a.refresh(s)
    b.refresh(s)
    np.testing.assert_array_equal(a.plan.weights, b.plan.weights)  # type: ignore[union-attr]
    fs = [req(text(300, k), s) for k in range(50)]
    assert [a.choose(f, s).replica for f in fs] == [b.choose(f, s).replica for f in fs]
