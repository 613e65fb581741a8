"""Offline simulation: determinism, accounting and the routing effect it exists to measure."""

from __future__ import annotations

import math
from dataclasses import astuple, replace

import numpy as np
import pytest

from gorgo.core.decision import Decision
from gorgo.core.fleet import FleetSpec, parse_fleet
from gorgo.core.policies import REGISTRY
from gorgo.sim.offline import RequestRecord, SimResult, Simulation
from gorgo.sim.presets import fleet_document
from gorgo.sim.traces import TraceRequest, chat_trace
from gorgo.sim.workload import ORACLE, Workload, simulate, tokenization, workload_from_requests

PROFILE = "h100-llama3-8b"


def _fleet(links: dict[str, dict], replicas: dict[str, int], profile: str = PROFILE) -> FleetSpec:
    return parse_fleet(fleet_document(replicas, profile=profile, links=links))


@pytest.fixture(scope="module")
def two_regions() -> FleetSpec:
    return _fleet({"near": {"rtt_ms": 20.0, "jitter_ms": 5.0},
                   "far": {"rtt_ms": 300.0, "jitter_ms": 80.0}}, {"near": 2, "far": 1})


@pytest.fixture(scope="module")
def chat(two_regions: FleetSpec) -> Workload:
    reqs = chat_trace(seed=7, users=15, rate=8.0, limit=160)
    return workload_from_requests("chat", reqs, tokenization(two_regions))


def _rows(res: SimResult) -> list[str]:
    return [repr(astuple(r)) for r in res.records]


def test_same_seed_same_records_other_seed_differs(two_regions: FleetSpec, chat: Workload) -> None:
    a = simulate(two_regions, "gorgo", chat, 1.0, seed=3)
    b = simulate(two_regions, "gorgo", chat, 1.0, seed=3)
    c = simulate(two_regions, "gorgo", chat, 1.0, seed=4)
    assert _rows(a) == _rows(b)
    assert a.events == b.events
    assert _rows(a) != _rows(c)
    assert [r.ttft for r in a.records] != [r.ttft for r in c.records]


def test_first_token_hook_comes_in_time_order_before_the_end_and_changes_nothing(
        two_regions: FleetSpec, chat: Workload) -> None:
    events: list[tuple[str, float, int]] = []
    open_at_first: list[bool] = []

    def first(rec: RequestRecord, d: Decision) -> None:
        events.append(("first", sim.now, rec.index))
        open_at_first.append(math.isnan(rec.e2e) and d.replica == rec.replica)

    spec = replace(two_regions, name=f"{two_regions.name}/seed3")  # as simulate() names it
    sim = Simulation(spec, "gorgo", seed=3, on_first_token=first,
                     on_complete=lambda rec, d: events.append(("end", sim.now, rec.index)))
    res = sim.run(chat.arrivals.tolist(), chat.features, chat.output_tokens)
    assert [t for _, t, _ in events] == sorted(t for _, t, _ in events)
    firsts = {k: t for kind, t, k in events if kind == "first"}
    ends = {k: t for kind, t, k in events if kind == "end"}
    served = {r.index for r in res.records if r.status == 200}
    assert set(firsts) == served and served  # once per request with a first token
    assert all(open_at_first)
    for k, t in firsts.items():  # at the TTFT, and before (or with) the request's end
        assert t == pytest.approx(res.records[k].arrival + res.records[k].ttft)
        order = [i for i, (_, _, j) in enumerate(events) if j == k]
        assert events[order[0]][0] == "first" and firsts[k] <= ends[k]
    assert _rows(res) == _rows(simulate(two_regions, "gorgo", chat, 1.0, seed=3))


@pytest.mark.parametrize("policy", ["kv-cost", "least-load", "gorgo"])
def test_folded_decode_steps_change_nothing_a_scrape_reads_or_a_request_gets(
        two_regions: FleetSpec, chat: Workload, policy: str) -> None:
    """Folding pure decode steps is a speed-up only: a fold stops at the engine's next scrape,
    so every scrape reads what single steps show and every decision and record is the same
    (a scrape inside a folded block used to read the block's end: kv-cost routed apart)."""
    def run(fold: int) -> tuple[list, list[str]]:
        spec = replace(two_regions, name=f"{two_regions.name}/seed5")
        sim = Simulation(spec, policy, seed=5, fold=fold)
        reads: list = []
        for i, engine in enumerate(sim.engines):
            def metrics(engine=engine, i=i, real=engine.metrics):
                m = real()
                reads.append((sim.now, i, m.num_waiting, m.num_running, m.kv_usage))
                return m
            engine.metrics = metrics  # type: ignore[method-assign]
        res = sim.run((chat.arrivals * 0.8).tolist(), chat.features, chat.output_tokens)
        return reads, _rows(res)

    single, folded = run(1), run(64)
    assert len(single[0]) > 30
    assert folded[0] == single[0]
    assert folded[1] == single[1]


