"""The cost-term registry and its terms: what each prices, and which objective counts it."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from gorgo.core.contract import DECISION_FIELDS, WEIGHT_BOUNDS
from gorgo.core.cost import cost_terms
from gorgo.core.features import RequestError, extract_features
from gorgo.core.fleet import FleetError, parse_fleet
from gorgo.core.router import Router
from gorgo.core.state import FleetState
from gorgo.core.terms import (
    BY_NAME,
    E2E,
    OBJECTIVES,
    SLO,
    TERMS,
    TTFT,
    WEIGHTED,
    reuse,
    weight_keys,
)
from gorgo.core.terms.decode import PREFILL_SHARE_MAX, predicted_itl, prefill_share, slowdown


def _spec(**extra):
    return parse_fleet({
        "regions": {"near": {}, "far": {}},
        "chars_per_token": 1.0,
        "replicas": [
            {"name": "a", "engine": "sim", "region": "near", "address": "h:1",
             "prefill_rate": 10000},
            {"name": "b", "engine": "sim", "region": "far", "address": "h:2",
             "prefill_rate": 10000},
        ],
        **extra,
    })


def _req(s: FleetState, text: str = "x" * 100, max_tokens: int | None = 200):
    body = {"prompt": text, **({"max_tokens": max_tokens} if max_tokens else {})}
    return extract_features("/v1/completions", {}, json.dumps(body).encode(), s.tok)


def test_registry_is_consistent_with_the_contract() -> None:
    assert len(BY_NAME) == len(TERMS)
    assert all(f"{t.name}_ms" in DECISION_FIELDS for t in TERMS)
    assert set(WEIGHT_BOUNDS) == set(WEIGHTED)
    for t in TERMS:
        assert t.unit == "ms" and t.objectives <= set(OBJECTIVES) and t.objectives
        if t.weight is not None:
            lo, hi = t.bounds
            assert 0 < lo <= t.default <= hi
    # TTFT terms count for every objective; decode only for e2e.
    assert weight_keys(TTFT) == ("rtt", "queue")
    assert weight_keys(E2E) == ("rtt", "queue", "decode", "interference", "reuse")
    assert weight_keys(SLO) == weight_keys(E2E)


def test_decode_grows_with_the_batch_and_the_output() -> None:
    s = FleetState(_spec())
    s.now = 0.0
    f = _req(s)
    idle = cost_terms(f, s)["decode"]
    assert idle[0] == pytest.approx(idle[1]) and idle[0] > 0
    assert (cost_terms(f, s)["interference"] == 0).all()  # nobody to slow down
    # 200 tokens at ~6 ms each on an idle H100-like replica
    assert 1000 < idle[0] < 1500
    for _ in range(20):
        s.add_inflight(0, 2000, 0)
    busy = cost_terms(f, s)["decode"]
    assert busy[0] > idle[0] * 1.3 and busy[1] == pytest.approx(idle[1])
    hurt = cost_terms(f, s)["interference"]
    assert hurt[0] > 0 and hurt[1] == 0
    longer = cost_terms(_req(s, max_tokens=400), s)["decode"]
    assert longer[1] == pytest.approx(2 * idle[1], rel=0.05)
    # a chat request without a bound: the term's output_tokens parameter (256) stands in (a
    # completion without max_tokens stops at the API's 16)
    chat = extract_features("/v1/chat/completions", {}, json.dumps(
        {"messages": [{"role": "user", "content": "x" * 100}]}).encode(), s.tok)
    assert cost_terms(chat, s)["decode"][1] > idle[1]
    assert cost_terms(_req(s, max_tokens=None), s)["decode"][1] < idle[1]


def test_a_request_of_n_sequences_weighs_n_in_the_batch() -> None:
    """`n` sequences decode side by side: each is one more in every step of the requests there;
    the prompt is prefilled once, and the first token waits for one running slot, not n."""
    s = FleetState(_slots_spec(max_running=4))
    s.now = 0.0
    for _ in range(3):
        s.add_inflight(0, 2000, 0)
    s.inflight_seqs[1] = 3
    one = _req(s)
    t1, t2, t4 = (cost_terms(replace(one, choices=k), s) for k in (1, 2, 4))
    per_sequence = t2["interference"][0] - t1["interference"][0]
    assert per_sequence > 0  # beyond the prefill stall, which is the same for any n
    assert t4["interference"][0] - t1["interference"][0] == pytest.approx(3 * per_sequence)
    assert t4["decode"][0] > t1["decode"][0]
    assert t4["prefill"][0] == t1["prefill"][0]
    assert t1["admission"][1] == 0.0 and t4["admission"][1] == 0.0  # 3 + 1 fit 4 slots


def test_a_batch_of_prompts_is_priced_by_each_sequences_own_prompt() -> None:
    """Two 100-token prompts decode as two sequences of a 100-token context each, as one such
    prompt with n = 2 does: each sequence was charged the whole batch's 200 tokens."""
    s = FleetState(_spec())
    s.now = 0.0
    for _ in range(3):
        s.add_inflight(0, 2000, 0)

    def terms(body: dict) -> dict:
        body = {**body, "max_tokens": 200}
        f = extract_features("/v1/completions", {}, json.dumps(body).encode(), s.tok)
        return cost_terms(f, s)

    batch = terms({"prompt": ["a" * 100, "b" * 100]})
    twice = terms({"prompt": "a" * 100, "n": 2})
    assert batch["decode"][0] == pytest.approx(twice["decode"][0])
    # only the prefill stall differs: 100 more tokens to prefill (0.1 ms each) x 3 decoding
    assert batch["interference"][0] - twice["interference"][0] == pytest.approx(3 * 100 * 0.1)


