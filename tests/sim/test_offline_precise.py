"""The precise cache view in the offline simulation: the simulated vLLMs' KV events reach the
router on the virtual clock, its view ends as the engines' caches exactly, and under cache
pressure its routing gets the engines at least the prefix hits the approximate view gets."""

from __future__ import annotations

import numpy as np
import pytest

from gorgo.core.decision import Decision
from gorgo.core.fleet import parse_fleet
from gorgo.core.precise import CLOSED_HOLD_S
from gorgo.sim.offline import HASHES_KEPT, RequestRecord, Simulation
from gorgo.sim.workload import build_workload, tokenization

KV = 12_000


def fleet(cache: str):
    reps = []
    for i in range(3):
        r = {"name": f"r{i}", "region": "us-east", "address": f"127.0.0.1:{21000 + i}",
             "engine": "sim", "kv_capacity_tokens": KV,
             "sim": {"profile": "h100-llama3-8b", "flavor": "vllm", "kv_tokens": KV}}
        if cache == "precise":
            r.update(cache="precise", tokenizer="sim")
        reps.append(r)
    return parse_fleet({"regions": {"us-east": None}, "replicas": reps})


def run(cache: str, wl) -> tuple[Simulation, list[tuple[int, int]]]:
    pairs: list[tuple[int, int]] = []  # (predicted cached tokens, engine's real hit)

    def done(rec: RequestRecord, d: Decision) -> None:
        pairs.append((d.prompt_tokens - d.uncached_tokens, rec.cached_tokens))

    sim = Simulation(fleet(cache), "gorgo", seed=1, on_complete=done)
    res = sim.run(wl.arrivals.tolist(), wl.features, wl.output_tokens)
    assert res.leaked_inflight == 0 and all(r.status == 200 for r in res.records)
    return sim, pairs


@pytest.mark.slow
def test_events_drive_the_router_exactly() -> None:
    wl = build_workload("chat:users=40,rate=6,system_tokens=1024", tokenization(fleet("")), 300)
    sim, precise = run("precise", wl)
    s = sim.router.state
    assert s.precise is not None
    assert all(s.precise.live(i) for i in range(3))
    assert s.precise.events_applied.min() > 0
    for i, engine in enumerate(sim.engines):  # the view is the engines' caches, exactly
        assert s.precise.blocks_held(i) == engine.cache.cached_blocks
    for t in (sim.now, sim.now + CLOSED_HOLD_S):  # the last requests' holds start, then end
        sim.router.tick(t)
    assert s.precise.pending.index.sizes().sum() == 0  # no request left open
    _, approx = run("approximate", wl)
    hits = [float(np.mean([real for _, real in pairs])) for pairs in (precise, approx)]
    assert hits[0] >= 0.95 * hits[1], hits


@pytest.mark.slow
@pytest.mark.parametrize("bound", ["oracle", "oracle-lookahead"])
def test_the_bounds_see_the_caches_of_precise_engines(bound: str) -> None:
    # They looked the engines' caches up with the router's hashes, where a precise engine keys
    # its cache on its own: nothing cached anywhere (oracle: 18.6 % of prompt tokens hit against
    # 43.7 % on the same engines hashing the router's way).
    from gorgo.sim.workload import BOUNDS

    wl = build_workload("chat:users=30,rate=6,system_tokens=1024", tokenization(fleet("")), 90)
    hits = []
    for cache in ("precise", "approximate"):
        spec = fleet(cache)
        sim = Simulation(spec, bound, seed=1, policy_factory=BOUNDS[bound])
        res = sim.run(wl.arrivals.tolist(), wl.features, wl.output_tokens)
        assert all(r.status == 200 for r in res.records)
        assert len(sim._engine_hashes_of) <= HASHES_KEPT  # not the whole trace's, per replica
        hits.append(sum(r.cached_tokens for r in res.records)
                    / sum(r.prompt_tokens for r in res.records))
    assert hits[0] >= 0.9 * hits[1], hits
