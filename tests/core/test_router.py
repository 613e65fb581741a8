"""The route/complete contract: priced decisions, exactly-once release, policy selection."""

from __future__ import annotations

import json
import math
import random
import warnings
from dataclasses import replace

import numpy as np
import pytest

from gorgo.core.contract import POLICY_HEADER
from gorgo.core.decision import NO_REPLICA, Decision, NoReplicaAvailable, Rejection
from gorgo.core.features import RequestFeatures, extract_features
from gorgo.core.fleet import FleetError, FleetSpec, parse_fleet
from gorgo.core.policies import REGISTRY
from gorgo.core.policies.base import PolicyBase
from gorgo.core.router import Router
from gorgo.core.state import FAILURES_TO_EJECT, MAX_ENGINE_REQS, FleetState
from gorgo.core.weights import Weights


def spec(**extra: object) -> FleetSpec:
    return parse_fleet({
        "regions": {"local": {}},
        "block_tokens": 4,
        "chars_per_token": 1.0,
        "replicas": [
            {"name": "a", "engine": "sim", "region": "local", "address": "h:1",
             "prefill_rate": 1000},
            {"name": "b", "engine": "sim", "region": "local", "address": "h:2",
             "prefill_rate": 2000},
        ],
        **extra,
    })


def req(text: str, policy: str | None = None) -> RequestFeatures:
    headers = {POLICY_HEADER: policy} if policy else {}
    tok = FleetState(spec()).tok
    return extract_features("/v1/completions", headers, json.dumps({"prompt": text}).encode(), tok)


def test_decision_carries_terms() -> None:
    r = Router(spec())
    r.state.observe_rtt(0, 10.0)
    r.state.observe_rtt(1, 40.0)
    r.state.set_weights(Weights({"rtt": 1.0, "queue": 1.0}, version=5))
    r.state.now = 0.0
    r.state.add_inflight(0, 100, 100)  # 100 ms queue on a
    r.state.add_inflight(1, 400, 400)  # 200 ms queue on b
    d = r.route(req("x" * 20), now=0.0)
    # a: 10 + 100 + 20 = 130; b: 40 + 200 + 10 = 250.
    assert d.replica == 0
    assert d.policy == "gorgo"
    ttft_terms = {k: v for k, v in d.terms.items()
                  if k not in ("decode", "interference", "reuse", "congestion")}
    assert ttft_terms == pytest.approx({"rtt": 10.0, "queue": 100.0, "admission": 0.0,
                                        "prefill": 20.0, "penalty": 0.0})
    assert d.terms["decode"] > 0  # reported, though the ttft objective does not count it
    assert d.predicted_ms == pytest.approx(130.0)  # what the others' wait adds is no latency
    assert d.scores[0] == pytest.approx(130.0 + d.terms["congestion"])
    assert d.uncached_tokens == 20 and d.prompt_tokens == 20
    assert d.weights_version == 5
    assert d.id == "d-1"
    assert d.scores[1] > 250.0


def test_an_image_is_priced_at_the_fleets_media_tokens_and_cached_when_sent_again() -> None:
    """The router's tokens count each media part as the fleet's `media_tokens`: an image's
    prefill is priced, not only its question's; and sent again (the next turn of its
    conversation) its tokens are a cached prefix, as the engine's are (they were priced
    uncached on every turn, 1,004 of a 1,388-token prompt whose every block matched)."""
    question = {"type": "text", "text": "what is this? " * 4}
    image = {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}

    def features(*content: dict) -> RequestFeatures:
        body = {"messages": [{"role": "user", "content": list(content)}]}
        return extract_features("/v1/chat/completions", {}, json.dumps(body).encode(),
                                r.state.tok)

    r = Router(spec(media_tokens=300))
    assert r.state.tok.media_tokens == 300
    f = features(question, image)
    assert f.prompt_tokens == features(question).prompt_tokens + 300 + 1  # and its newline
    d = r.route(f, now=0.0)
    assert d.uncached_tokens == f.prompt_tokens
    r.complete(d.id)
    again = r.route(features(question, image), now=1.0)
    assert again.replica == d.replica
    assert again.uncached_tokens < 4  # what is left of the last block