def test_a_fresh_engine_scrape_counts_other_routers_requests() -> None:
    s = FleetState(_spec())
    s.now = 10.0
    f = _req(s)
    before = cost_terms(f, s)["decode"]
    s.observe_engine(1, 10.0, queue_reqs=5, running_reqs=30, kv_usage=0.5)
    after = cost_terms(f, s)["decode"]
    assert after[1] > before[1] and after[0] == pytest.approx(before[0])


def test_slower_replicas_decode_slower() -> None:
    s = FleetState(_spec())
    s.set_weights(s.weights, {"b": 5000.0})  # b prefills at half a's rate
    d = cost_terms(_req(s), s)["decode"]
    assert d[1] == pytest.approx(2 * d[0])


def test_decode_stretches_with_the_prefill_booked_on_the_replica() -> None:
    """Under chunked prefill the prompts a replica takes in while a request decodes ride in its
    steps: its decode lasts longer by the share of the replica's time their prefill takes
    (gorgo@e2e sent long-output requests where the long prompts went, docs/results.md)."""
    s = FleetState(_spec())
    s.now = 0.0
    f = _req(s)
    idle, idle_itl = cost_terms(f, s)["decode"], predicted_itl(f, s)
    for _ in range(4):  # 4 requests of 1,000 uncached tokens, booked on a, then ended
        s.add_inflight(0, 1000, 1000)
        s.release_inflight(0, 1000, 1000)
    s.now = 2.0
    share = prefill_share(s)
    assert share[1] == 0 and share[0] == pytest.approx(
        s.prefill_booked()[0] / 10000) and 0 < share[0] < PREFILL_SHARE_MAX
    d = cost_terms(f, s)["decode"]
    assert d[0] == pytest.approx(idle[0] * (1 + share[0])) and d[1] == pytest.approx(idle[1])
    # The TPOT the slo objective compares with its target, and admission's slot wait, see the
    # same stretched steps (the TPOT was predicted unstretched).
    assert predicted_itl(f, s) == pytest.approx(idle_itl * (1 + share))
    for _ in range(200):  # far more than a can prefill: priced at the cap, not without bound
        s.add_inflight(0, 1000, 1000)
        s.release_inflight(0, 1000, 1000)
    assert cost_terms(f, s)["decode"][0] == pytest.approx(idle[0] * (1 + PREFILL_SHARE_MAX))


def test_the_prefill_share_counts_what_the_bookings_leave_uncached() -> None:
    """A replica whose requests hit its cache takes in little prefill, however many it gets:
    counted as requests x a running average of their uncached size (starting at 1,000
    tokens), its first cache hits were priced near full prompts (docs/results.md)."""
    s = FleetState(_spec())
    s.now = 0.0
    for _ in range(4):  # 4 requests of 1,000 prompt tokens on each: a prefills them, b has
        # them cached
        s.add_inflight(0, 1000, 1000)
        s.add_inflight(1, 1000, 0)
    s.now = 2.0
    share = prefill_share(s)
    assert share[1] == 0 and share[0] == pytest.approx(4 * 1000 / 2.0 / 10000, rel=0.2)


