"""Several independent routers in the offline simulation (gorgo/sim/routers.py)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import astuple, replace
from pathlib import Path

import numpy as np
import pytest

from gorgo.cli import main as cli_main
from gorgo.core.decision import Decision, Rejection
from gorgo.core.features import RequestFeatures
from gorgo.core.fleet import FleetSpec, Sharing, parse_fleet
from gorgo.sim import offline
from gorgo.sim.bench import pct, run_metrics
from gorgo.sim.offline import RequestRecord, SimResult, Simulation
from gorgo.sim.presets import fleet_document
from gorgo.sim.routers import (
    SAME,
    SPREAD,
    assign_routers,
    client_legs,
    client_regions,
    fleet_regions,
    link_from,
    router_regions,
    view_from,
)
from gorgo.sim.traces import TraceRequest, chat_trace
from gorgo.sim.workload import Workload, simulate, tokenization, workload_from_requests

PROFILE = "h100-llama3-8b"
LINKS = {"home": {"rtt_ms": 10.0, "jitter_ms": 1.0}, "mid": {"rtt_ms": 200.0, "jitter_ms": 20.0},
         "far": {"rtt_ms": 400.0, "jitter_ms": 40.0}}


def _fleet(cache: str = "approximate") -> FleetSpec:
    return parse_fleet(fleet_document({"home": 2, "mid": 1, "far": 1}, profile=PROFILE,
                                      links=LINKS, cache=cache))


@pytest.fixture(scope="module")
def fleet() -> FleetSpec:
    return _fleet()


@pytest.fixture(scope="module")
def chat(fleet: FleetSpec) -> Workload:
    reqs = chat_trace(seed=5, users=20, rate=10.0, limit=200)
    return workload_from_requests("chat", reqs, tokenization(fleet))


def _rows(res: SimResult) -> list[str]:
    return [repr(astuple(r)) for r in res.records]


@pytest.mark.parametrize("cache", ["approximate", "precise"])
def test_one_router_is_the_one_router_run(chat: Workload, cache: str) -> None:
    # K = 1 (either placement) makes the very draws and decisions of the path every caller uses.
    spec = _fleet(cache)
    head = chat.head(80)
    plain = simulate(spec, "gorgo", head, 1.0, seed=2)
    for placement in (SAME, SPREAD):
        res = simulate(spec, "gorgo", head, 1.0, seed=2, routers=1, placement=placement)
        assert _rows(res) == _rows(plain)
        assert res.events == plain.events and res.extra == plain.extra


def test_placement_regions(fleet: FleetSpec) -> None:
    assert router_regions(fleet, 3, SAME) == ["home"] * 3
    assert router_regions(fleet, 5, SPREAD) == ["home", "mid", "far", "home", "mid"]
    with pytest.raises(ValueError, match="routers must be >= 1"):
        router_regions(fleet, 0, SAME)
    with pytest.raises(ValueError, match="placement"):
        router_regions(fleet, 2, "everywhere")


def test_same_region_arrivals_split_evenly_and_follow_the_seed(fleet: FleetSpec,
                                                                chat: Workload) -> None:
    f = chat.features
    a = assign_routers(f, fleet, ["home"] * 4, SAME, seed=1)
    assert a.tolist() == assign_routers(f, fleet, ["home"] * 4, SAME, seed=1).tolist()
    assert a.tolist() != assign_routers(f, fleet, ["home"] * 4, SAME, seed=2).tolist()
    counts = Counter(a.tolist())
    assert set(counts) == {0, 1, 2, 3}
    assert max(counts.values()) < 2 * min(counts.values())


def test_spread_arrivals_come_from_each_region_and_keep_sessions(fleet: FleetSpec,
                                                                  chat: Workload) -> None:
    regions = ["home", "mid", "far", "home", "mid"]
    a = assign_routers(chat.features, fleet, regions, SPREAD, seed=3)
    assert a.tolist() == assign_routers(chat.features, fleet, regions, SPREAD, seed=3).tolist()
    # Every request reaches a router of its client's region.
    names = fleet_regions(fleet)
    clients = client_regions(chat.features, fleet, seed=3)
    assert [regions[j] for j in a] == [names[c] for c in clients]
    region = [regions[j] for j in a]
    # A session's requests all come from one region (one client) ...
    of_session: dict[str | None, set[str]] = {}
    for f, r in zip(chat.features, region, strict=True):
        of_session.setdefault(f.session_key, set()).add(r)
    assert None not in of_session and len(of_session) == 20
    assert all(len(v) == 1 for v in of_session.values())
    # ... and the clients are spread evenly over the regions.
    clients = Counter(next(iter(v)) for v in of_session.values())
    assert set(clients) == {"home", "mid", "far"}
    assert max(clients.values()) - min(clients.values()) <= 1
    # Both routers of a region get its clients' requests.
    assert {int(j) for j in a if regions[j] == "home"} == {0, 3}


def test_clients_of_a_region_without_a_router_go_to_the_nearest(fleet: FleetSpec,
                                                               chat: Workload) -> None:
    # Two spread routers cover home and mid; far's clients (400 ms from home, max(400, 200) from
    # mid) reach home, the nearer. The clients themselves are the same whatever the routers.
    regions = router_regions(fleet, 2, SPREAD)
    assert regions == ["home", "mid"]
    names = fleet_regions(fleet)
    clients = [names[c] for c in client_regions(chat.features, fleet, seed=3)]
    assert Counter(clients).keys() == {"home", "mid", "far"}
    a = assign_routers(chat.features, fleet, regions, SPREAD, seed=3)
    for c, j in zip(clients, a, strict=True):
        assert regions[j] == ("home" if c == "far" else c)


@pytest.mark.parametrize(("routers", "placement"), [(1, SAME), (4, SAME), (4, SPREAD)])
def test_a_clients_leg_is_the_rtt_between_its_region_and_its_routers(
        fleet: FleetSpec, chat: Workload, routers: int, placement: str) -> None:
    regions = router_regions(fleet, routers, placement)
    home = assign_routers(chat.features, fleet, regions, placement, seed=3)
    legs = client_legs(chat.features, fleet, regions, home, seed=3)
    names = fleet_regions(fleet)
    clients = client_regions(chat.features, fleet, seed=3)
    assert legs.tolist() == [link_from(fleet, names[c], regions[j])[0]
                             for c, j in zip(clients, home, strict=True)]
    if placement == SPREAD:  # every client has a router in its own region
        assert set(legs.tolist()) == {10.0}
    else:  # one proxy: the far clients pay the far link
        assert set(legs.tolist()) == {10.0, 200.0, 400.0}


def test_the_client_figures_add_the_leg(fleet: FleetSpec, chat: Workload) -> None:
    head = chat.head(60)
    res = simulate(fleet, "gorgo", head, 1.0, seed=2)
    legs = np.array([r.client_ms for r in res.records])
    assert set(legs.tolist()) == {10.0, 200.0, 400.0}
    m, _ = run_metrics(res, fleet)
    ttft = np.array([r.ttft * 1000.0 for r in res.records])
    assert m["client_ttft_p95_ms"] == pytest.approx(pct(ttft + legs, 95))
    assert m["client_ttft_p95_ms"] > m["ttft_p95_ms"]


def test_each_router_sees_only_its_own_decisions(fleet: FleetSpec, chat: Workload) -> None:
    done: list[tuple[RequestRecord, Decision]] = []
    sim = Simulation(replace(fleet, name="t"), "gorgo", seed=4, routers=3, placement=SAME,
                     on_complete=lambda rec, d: done.append((rec, d)))
    res = sim.run(chat.arrivals.tolist(), chat.features, chat.output_tokens)
    home = sim.home
    assert len(done) == chat.n and all(r.status == 200 for r in res.records)
    for rec, d in done:  # every decision was made by the router its request arrived at
        j = int(home[rec.index])
        assert d.id.startswith("s4-" if j == 0 else f"s4r{j}-")
    for j, side in enumerate(sim.sides):
        state = side.router.state
        mine = int((home == j).sum())
        assert sum(side.router.routed[state.weights.version].values()) == mine > 0
        assert side.router.open_requests == 0 and int(state.inflight_reqs.sum()) == 0
        # Its prefix index holds no block only the other routers sent.
        own = {int(h) for k in np.flatnonzero(home == j) for h in chat.features[k].block_hashes}
        others = {int(h) for k in np.flatnonzero(home != j)
                  for h in chat.features[k].block_hashes} - own
        assert others
        assert not any(state.prefix.match(np.array([h], dtype=np.uint64)).any() for h in others)
    assert res.leaked_inflight == 0


def test_routers_of_a_sharing_fleet_count_each_others_requests(fleet: FleetSpec,
                                                              chat: Workload) -> None:
    """With `sharing:` every router applies the others' bookings one delay later: each one's
    prefix index then holds what the others sent, and every booking is released again."""
    shared = replace(fleet, name="t", sharing=Sharing("nats://127.0.0.1:4222", "gorgo.t"))
    sim = Simulation(shared, "gorgo", seed=4, routers=3, placement=SPREAD)
    res = sim.run(chat.arrivals.tolist(), chat.features, chat.output_tokens)
    assert all(r.status == 200 for r in res.records) and res.leaked_inflight == 0
    home = sim.home
    for j, side in enumerate(sim.sides):
        others = int((home != j).sum())
        assert side.router.peers.applied >= 2 * others - 2 * len(sim.sides)  # last closes in flight
        assert side.router.peers.ignored == 0 and side.router.peers.expired == 0
        blocks = {int(h) for k in np.flatnonzero(home != j) for h in chat.features[k].block_hashes}
        held = side.router.state.prefix.match(np.array(sorted(blocks), dtype=np.uint64))
        assert held.any()  # what the other routers sent is in this one's index


def test_links_seen_from_another_region(fleet: FleetSpec) -> None:
    assert link_from(fleet, "home", "far") == (400.0, 40.0)
    assert link_from(fleet, "far", "far") == (10.0, 1.0)  # in-region: the proxy region's own
    assert link_from(fleet, "far", "home") == (400.0, 40.0)
    assert link_from(fleet, "mid", "far") == (400.0, 40.0)  # the longer leg from home
    assert view_from(fleet, "home") is fleet
    far = view_from(fleet, "far")
    assert far.proxy_region == "far"
    assert {r.name: r.rtt_ms for r in far.regions} == {"home": 400.0, "mid": 400.0, "far": 10.0}


def test_spread_routers_measure_and_use_their_own_region_rtts(
    fleet: FleetSpec, chat: Workload
) -> None:
    sim = Simulation(replace(fleet, name="t"), "gorgo", seed=1, routers=3, placement=SPREAD)
    res = sim.run(chat.arrivals.tolist(), chat.features, chat.output_tokens)
    region_of = [r.region for r in fleet.replicas]
    for side in sim.sides:
        expected = np.array([link_from(fleet, side.region, g)[0] for g in region_of])
        rtt = side.router.state.rtt_ms
        assert np.all(np.abs(rtt - expected) < 0.35 * expected + 5.0), (side.region, rtt)
    # Each region's router keeps most of its requests in its own region.
    local = Counter()
    total = Counter()
    for r in res.records:
        j = int(sim.home[r.index])
        total[j] += 1
        local[j] += region_of[r.replica] == sim.sides[j].region
    assert all(local[j] > 0.5 * total[j] for j in range(3))


def test_bench_sim_runs_k_routers(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    argv = ["bench", "sim", "--trace", "chat:seed=1", "--requests", "40", "--fleet", "paper",
            "--policies", "gorgo", "--seeds", "1", "--load", "0.8", "--capacity", "5",
            "--out", str(out), "--jobs", "1", "--routers", "2", "--router-placement", "spread"]
    assert cli_main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    assert [(r["routers"], r["placement"]) for r in doc["runs"]] == [(2, SPREAD)]
    assert "--routers 2 --router-placement spread" in doc["command"]
    assert "2 independent routers" in (out / "results.md").read_text()


@pytest.mark.parametrize("extra", [["--routers", "0"], ["--routers", "2", "--policies", "oracle"]])
def test_bench_sim_refuses_bad_router_options(tmp_path: Path, extra: list[str],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "sim", "--trace", "chat:seed=1", "--requests", "50", "--out",
            str(tmp_path), "--jobs", "1", *extra]
    assert cli_main(argv) == 2
    assert "routers" in capsys.readouterr().err


def _burst_pairs(stagger_ms: float) -> tuple[list[float], int]:
    """Two routers in one region sharing bookings, two equal replicas, unique prompts of one
    size: after a warm-up every arrival is a pair at one instant, one request at each router.
    (router 1's hold before each decision, pairs split over the two replicas)"""
    doc = fleet_document({"home": 2}, profile=PROFILE, links=LINKS)
    doc["sharing"] = {"nats": "nats://127.0.0.1:4222", "stagger_ms": stagger_ms}
    spec = parse_fleet(doc)
    arrivals = [0.1 * k for k in range(20)] + [3.0 + 0.5 * (k // 2) for k in range(40)]
    work = workload_from_requests("pairs", [TraceRequest(k, t, 2000, 8)
                                            for k, t in enumerate(arrivals)], tokenization(spec))
    sim = Simulation(spec, "gorgo", seed=3, routers=2, placement=SAME)
    route, held = sim.sides[1].router.route, []

    def timed(f: RequestFeatures, now: float) -> Decision | Rejection:
        held.append(now - arrivals[work.features.index(f)])
        return route(f, now)

    sim.sides[1].router.route = timed  # type: ignore[method-assign]
    with pytest.MonkeyPatch.context() as mp:  # request k at router k % 2
        mp.setattr(offline, "assign_routers", lambda *_a: np.arange(60) % 2)
        res = sim.run(arrivals, work.features, work.output_tokens)
    assert all(r.status == 200 for r in res.records)
    rec = res.records
    return held, sum(rec[k].replica != rec[k + 1].replica for k in range(20, 60, 2))


def test_routers_of_one_region_take_turns_and_split_a_burst() -> None:
    """With shared bookings the router ranked second holds each request ``stagger_ms`` once it
    has heard from its peer, so the pair of one instant goes to two replicas; without the
    stagger both routers see the same state at the same moment and pairs collide."""
    held, split = _burst_pairs(2.0)
    # Router 0's first booking reached it before its first request: every one waited its turn.
    assert held == pytest.approx([0.002] * 30)
    held_off, split_off = _burst_pairs(0.0)
    assert held_off == [0.0] * 30
    assert split == 20 > split_off, (split, split_off)