@pytest.mark.parametrize("objective", ["ttft", "e2e", "slo"])
@pytest.mark.parametrize("garbage", [math.nan, math.inf, -3.0, 1e308])
def test_an_engine_reporting_garbage_counts_is_still_routed(objective: str, garbage: float) -> None:
    """Scraped queue and running counts are read within [0, MAX_ENGINE_REQS], NaN as 0: a NaN
    count once made every cost NaN (the router then answered every request 503 while the scrape
    was fresh), and an absurd one turned a term's product into NaN (0 x inf)."""
    r = Router(spec(objective=objective))
    r.state.observe_rtt(0, 10.0)
    r.state.observe_rtt(1, 40.0)
    r.state.observe_engine(0, 0.0, queue_reqs=garbage, running_reqs=garbage, kv_usage=math.nan)
    r.state.observe_engine(1, 0.0, queue_reqs=2.0, running_reqs=math.nan, kv_usage=0.5)
    for now in (0.2, 0.5):  # the second sees the first's prefix cached (0 uncached tokens)
        d = r.route(req("x" * 20), now=now)
        assert isinstance(d, Decision)
        assert not np.isnan(d.scores).any()
    expected = 0.0 if math.isnan(garbage) else min(max(garbage, 0.0), MAX_ENGINE_REQS)
    assert (r.state.eng_queue_reqs[0], r.state.eng_running_reqs[0]) == (expected, expected)
    assert (r.state.eng_queue_reqs[1], r.state.eng_running_reqs[1]) == (2.0, 0.0)


GARBAGE = (math.nan, math.inf, -math.inf, -5.0, 0.0, 1.0, 7.0, 1e6, 1e308)


@pytest.mark.parametrize("objective", ["ttft", "e2e", "slo"])
@pytest.mark.parametrize("policy", sorted(REGISTRY))
def test_no_policy_is_broken_by_garbage_engine_signals(policy: str, objective: str) -> None:
    """Any mix of scrapes (NaN, infinite, negative or absurd counts and KV use), RTTs, failures
    and ends between the decisions: every request is routed or refused for a reason (never a
    503 while a replica is routable), no choice has a NaN score, and no arithmetic overflows."""
    rng = random.Random(f"{policy}/{objective}")
    r = Router(spec(policy=policy, objective=objective))
    s, now, opened = r.state, 0.0, []
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for _ in range(300):
            now += rng.choice((0.0, 0.001, 0.5, 3.0))
            r.tick(now)
            op = rng.random()
            if op < 0.2:
                s.observe_engine(rng.randrange(s.n), now, rng.choice(GARBAGE),
                                 rng.choice(GARBAGE), rng.choice(GARBAGE))
            elif op < 0.3:
                s.observe_rtt(rng.randrange(s.n), rng.choice((0.0, 1.0, 50.0, 1e9)))
            elif op < 0.35:
                s.record_failed_response(rng.randrange(s.n), now)
            elif op < 0.5 and opened:
                r.complete(opened.pop(rng.randrange(len(opened))))
            else:
                body = {"prompt": "x" * rng.choice((0, 3, 40, 400)) + str(rng.randrange(5))}
                if rng.random() < 0.5:
                    body["max_tokens"] = rng.choice((1, 64, 4000))
                f = extract_features("/v1/completions", {}, json.dumps(body).encode(), s.tok)
                d = r.route(f, now)
                if isinstance(d, Decision):
                    opened.append(d.id)
                    assert d.scores is None or not np.isnan(d.scores[d.replica])
                else:
                    assert d.status != 503 or not s.routable().any(), d
    assert ((s.eng_kv_usage >= 0) & (s.eng_kv_usage <= 1) | np.isnan(s.eng_kv_usage)).all()