def test_the_objective_chooses_which_terms_count() -> None:
    """Under ttft the near, busy replica wins; under e2e its batch slows decoding too much."""
    for objective, winner in ((TTFT, 0), (E2E, 1)):
        r = Router(_spec(objective=objective))
        r.state.observe_rtt(0, 10.0)
        r.state.observe_rtt(1, 300.0)
        r.state.now = 0.0
        for _ in range(120):  # a large batch on a, nothing queued for prefill
            r.state.add_inflight(0, 3000, 0)
        d = r.route(_req(r.state, max_tokens=500), now=0.0)
        assert d.replica == winner, objective
        # the decision's prediction is TTFT whatever the objective
        assert d.predicted_ms == pytest.approx(
            d.terms["rtt"] + d.terms["queue"] + d.terms["prefill"] + d.terms["penalty"])


def test_objective_is_validated_and_defaults_to_ttft() -> None:
    assert _spec().objective == TTFT
    with pytest.raises(FleetError, match=r"^fleet\.objective: must be one of ttft, e2e, slo"):
        _spec(objective="fastest")


def test_state_holds_each_terms_parameters_per_replica() -> None:
    s = FleetState(_spec())
    params = s.params["decode"]
    assert set(params) == set(BY_NAME["decode"].params)
    assert all(isinstance(v, np.ndarray) and v.shape == (2,) for v in params.values())
    assert replace(_spec()).objective == TTFT


def _slo_router(**slo) -> Router:
    """a: near and busy (fast first token, slow tokens); b: far and idle (the opposite)."""
    r = Router(_spec(objective=SLO, **({"slo": slo} if slo else {})))
    r.state.observe_rtt(0, 10.0)
    r.state.observe_rtt(1, 300.0)
    r.state.now = 0.0
    for _ in range(150):
        r.state.add_inflight(0, 3000, 0)
    return r


def _slo_req(r: Router, **headers: str):
    body = json.dumps({"prompt": "x" * 100, "max_tokens": 50}).encode()
    return extract_features("/v1/completions", headers, body, r.state.tok)


def test_slo_picks_among_the_replicas_that_meet_both_targets() -> None:
    r = _slo_router()
    itl = BY_NAME["decode"].compute(_slo_req(r), r.state) / 50
    assert itl[0] > 2 * itl[1]  # a's batch slows its tokens
    # Only a's first token is fast enough: a, though its tokens are slower.
    d = r.route(_slo_req(r, **{"x-slo-ttft-ms": "100"}), now=0.0)
    assert d.replica == 0
    # Only b's tokens are fast enough: b, though its first token is slower.
    d = r.route(_slo_req(r, **{"x-slo-tpot-ms": f"{(itl[1] + itl[0]) / 2:.3f}"}), now=0.0)
    assert d.replica == 1
    # Neither meets both: the least violating, never a refusal.
    d = r.route(_slo_req(r, **{"x-slo-ttft-ms": "100", "x-slo-tpot-ms": "1"}), now=0.0)
    assert d.replica in (0, 1)


@pytest.mark.parametrize("targets", [{"ttft_ms": 100}, {"tpot_ms": 0.01}])
def test_slo_least_violating_replica_still_pays_for_its_failures(targets: dict) -> None:
    """When no replica meets the targets, the ranking by violation keeps the failure penalty:
    a replica that just answered 5xx twice (its failed requests ended early, so it looks less
    loaded) won the request there, where ttft and e2e avoid it."""
    r = Router(_spec(objective="slo", slo=targets))
    s = r.state
    s.observe_rtt(0, 1.0)
    s.observe_rtt(1, 1.0)
    s.add_inflight(0, 3000, 3000)  # both busy, neither under target; a a little less so
    s.add_inflight(1, 3200, 3200)
    s.record_failed_response(0, 0.0)
    s.record_failed_response(0, 0.0)
    assert s.healthy[0] and s.penalty()[0] > 0
    assert r.route(_req(s, max_tokens=16), now=0.0).replica == 1


