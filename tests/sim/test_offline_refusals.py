"""The offline simulator frees what an engine refused, as the live router does (issue 12, 3),
and retries a 503 as the rendered Envoy route does.

Both drivers release a request through `Router.complete` when its answer is back, whatever it
was; an engine refusal (`EngineRejected`) is answered after one return trip, so the refused
prompt's booked prefill is gone as soon as the router could know of it. A 503 before any byte is
retried once on the decision's next-best replica within the retry budget, and the router learns
of it from the answer's headers (the first replica failed, the request moved).
"""

from __future__ import annotations

import json

from gorgo.core.features import extract_features
from gorgo.core.fleet import parse_fleet
from gorgo.core.state import BACKOFF_BASE_S, FAILURES_TO_EJECT
from gorgo.sim.offline import Simulation
from gorgo.sim.presets import fleet_document
from gorgo.sim.profiles import get_profile
from gorgo.sim.traces import TraceRequest
from gorgo.sim.workload import tokenization, workload_from_requests

PROFILE = "h100-llama3-8b"


def test_a_refused_prompt_is_not_priced_as_queue_for_later_requests() -> None:
    capacity = get_profile(PROFILE).kv_capacity_tokens
    doc = fleet_document({"near": 2}, profile=PROFILE, links={"near": {"rtt_ms": 10.0}})
    for r in doc["replicas"]:
        r["kv_capacity_tokens"] = 10 * capacity  # the router believes the engines hold it
    spec = parse_fleet(doc)
    tok = tokenization(spec)

    def chat(text: str) -> bytes:
        return json.dumps({"messages": [{"role": "user", "content": text}]}).encode()

    big = extract_features("/v1/chat/completions", {}, chat("b" * 4 * (capacity + 1000)), tok)
    small = [extract_features("/v1/chat/completions", {}, chat(f"{k} " * 200), tok)
             for k in range(20)]
    arrivals = [0.0] + [0.5 + 0.1 * k for k in range(20)]
    sim = Simulation(spec, "gorgo")
    res = sim.run(arrivals, [big, *small], [16] * 21)
    refused, *served = res.records
    assert refused.status == 400
    assert all(r.status == 200 for r in served)
    # 401k tokens at the profile's 20k tokens/s: 20 s of queue, of which about 18 s would still be
    # booked when the last request closes; released with the refusal instead.
    s = sim.router.state
    assert s.now > 2.0
    assert s.own_backlog()[refused.replica] == 0
    assert res.leaked_inflight == 0


def _one_session(retries: dict) -> tuple:
    doc = fleet_document({"local": 2}, profile="tiny-test", links={"local": {"link": "local"}})
    spec = parse_fleet({**doc, "retries": retries})
    reqs = [TraceRequest(k, 0.02 * k, 200, 60, session="user-1") for k in range(60)]
    w = workload_from_requests("one-session", reqs, tokenization(spec))
    sim = Simulation(spec, "session-affinity", seed=1)  # every turn to one replica: its queue fills
    return sim, sim.run(w.arrivals.tolist(), w.features, w.output_tokens)


def test_an_engine_503_is_retried_once_on_the_next_best_replica_as_envoy_does() -> None:
    sim, res = _one_session({})
    # before: 7 of 60 failed (the queue full) and the router never heard of it
    assert all(r.status == 200 for r in res.records)
    sticky = max((0, 1), key=lambda i: sum(r.replica == i for r in res.records))
    moved = [r for r in res.records if r.replica != sticky]
    assert moved and all(r.ttft > 0 for r in moved)
    s = sim.router.state
    assert res.leaked_inflight == 0 and s.inflight_reqs.sum() == 0
    assert s.penalty()[sticky] > 0  # each refusal priced at the router, as live


def test_without_retries_or_budget_the_503_is_the_answer_and_the_router_knows() -> None:
    for retries in ({"enabled": False}, {"budget_percent": 0.01, "min_retry_concurrency": 0}):
        sim, res = _one_session(retries)
        failed = [r for r in res.records if r.status == 503]
        assert failed, retries
        assert sim.router.state.penalty()[failed[0].replica] > 0
        assert res.leaked_inflight == 0


def test_a_retry_holds_its_budget_slot_until_its_attempt_answers_not_until_its_end() -> None:
    """Envoy frees a retry's budget slot at its attempt's headers: held until the end of the
    whole stream, 6 of these 12 retries were refused."""
    doc = fleet_document({"local": 4}, profile="tiny-test", links={"local": {"link": "local"}})
    spec = parse_fleet(doc)
    reqs = [TraceRequest(k, 0.03 * k, 100, 400, session="user-1") for k in range(40)]
    w = workload_from_requests("one-session", reqs, tokenization(spec))
    sim = Simulation(spec, "session-affinity", seed=1)
    res = sim.run(w.arrivals.tolist(), w.features, w.output_tokens)
    # 6 when the slot was held to the end; 12 while an ejected replica came back at its first
    # probe, before its backoff ended (it took 3 more 503s)
    assert len(sim._retried) == 9
    assert res.leaked_inflight == 0


def test_an_ejected_replica_is_probed_only_once_its_backoff_is_over_as_live() -> None:
    # Offline probed it every interval, and the first answer re-admitted it before its backoff
    # ended (ejections lasted 0-2 s offline, 1-3 s live).
    from gorgo.sim.offline import PROBE_DONE

    doc = fleet_document({"near": 2}, profile="tiny-test", links={"near": {"rtt_ms": 10.0}})
    sim = Simulation(parse_fleet(doc), "round-robin")
    s = sim.router.state
    for _ in range(FAILURES_TO_EJECT):
        s.record_failure(0, 0.0)
    assert not s.healthy[0] and s.retry_at[0] == BACKOFF_BASE_S

    def probes_sent(now: float) -> list[int]:
        sim._heap.clear()
        sim.now = now
        for i in (0, 1):
            sim._probe((0, i))
        return sorted(p[1] for _, kind, _, p in sim._heap if kind == PROBE_DONE)

    assert probes_sent(0.5) == [1]  # still backing off: the healthy one only
    assert probes_sent(BACKOFF_BASE_S) == [0, 1]