def test_a_nan_score_never_wins_nor_hides_the_others() -> None:
    s = FleetState(spec())
    d = PolicyBase(s.spec).pick_lowest(np.array([np.nan, 5.0]), s)
    assert d.replica == 1
    with pytest.raises(NoReplicaAvailable):
        PolicyBase(s.spec).pick_lowest(np.array([np.nan, np.nan]), s)


def test_weights_applied_to_predicted_ms() -> None:
    r = Router(spec(weights={"rtt": 2.0, "queue": 0.5}))
    r.state.observe_rtt(0, 10.0)
    r.state.observe_rtt(1, 10.0)
    r.state.add_inflight(1, 10_000, 10_000)
    d = r.route(req("x" * 8), now=0.0)
    assert d.replica == 0
    assert d.predicted_ms == pytest.approx(2.0 * 10.0 + 0.5 * 0.0 + 8.0)


def test_second_identical_request_sees_the_cache() -> None:
    r = Router(spec())
    f1 = req("p" * 10)
    d1 = r.route(f1, now=0.0)
    assert d1.uncached_tokens == 10
    r.complete(d1.id)
    d2 = r.route(req("p" * 10), now=100.0)
    assert d2.replica == d1.replica  # cached prefix and equal otherwise
    assert d2.uncached_tokens == 2  # 2 full blocks cached, the 2-token tail is not


def test_route_counts_in_flight_and_caches_prefix() -> None:
    r = Router(spec())
    d = r.route(req("abcdefgh"), now=3.0)
    s = r.state
    assert s.now == 3.0
    assert s.inflight_reqs[d.replica] == 1
    assert s.inflight_prompt_tokens[d.replica] == 8
    assert s.prefix.blocks_held(d.replica) == 2
    assert r.open_requests == 1


def test_ids_are_unique_and_prefixed() -> None:
    r = Router(spec(), id_prefix="edge7")
    ids = [r.route(req("x"), now=0.0).id for _ in range(50)]
    assert len(set(ids)) == 50
    assert all(i.startswith("edge7-") for i in ids)
    other = Router(spec(), id_prefix="edge8")
    assert other.route(req("x"), now=0.0).id not in ids


def test_complete_releases_exactly_once() -> None:
    r = Router(spec())
    d1 = r.route(req("aaaa"), now=0.0)
    d2 = r.route(req("bbbbbbbb"), now=0.0)
    assert r.state.inflight_reqs.sum() == 2
    assert r.complete(d1.id) is True
    assert r.complete(d1.id) is False
    assert r.state.inflight_reqs.sum() == 1
    assert r.complete(d2.id) is True
    assert r.complete(d2.id) is False
    np.testing.assert_array_equal(r.state.inflight_reqs, [0, 0])
    np.testing.assert_array_equal(r.state.inflight_prompt_tokens, [0, 0])
    assert r.open_requests == 0
    assert r.complete("never-issued") is False


def test_policy_override_requires_permission() -> None:
    f = req("x", policy="round-robin")
    assert Router(spec()).policy_for(f).name == "gorgo"
    allowed = Router(spec(allow_policy_override=True))
    assert allowed.policy_for(f).name == "round-robin"
    assert allowed.route(f, now=0.0).policy == "round-robin"


def test_unknown_override_falls_back_to_default() -> None:
    r = Router(spec(allow_policy_override=True, policy="least-request"))
    assert r.policy_for(req("x", policy="no-such-policy")).name == "least-request"
    assert r.policy_for(req("x")).name == "least-request"


def test_unknown_default_policy_is_fleet_error() -> None:
    with pytest.raises(FleetError, match=r"^fleet.policy: unknown policy 'fastest'"):
        spec(policy="fastest")
    # A spec built in code (not parsed) is checked when the router starts.
    with pytest.raises(FleetError, match=r"^policy: unknown policy 'fastest'"):
        Router(replace(spec(), policy="fastest"))