def test_another_models_faster_replica_does_not_slow_this_ones_decode() -> None:
    """The slowdown is against the fastest of the request's own model's replicas: one fast
    replica of an unrelated model made every replica of this one 20x slower (its decode term
    and the ITL the SLO compares), and a replica serving both models took the other model's
    fastest as its reference."""
    def router(beta: bool) -> Router:
        reps = [{"name": "x", "engine": "sim", "region": "near", "address": "h:1",
                 "prefill_rate": 1000, "models": ["alpha", "beta"]},
                {"name": "y", "engine": "sim", "region": "near", "address": "h:2",
                 "prefill_rate": 500, "models": ["alpha"]}]
        if beta:
            reps.append({"name": "z", "engine": "sim", "region": "near", "address": "h:3",
                         "prefill_rate": 20000, "models": ["beta"]})
        r = Router(parse_fleet({"regions": {"near": {}}, "chars_per_token": 1.0,
                                "objective": "e2e", "replicas": reps}))
        for i in range(r.state.n):
            r.state.observe_rtt(i, 5.0)
        return r

    def alpha(r: Router):
        body = {"model": "alpha", "prompt": "x" * 100, "max_tokens": 200}
        return r.route(extract_features("/v1/completions", {}, json.dumps(body).encode(),
                                        r.state.tok), now=0.0)

    alone, beside = alpha(router(False)), alpha(router(True))
    assert beside.replica == alone.replica == 0  # x: alpha's fastest
    assert beside.terms["decode"] == pytest.approx(alone.terms["decode"])
    s = router(True).state
    assert slowdown(s).tolist() == [20.0, 40.0, 1.0]  # no request scored: the whole fleet


def test_slo_defaults_come_from_the_fleet_and_headers_override_them() -> None:
    r = _slo_router(ttft_ms=100)
    assert r.route(_slo_req(r), now=0.0).replica == 0
    assert r.route(_slo_req(r, **{"x-slo-ttft-ms": "5000"}), now=0.0).replica == 1  # e2e cheapest
    with pytest.raises(FleetError, match=r"^fleet\.slo\.tpot_ms: must be >= 0"):
        _spec(slo={"tpot_ms": -1})


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "1e400", "5 ms", "９"])
def test_slo_headers_are_bounded(value: str) -> None:
    r = _slo_router()
    with pytest.raises(RequestError) as info:
        _slo_req(r, **{"x-slo-ttft-ms": value})
    assert info.value.status == 400 and info.value.code == "invalid_slo"


def _slots_spec(max_running: float = 4):
    doc = {
        "regions": {"near": {}},
        "chars_per_token": 1.0,
        "replicas": [
            {"name": n, "engine": "sim", "region": "near", "address": f"h:{k}",
             "prefill_rate": 10000, "params": {"admission": {"max_running": max_running}}}
            for k, n in enumerate("ab", 1)],
    }
    return parse_fleet(doc)


def test_admission_waits_only_where_the_running_slots_are_full() -> None:
    s = FleetState(_slots_spec(max_running=4))
    s.inflight_seqs[:] = [2, 4]  # a has room; b's four slots are taken
    f = _req(s)
    wait = BY_NAME["admission"].compute(f, s)
    assert wait[0] == 0.0 and wait[1] > 0.0
    s.inflight_seqs[:] = [2, 6]  # three must finish before b admits it
    s.version += 1  # as FleetState's own writers do: the terms' per-state memos key on it
    assert BY_NAME["admission"].compute(f, s)[1] == pytest.approx(3 * wait[1], rel=0.2)


def test_admission_counts_in_every_objective_and_steers_away_from_full_replicas() -> None:
    assert BY_NAME["admission"].objectives == frozenset(OBJECTIVES)
    r = Router(_slots_spec(max_running=4))
    r.state.rtt_ms[:] = 1.0
    r.state.inflight_seqs[:] = [8, 0]
    r.state.backlog_tokens[:] = [0.0, 500.0]  # b has prefill queued, a only full slots
    d = r.route(_req(r.state), now=0.0)
    assert d.replica == 1 and d.terms["admission"] == 0.0


@pytest.mark.parametrize(("params", "message"), [
    ({"admission": {"max_running": 0}}, r"params\.admission\.max_running: must be > 0"),
    ({"admission": {"slots": 4}}, r"params\.admission\.slots: unknown field"),
    ({"rtt": {"x": 1}}, r"params: 'rtt' is not a term with parameters"),
])
def test_term_params_in_the_fleet_file_are_validated(params, message) -> None:
    doc = {"regions": {"near": {}}, "replicas": [
        {"name": "a", "engine": "sim", "region": "near", "address": "h:1", "params": params}]}
    with pytest.raises(FleetError, match=message):
        parse_fleet(doc)


def test_term_params_from_the_fleet_file_reach_the_state() -> None:
    s = FleetState(_slots_spec(max_running=64))
    assert s.params["admission"]["max_running"].tolist() == [64.0, 64.0]
    default = BY_NAME["decode"].params["itl_base_ms"]
    assert s.params["decode"]["itl_base_ms"].tolist() == [default, default]