def test_random_policy_follows_the_seed(two_regions: FleetSpec, chat: Workload) -> None:
    # The random policy seeds itself from the fleet name; simulate() names the fleet per seed.
    picks = [[r.replica for r in simulate(two_regions, "random", chat, 1.0, seed=s).records]
             for s in (1, 1, 2)]
    assert picks[0] == picks[1]
    assert picks[0] != picks[2]


@pytest.mark.parametrize("policy", [*REGISTRY, ORACLE])
def test_every_policy_ends_every_request_and_releases_it(
    two_regions: FleetSpec, chat: Workload, policy: str
) -> None:
    res = simulate(two_regions, policy, chat, 0.5, seed=1)
    assert res.leaked_inflight == 0
    assert len(res.records) == chat.n
    assert all(r.status in (200, 400, 503) for r in res.records)
    for r in res.served():
        assert r.replica >= 0
        assert 0 < r.ttft <= r.e2e
        assert 0 <= r.cached_tokens < r.prompt_tokens


def test_rejections_are_final_statuses_without_leaks() -> None:
    # tiny-test engines hold 2048 KV tokens and queue 4 requests: a burst of 40 fills the queues
    # (503) and a 3000-token prompt can never fit (400).
    spec = _fleet({"local": {"link": "local"}}, {"local": 2}, profile="tiny-test")
    reqs = [TraceRequest(k, 0.0, 3000 if k == 5 else 200, 50) for k in range(40)]
    w = workload_from_requests("burst", reqs, tokenization(spec))
    res = simulate(spec, "round-robin", w, 1.0, seed=0)
    status = [r.status for r in res.records]
    assert 0 not in status
    assert status[5] == 400
    assert 503 in status
    assert 200 in status
    assert res.leaked_inflight == 0


def test_gorgo_avoids_a_far_region_round_robin_pays_for() -> None:
    # One replica next to the router, one 1.5 s away; light load, so the near one keeps up.
    spec = _fleet({"near": {"rtt_ms": 10.0, "jitter_ms": 2.0},
                   "far": {"rtt_ms": 1500.0, "jitter_ms": 50.0}}, {"near": 1, "far": 1})
    reqs = chat_trace(seed=2, users=20, rate=0.5, limit=80)
    w = workload_from_requests("chat", reqs, tokenization(spec))
    far = spec.region_names.index("far")

    def run(policy: str) -> tuple[float, float]:
        res = simulate(spec, policy, w, 1.0, seed=1)
        assert len(res.served()) == w.n
        ttft = float(np.mean([r.ttft for r in res.served()]))
        share = np.mean([res.replica_region[r.replica] == far for r in res.records])
        return ttft, float(share)

    rr_ttft, rr_far = run("round-robin")
    g_ttft, g_far = run("gorgo")
    assert rr_far == pytest.approx(0.5, abs=0.02)
    assert g_far < 0.1
    assert g_ttft < 0.5 * rr_ttft


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
def test_the_typical_output_is_learnt_from_what_the_live_scrape_reads(flavor: str) -> None:
    # A vLLM's scrape reads the finished requests' histogram (extproc.engine_metrics); offline
    # read the counter of every token generated for every flavour, running requests' tokens
    # over finished requests: a vLLM's typical output learnt 2.9x high early on.
    doc = fleet_document({"local": 2}, profile=PROFILE, links={"local": {"rtt_ms": 2.0}})
    for r in doc["replicas"]:
        r["sim"]["flavor"] = flavor
    spec = parse_fleet(doc)
    reqs = [TraceRequest(k, 0.05 * k, 300, 200) for k in range(80)]
    w = workload_from_requests("fixed", reqs, tokenization(spec))
    seen: list[float] = []

    def done(rec: RequestRecord, d: Decision) -> None:
        typical = sim.router.state.outputs.of(0).typical()
        if typical is not None:
            seen.append(typical)

    sim = Simulation(spec, "round-robin", seed=1, on_complete=done)
    sim.run(w.arrivals.tolist(), w.features, w.output_tokens)
    assert seen
    if flavor == "vllm":  # exactly the finished requests' 200 tokens, from the first scrape on
        assert (min(seen), max(seen)) == pytest.approx((200, 200))
    else:  # SGLang's counters: running requests' tokens too, high until they settle
        assert max(seen) > 200