class _AlwaysLast(PolicyBase):
    name = "always-last"

    def choose(self, f: RequestFeatures, s: FleetState) -> Decision:
        return Decision(replica=s.n - 1, policy=self.name)


def test_extra_policies() -> None:
    sp = replace(spec(), policy="always-last")
    r = Router(sp, extra_policies={"always-last": _AlwaysLast(sp)})
    d = r.route(req("x" * 4), now=0.0)
    assert (d.replica, d.policy) == (1, "always-last")
    assert d.terms["prefill"] == pytest.approx(2.0)  # priced by the cost model all the same


def test_no_replica_available_leaves_no_accounting() -> None:
    r = Router(spec())
    for i in range(2):
        for _ in range(FAILURES_TO_EJECT):
            r.state.record_failure(i, now=10.0)
    rejected = r.route(req("x"), now=10.0)
    assert isinstance(rejected, Rejection)
    assert (rejected.status, rejected.reason) == (503, NO_REPLICA)
    assert rejected.retry_after_s >= 1.0
    assert r.open_requests == 0
    assert r.state.inflight_reqs.sum() == 0
    r.state.record_success(1)
    assert r.route(req("x"), now=11.0).replica == 1


def test_round_robin_router_spreads_requests() -> None:
    r = Router(spec(policy="round-robin"))
    assert [r.route(req("x"), now=0.0).replica for _ in range(4)] == [0, 1, 0, 1]


def test_least_request_router_balances_open_requests() -> None:
    r = Router(spec(policy="least-request"))
    ds = [r.route(req("x"), now=0.0) for _ in range(4)]
    np.testing.assert_array_equal(r.state.inflight_reqs, [2, 2])
    r.complete(ds[0].id)
    assert r.route(req("x"), now=0.0).replica == ds[0].replica


def test_reassign_moves_accounting_to_the_replica_that_served() -> None:
    import json as _json

    from gorgo.core.features import extract_features as _extract
    from gorgo.core.fleet import parse_fleet as _parse
    from gorgo.core.router import Router as _Router

    spec = _parse({
        "regions": {"a": None},
        "replicas": [{"name": f"r{i}", "engine": "sim", "region": "a",
                      "address": f"127.0.0.1:{i + 1}"}
                     for i in range(2)],
    })
    r = _Router(spec)
    body = _json.dumps({"messages": [{"role": "user", "content": "y" * 2000}]}).encode()
    f = _extract("/v1/chat/completions", {}, body, r.state.tok)
    d = r.route(f, 0.0)
    other = 1 - d.replica
    demand = r.state.demand()
    assert r.reassign(d.id, other)
    assert r.state.inflight_reqs[d.replica] == 0 and r.state.inflight_reqs[other] == 1
    assert r.state.demand() == demand  # moved, not a second arrival
    assert r.state.prefix.match(f.block_hashes)[other] == len(f.block_hashes)
    assert not r.reassign(d.id, other)
    assert r.complete(d.id)
    assert r.state.inflight_reqs.sum() == 0 and r.state.inflight_prompt_tokens.sum() == 0
    assert not r.reassign(d.id, d.replica)