def _blocks_req(s: FleetState, blocks: int, tail: str = ""):
    """A prompt of ``blocks`` full blocks (1 char per token), then ``tail``."""
    return _req(s, "p" * (blocks * s.spec.block_tokens) + tail)


def test_reuse_prices_the_cached_prefix_a_move_leaves_behind() -> None:
    s = FleetState(_spec())
    f = _blocks_req(s, 4)
    s.record_sent(0, f, f.prompt_tokens)  # a caches the 4 blocks; nothing was reused before
    assert s.reuse_share == 0.0
    assert (cost_terms(f, s)["reuse"] == 0).all()  # no reuse learned: no future to price
    s.reuse_share = 0.75  # three in four prompt tokens are seen again: three more turns
    s.version += 1
    r = cost_terms(f, s)["reuse"]
    lost = 4 * s.spec.block_tokens
    assert r[0] == 0.0  # where the prefix is
    assert r[1] == pytest.approx(lost * 1000.0 / 10000 * 3)
    s.healthy[0] = False  # the best-cached replica is gone: moving loses nothing any more
    s.version += 1
    assert (cost_terms(f, s)["reuse"] == 0).all()


def test_reuse_share_is_learned_from_what_is_routed_and_capped() -> None:
    s = FleetState(_spec())
    f = _blocks_req(s, 4)
    for _ in range(400):  # the same prompt again and again: all of it is seen again
        s.record_sent(0, f, 0)
    assert 0.95 < s.reuse_share < 1.0
    assert reuse.expected_turns(s) == pytest.approx(reuse.MAX_SHARE / (1 - reuse.MAX_SHARE))
    spec = _spec()
    assert s.reindexed(spec, {"a": "a", "b": "b"}).reuse_share == s.reuse_share
    fresh = FleetState(_spec())
    for k in range(400):  # every prompt new: nothing is reused
        g = _req(fresh, f"{k:08d}" + "q" * 200)
        fresh.record_sent(k % 2, g, g.prompt_tokens)
    assert fresh.reuse_share == 0.0


def test_reuse_keeps_a_session_where_its_cache_is_under_e2e_only() -> None:
    """a caches the prefix but has prefill queued, so b is a little cheaper for this request;
    pricing the following turns keeps it on a. The ttft objective does not count the term."""
    assert BY_NAME["reuse"].objectives == frozenset({E2E, SLO})
    winners = {}
    for objective, w in ((TTFT, 1.0), (E2E, 0.05), (E2E, 1.0)):
        r = Router(_spec(objective=objective, weights={"reuse": w}))
        r.state.rtt_ms[:] = 10.0
        f = _blocks_req(r.state, 8, tail="turn")
        r.state.prefix.insert(0, f.block_hashes)
        r.state.reuse_share = 0.8  # four more turns expected
        r.state.backlog_tokens[:] = [700.0, 0.0]  # 70 ms of queue on a; b re-prefills 51 ms
        d = r.route(f, now=0.0)
        winners[objective, w] = d.replica
        assert d.predicted_ms == pytest.approx(sum(
            d.terms[k] for k in ("rtt", "queue", "admission", "prefill", "penalty")))
    assert winners == {(TTFT, 1.0): 1, (E2E, 0.05): 1, (E2E, 1.0): 0}


def test_congestion_is_zero_before_any_arrival_and_prices_the_wait_it_adds() -> None:
    s = FleetState(_spec())
    s.now = 0.0
    f = _req(s, "y" * 1000)  # 1,000 uncached tokens: 100 ms on either 10,000 tokens/s replica
    np.testing.assert_array_equal(BY_NAME["congestion"].compute(f, s), [0.0, 0.0])
    for k in range(10):  # 10 requests within 0.1 s, 5,000 tokens queued on a
        s.now = 0.9 + k / 100
        s.add_inflight(0, 500, 500)
    s.now = 1.0
    s.version += 1
    rate, _ = s.demand()
    u = s.uncached_tokens(f)
    wait = s.waiting_tokens() * 1000.0 / s.prefill_rate
    rho = rate * float(s.mean_uncached.mean()) / 20_000
    expected = u * rate / 20_000 * (wait + 100.0) / (1 - rho)
    got = BY_NAME["congestion"].compute(f, s)
    np.testing.assert_allclose(got, expected)
    assert got[0] > got[1] > 0  # a's queue keeps the requests behind this one waiting longer
    # a cached prompt adds no prefill, so no wait for anyone
    s.version += 1
    assert BY_NAME["congestion"].compute(_req(s, ""), s).max() == 0.0