def test_decisions_are_counted_per_weights_version_and_policy() -> None:
    """The tuner scores a version on every request it routed, so the router counts them; only
    the latest ROUTED_VERSIONS versions are kept."""
    from gorgo.core.router import ROUTED_VERSIONS

    r = Router(spec(allow_policy_override=True))
    r.route(req("a"), now=0.0)
    r.route(req("b", policy="round-robin"), now=0.0)
    r.state.set_weights(Weights({"rtt": 2.0, "queue": 0.5}, 7))
    for _ in range(3):
        r.route(req("c"), now=0.0)
    assert r.routed == {0: {"gorgo": 1, "round-robin": 1}, 7: {"gorgo": 3}}
    r.reload(r.spec)  # an admin drain, a DNS change: the counts stay (the tuner undercounted)
    assert r.routed == {0: {"gorgo": 1, "round-robin": 1}, 7: {"gorgo": 3}}
    for v in range(8, 8 + ROUTED_VERSIONS):
        r.state.set_weights(Weights({"rtt": 1.0, "queue": 1.0}, v))
        r.route(req("d"), now=0.0)
    assert len(r.routed) == ROUTED_VERSIONS and 0 not in r.routed and 7 not in r.routed


def test_a_reload_takes_the_files_weights_until_weights_are_put() -> None:
    # An edited `weights:` reloaded "successfully" and never applied (and a restarted worker
    # then ran the file's new weights beside its peers' old ones).
    r = Router(spec())
    r.reload(spec(weights={"rtt": 3.0, "queue": 2.0}))
    assert (r.state.weights["rtt"], r.state.weights["queue"]) == (3.0, 2.0)
    r.state.set_weights(Weights({"rtt": 0.5, "queue": 0.5}, 4))  # the tuner's, or an operator's
    r.reload(spec(weights={"rtt": 9.0}))
    assert r.state.weights["rtt"] == 0.5 and r.state.weights.version == 4


# --- per-model settings (the fleet file's models:) ---------------------------------------------


def two_models(**models: object) -> FleetSpec:
    """alpha on a1 (near, busy) and a2 (far, idle); beta (alias b) on b1."""
    return parse_fleet({
        "regions": {"local": {}},
        "block_tokens": 4,
        "chars_per_token": 1.0,
        "replicas": [
            {"name": "a1", "engine": "sim", "region": "local", "address": "h:1",
             "models": ["alpha"]},
            {"name": "a2", "engine": "sim", "region": "local", "address": "h:2",
             "models": ["alpha"]},
            {"name": "b1", "engine": "sim", "region": "local", "address": "h:3",
             "models": [{"name": "beta", "aliases": ["b"]}]},
        ],
        "models": models,
    })


def model_req(model: str, text: str = "x" * 8) -> RequestFeatures:
    tok = FleetState(spec()).tok
    body = json.dumps({"model": model, "prompt": text}).encode()
    return extract_features("/v1/completions", {}, body, tok)


def _busy_near(r: Router) -> None:
    r.state.observe_rtt(0, 10.0)  # a1: 10 ms away, 100 ms of queue
    r.state.observe_rtt(1, 60.0)  # a2: 60 ms away, idle
    r.state.observe_rtt(2, 10.0)
    r.state.add_inflight(0, 1000, 1000)
    r.state.set_weights(Weights({"rtt": 1.0, "queue": 1.0}, version=5))


def test_a_models_own_weights_route_its_requests_outside_the_tuner() -> None:
    plain = Router(two_models())
    _busy_near(plain)
    d = plain.route(model_req("alpha"), now=0.0)
    assert (plain.state.names[d.replica], d.weights_version) == ("a2", 5)
    r = Router(two_models(alpha={"weights": {"rtt": 20.0}}))
    _busy_near(r)
    d = r.route(model_req("alpha"), now=0.0)
    # rtt x 20: a1 costs 200 ms + its queue, a2 1200 ms; version 0: the tuner scores none.
    assert r.state.names[d.replica] == "a1" and d.weights_version == 0
    assert d.predicted_ms == pytest.approx(20 * 10.0 + d.terms["queue"] + d.terms["prefill"])
    assert r.route(model_req("beta"), now=0.0).weights_version == 5  # the tuned weights
    assert r.state.model_settings is None  # only while a request is scored


def test_a_models_policy_and_objective_apply_to_its_requests_and_aliases() -> None:
    r = Router(two_models(beta={"policy": "round-robin", "objective": "e2e"},
                          alpha={"objective": "e2e"}))
    seen: list[tuple[Weights, str]] = []

    class Recorder(PolicyBase):
        name = "gorgo"

        def choose(self, f: RequestFeatures, s: FleetState) -> Decision:
            seen.append(s.scoring())
            return r.policies["least-request"].choose(f, s)

    r.policies["gorgo"] = Recorder(r.spec)
    r.state.set_weights(Weights({"rtt": 2.0, "queue": 1.0}, version=5))
    for model in ("beta", "b"):
        d = r.route(model_req(model), now=0.0)
        assert (d.policy, r.state.names[d.replica]) == ("round-robin", "b1")
    r.route(model_req("alpha"), now=0.0)
    weights, objective = seen[-1]
    # An objective of its own routes on the fleet file's (fixed) weights, for that objective.
    assert objective == "e2e" and weights == Weights() and weights.version == 0
    assert r.settings_for(model_req("b")).name == "beta"
    r.tick(0.0)  # the models' own policies are refreshed with the default


def test_a_fleet_of_one_model_applies_its_settings_to_requests_naming_none() -> None:
    doc = {"regions": {"local": {}}, "models": {"alpha": {"policy": "least-request"}},
           "replicas": [{"name": "a1", "engine": "sim", "region": "local", "address": "h:1",
                         "models": ["alpha"]}]}
    assert Router(parse_fleet(doc)).route(req("x"), now=0.0).policy == "least-request"


def _model_fleet(policy: str, **extra: object) -> FleetSpec:
    """alpha on a1 and a2, beta on b1, with ``extra`` merged into every replica."""
    return parse_fleet({
        "regions": {"near": {}, "far": {}}, "block_tokens": 4, "chars_per_token": 1.0,
        "policy": policy, "objective": "e2e",
        "replicas": [{"name": n, "engine": "sim", "region": "near", "address": f"h:{k + 1}",
                      "models": [m], **extra}
                     for k, (n, m) in enumerate([("a1", "alpha"), ("a2", "alpha"),
                                                 ("b1", "beta")])],
    })


def test_another_models_cache_is_no_reuse_of_this_ones() -> None:
    """The same text cached on a replica of another model is no cache this request could keep:
    it priced a 909 ms `reuse` term and moved the request (block hashes do not name the
    model)."""
    prompt = "system prompt shared by both models. " * 11

    def alpha_after(beta_first: bool) -> Decision:
        r = Router(_model_fleet("gorgo"))
        r.state.reuse_share = 0.9
        if beta_first:
            d = r.route(model_req("beta", prompt), now=0.0)
            assert isinstance(d, Decision) and r.complete(d.id)
            r.state.reuse_share = 0.9
        r.state.add_inflight(1, 2000, 2000)  # a2 has prefill queued
        d = r.route(model_req("alpha", prompt), now=0.0)
        assert isinstance(d, Decision)
        return d

    cold, warm = alpha_after(False), alpha_after(True)
    assert warm.terms["reuse"] == 0.0
    assert (warm.replica, warm.scores.tolist()) == (cold.replica, cold.scores.tolist())


def test_cache_aware_weighs_the_load_of_the_requests_models_replicas_only() -> None:
    """SGLang's gateway keeps a worker set per model: 100 requests of another model in flight
    turned this model's cache hit into a least-load miss."""
    conv = "a long conversation with model alpha " * 60

    def next_turn(beta_load: int) -> str:
        r = Router(_model_fleet("cache-aware"))
        first = r.route(model_req("alpha", conv), now=0.0)
        assert isinstance(first, Decision)
        for k in range(beta_load):
            r.route(model_req("beta", f"b{k}"), now=0.0)
        d = r.route(model_req("alpha", conv + " and its next turn"), now=0.0)
        assert isinstance(d, Decision)
        assert d.replica == first.replica, "the cached replica, load within the model even"
        return r.state.names[d.replica]

    assert next_turn(0) == next_turn(100)