def test_congestion_counts_under_ttft_only_and_is_no_part_of_the_prediction() -> None:
    assert BY_NAME["congestion"].objectives == frozenset({TTFT})
    assert BY_NAME["congestion"].weight is None  # in no tuner's search space
    for objective in (TTFT, E2E):
        r = Router(_spec(objective=objective))
        r.state.observe_rtt(0, 10.0)
        r.state.observe_rtt(1, 10.0)
        for k in range(20):
            r.state.now = 0.9 + k / 200
            r.state.add_inflight(k % 2, 2000, 2000)
        d = r.route(_req(r.state, "z" * 3000), now=1.0)
        t, i = d.terms, d.replica
        assert t["congestion"] > 0
        ttft = t["rtt"] + t["queue"] + t["admission"] + t["prefill"]
        assert d.predicted_ms == pytest.approx(ttft)
        if objective == TTFT:
            assert d.scores[i] == pytest.approx(ttft + t["penalty"] + t["congestion"])
        else:
            w = r.state.weights
            e2e = (ttft + t["penalty"] + t["decode"] + t["reuse"]
                   + w.factor(BY_NAME["interference"]) * t["interference"])
            assert d.scores[i] == pytest.approx(e2e)


def test_congestion_keeps_the_near_replica_from_filling_up_to_the_far_ones_round_trip() -> None:
    """Greedy on its own TTFT, a request joins a near queue as long as it is shorter than the far
    replica's round trip; priced for the requests behind it, the idle far replica wins sooner."""
    r = Router(_spec())
    r.state.observe_rtt(0, 10.0)
    r.state.observe_rtt(1, 300.0)
    for k in range(20):  # 20 requests/s arriving (cached prompts: nothing queued) ...
        r.state.now = k / 20
        r.state.add_inflight(k % 2, 1000, 0)
    r.state.now = 1.0
    r.state.add_inflight(0, 2000, 2000)  # ... and 200 ms of prefill queued on the near one
    f = _req(r.state, "q" * 1000)  # 100 ms of prefill: near 10 + 200 + 100, far 300 + 100
    t = cost_terms(f, r.state)
    assert (t["rtt"] + t["queue"] + t["prefill"])[0] < (t["rtt"] + t["queue"] + t["prefill"])[1]
    assert r.route(f, now=1.0).replica == 1


def test_a_generous_cap_is_priced_at_what_the_engines_generate() -> None:
    # Clients that send max_tokens 4,096 and stop after ~300: the decode terms priced 4,096
    # tokens (chat x paper at load 0.8: E2E p95 1.36x cache-aware's, 1.06x priced as learned).
    s = FleetState(_spec())
    capped = _req(s, max_tokens=4096)
    for _ in range(50):
        s.record_sent(0, capped, 100)
    s.observe_engine(0, 0.0, 0.0, 0.0, 0.0, generated=1000.0, finished=10.0)
    s.observe_engine(0, 1.0, 0.0, 0.0, 0.0, generated=1000.0 + 300.0 * 40, finished=50.0)
    as_300 = cost_terms(_req(s, max_tokens=300), s)
    terms = cost_terms(capped, s)
    assert terms["decode"] == pytest.approx(as_300["decode"])
    assert terms["interference"] == pytest.approx(as_300["interference"])
    # a bound below the typical output is still a bound
    short = cost_terms(_req(s, max_tokens=20), s)["decode"]
    assert short == pytest.approx(as_300["decode"] * 20 / 300, rel=0.05)


def test_the_admission_wait_prices_the_engines_typical_output() -> None:
    s = FleetState(_spec())
    s.params["admission"]["max_running"][:] = 2.0
    for _ in range(4):
        s.add_inflight(0, 100, 0)
    f = _req(s)
    default = cost_terms(f, s)["admission"][0]
    assert default > 0
    s.observe_engine(1, 0.0, 0.0, 0.0, 0.0, generated=0.0, finished=0.0)
    s.observe_engine(1, 1.0, 0.0, 0.0, 0.0, generated=64.0 * 100, finished=100.0)
    s.version += 1
    learned = cost_terms(f, s)["admission"][0]
    assert learned == pytest.approx(default * 64 / 256, rel=0.05)  # the parameter's 256