def test_irb_plans_each_model_over_its_own_replicas_and_demand() -> None:
    """One plan over the whole fleet put every weight on another model's nearest replica and
    split this model's traffic by capacity, its RTTs unseen (157 near / 143 far)."""
    r = Router(_model_fleet("irb"))
    s = r.state
    for i, rtt in enumerate((1.0, 100.0, 0.5)):  # a1 near, a2 far, b1 nearest
        s.observe_rtt(i, rtt)
    now, seen = 0.0, []
    for k in range(100):
        now += 0.5
        r.tick(now)
        d = r.route(model_req("alpha", f"q{k} " * 100), now=now)
        assert isinstance(d, Decision)
        seen.append(s.names[d.replica])
        r.complete(d.id)
    assert seen.count("a1") == 100
    irb = r.policies["irb"]
    assert irb.plans["alpha"].weights.tolist() == [1.0, 0.0, 0.0]
    assert irb.plans["beta"].weights.tolist() == [0.0, 0.0, 1.0]
    assert irb.plans["beta"].rate_rps == 0.0  # beta was sent nothing: alpha's demand is alpha's


def test_each_models_requests_are_priced_at_that_models_output() -> None:
    # alpha answers 2,000 tokens a request, beta 100: one estimate for the fleet priced both at
    # the mix, and the decode term of a short answer as if it were long
    r = Router(two_models())
    s = r.state
    for i, tokens in ((0, 2000.0), (1, 2000.0), (2, 100.0)):
        s.observe_engine(i, 0.0, 0, 0, 0.1, generated=0.0, finished=0.0)
        s.observe_engine(i, 1.0, 0, 0, 0.1, generated=tokens * 60, finished=60.0)
    itl = s.params["decode"]["itl_base_ms"][0]

    def chat(model: str) -> RequestFeatures:  # no max_tokens (a completion's default is 16)
        body = {"model": model, "messages": [{"role": "user", "content": "x" * 8}]}
        return extract_features("/v1/chat/completions", {}, json.dumps(body).encode(), s.tok)

    alpha = r.route(chat("alpha"), now=2.0)
    beta = r.route(chat("b"), now=2.0)  # by its alias
    assert alpha.terms["decode"] == pytest.approx(2000.0 * itl, rel=0.05)
    assert beta.terms["decode"] == pytest.approx(100.0 * itl, rel=0.05)
    # each model learns the bounds of its own requests only
    assert s.outputs.of(2).bound_n + s.outputs.of(2).unbounded_n == pytest.approx(1.0)


def _draws(r: Router, n: int = 40) -> list[int]:
    out = []
    for _ in range(n):
        d = r.route(req("x"), now=0.0)
        out.append(d.replica)
        r.complete(d.id)
    return out


def test_live_routers_of_one_fleet_draw_apart_and_a_simulation_replays() -> None:
    # Seeded from the fleet name alone, every live router (processes, --workers) drew one
    # sequence in step; each now mixes in its own id. Unsalted (offline) runs replay.
    fleet = spec(policy="random")
    assert _draws(Router(fleet)) == _draws(Router(fleet))
    assert _draws(Router(fleet, salt="ab12cd")) == _draws(Router(fleet, salt="ab12cd"))
    assert _draws(Router(fleet, salt="ab12cd")) != _draws(Router(fleet, salt="ef34ab"))
    irb = [Router(spec(policy="irb"), salt=s).policies["irb"] for s in ("ab12cd", "ef34ab")]
    assert irb[0].rng.random() != irb[1].rng.random()
    # A reload goes on with the router's own sequence, not back to the fleet's.
    r, same = Router(fleet, salt="ab12cd"), Router(fleet, salt="ab12cd")
    first = _draws(r, 20)
    assert first == _draws(same, 20)
    r.reload(fleet)
    assert _draws(r, 20) == _draws(same, 20)
