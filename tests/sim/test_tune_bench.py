"""`gorgo bench tune`: the optimiser in the offline simulation's loop, and the bench around it."""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import astuple, replace
from pathlib import Path

import pytest

from gorgo.cli import main as cli_main
from gorgo.core.fleet import FleetSpec, parse_fleet
from gorgo.sim.offline import Simulation
from gorgo.sim.presets import fleet_document
from gorgo.sim.traces import chat_trace
from gorgo.sim.tune_bench import (
    TuneSettings,
    TuneTrace,
    _load_cache,
    _save_cache,
    convergence,
    fleet_for_seed,
    model_digest,
    null_config,
    tuned_run,
    wilson,
    with_weights,
)
from gorgo.sim.workload import Workload, simulate, tokenization, workload_from_requests
from tuner.optimizer import OptimizerConfig

PROFILE = "h100-llama3-8b"
# Small windows so a few hundred requests hold many evaluations.
FAST = OptimizerConfig(window_samples=5, pairs=1, bootstrap=200, calibrate=False, history=10**6)


@pytest.fixture(scope="module")
def fleet() -> FleetSpec:
    return parse_fleet(fleet_document(
        {"near": 2, "far": 1}, profile=PROFILE,
        links={"near": {"rtt_ms": 20.0, "jitter_ms": 5.0},
               "far": {"rtt_ms": 300.0, "jitter_ms": 80.0}}))


@pytest.fixture(scope="module")
def chat(fleet: FleetSpec) -> Workload:
    return workload_from_requests("chat", chat_trace(seed=3, users=20, rate=6.0, limit=300),
                                  tokenization(fleet))


def _version_at(trace: TuneTrace, t: float, initial: int = 0) -> int:
    """The router's version for a request arriving at ``t``: the last applied strictly before
    (at the same instant, the arrival is handled first), or the first one if it was applied
    before the run started."""
    times = [p[1] for p in trace.published]
    k = bisect.bisect_left(times, t)
    if k == 0 and trace.published and trace.published[0][0] == 0 and times[0] == 0.0:
        k = 1
    return trace.published[k - 1][2] if k else initial


@pytest.mark.parametrize("delay", [0.0, 0.7])
def test_every_sample_carries_the_version_live_when_it_was_routed(
    fleet: FleetSpec, chat: Workload, delay: float
) -> None:
    st = TuneSettings(FAST, (20.0, 0.05), seed=2, tick_s=0.25, publish_delay_s=delay)
    res, trace = tuned_run(fleet, chat, 1.0, st)
    assert trace.samples == len(trace.sample_log) == chat.n == len(res.records)
    assert res.leaked_inflight == 0
    versions = [p[2] for p in trace.published]
    assert versions == sorted(versions) and len(set(versions)) == len(versions) > 10
    for arrival, end, version, _ in trace.sample_log:
        assert version == _version_at(trace, arrival)
        assert end >= arrival
    ends = [x[1] for x in trace.sample_log]
    assert ends == sorted(ends)  # observed in simulated time order
    # A proposal changes the version of later decisions only: each published version routed
    # requests, and none routed a request that arrived before it was applied.
    seen = {x[2] for x in trace.sample_log}
    assert len(seen & set(versions)) > 10
    if delay:
        # decided at a tick, applied `delay` later: application times are off the tick grid
        assert any(abs(p[1] / 0.25 - round(p[1] / 0.25)) > 1e-6 for p in trace.published[1:])


def test_proposals_move_the_router_off_the_bad_start(fleet: FleetSpec, chat: Workload) -> None:
    st = TuneSettings(FAST, (20.0, 0.05), seed=1, tick_s=0.0)
    _, trace = tuned_run(fleet, chat, 1.0, st)
    weights = {(p[3], p[4]) for p in trace.published}
    assert (20.0, 0.05) in weights and len(weights) > 2  # candidates were live
    evals = [h for h in trace.history if h["event"] == "evaluation"]
    assert evals and all(h["samples"] <= trace.samples for h in evals)
    assert trace.incumbents[0][:3] == (0, 20.0, 0.05)
    assert [i[0] for i in trace.incumbents] == sorted(i[0] for i in trace.incumbents)


def test_deterministic_for_a_seed(fleet: FleetSpec, chat: Workload) -> None:
    def run(seed: int) -> tuple[list, TuneTrace]:
        res, trace = tuned_run(fleet, chat, 1.0, TuneSettings(FAST, (0.05, 20.0), seed=seed))
        return [astuple(r) for r in res.records], trace

    a, b, c = run(4), run(4), run(5)
    assert repr(a[0]) == repr(b[0])
    assert (a[1].published, a[1].sample_log, a[1].history) == (
        b[1].published, b[1].sample_log, b[1].history)
    assert a[1].published != c[1].published


def test_a_loop_that_keeps_the_weights_is_the_static_run(fleet: FleetSpec, chat: Workload) -> None:
    # A/A: new versions are published all along, but with the same weights, so every request
    # goes where the static run sends it, with the same latencies: the hooks change nothing.
    st = TuneSettings(null_config(FAST), (1.0, 1.0), seed=3, tick_s=0.25, null=True)
    res, trace = tuned_run(fleet, chat, 1.0, st)
    static = simulate(with_weights(fleet, 1.0, 1.0), "gorgo", chat, 1.0, 3)
    assert len(trace.published) > 10
    assert [astuple(r) for r in res.records] == [astuple(r) for r in static.records]
    evals = [h for h in trace.history if h["event"] == "evaluation"]
    assert evals and all(h["incumbent"] == h["candidate"] == [1.0, 1.0] for h in evals)


def test_simulation_hooks(fleet: FleetSpec, chat: Workload) -> None:
    seen: list[tuple[float, int, int]] = []
    calls: list[float] = []
    spec = fleet_for_seed(fleet, 1)
    sim = Simulation(spec, "gorgo", seed=1,
                     on_complete=lambda rec, d: seen.append((sim.now, rec.index, d.replica)))

    def every_second() -> None:
        calls.append(sim.now)
        sim.call_at(sim.now + 1.0, every_second)

    sim.call_at(0.5, every_second)
    res = sim.run(chat.arrivals.tolist(), chat.features, chat.output_tokens)
    assert sorted(i for _, i, _ in seen) == list(range(chat.n))  # once per routed request
    assert [t for t, _, _ in seen] == sorted(t for t, _, _ in seen)
    assert all(res.records[i].replica == rep for _, i, rep in seen)
    assert calls[:3] == [0.5, 1.5, 2.5]
    assert calls[-1] <= res.sim_time_s  # a self-rescheduling callback does not keep it running
    plain = simulate(fleet, "gorgo", chat, 1.0, 1)
    assert [astuple(r) for r in res.records] == [astuple(r) for r in plain.records]


def test_convergence_is_from_when_the_incumbent_stays_within() -> None:
    at = [0, 300, 700, 1200]
    assert convergence([3.0, 1.02, 1.2, 1.04], at, 0.05) == {
        "first_within": 300, "stays_within": 1200}
    assert convergence([1.01, 1.03], [0, 500], 0.05) == {"first_within": 0, "stays_within": 0}
    assert convergence([3.0, 1.01, 1.5], at[:3], 0.05) == {
        "first_within": 300, "stays_within": None}
    lo, hi = wilson(5, 100)
    assert 0.0 <= lo < 0.05 < hi < 0.12


def test_cli_tiny_slice_writes_its_outputs(tmp_path: Path) -> None:
    out = tmp_path / "tune"
    argv = ["bench", "tune", "--trace", "chat:seed=2,users=8,rate=3,limit=80", "--fleet", "paper",
            "--capacity", "3", "--grid", "2", "--seeds", "1", "--jobs", "1",
            "--start", "20,0.05", "--opt", "window_samples=5", "--opt", "pairs=1",
            "--opt", "bootstrap=200", "--out", str(out)]
    assert cli_main(argv) == 0
    for name in ("results.json", "results.md", "tune_convergence.png", "tune_grid.png",
                 "static_cache.json"):
        assert (out / name).stat().st_size > 0
    doc = json.loads((out / "results.json").read_text())
    assert len(doc["grid"]) == 4
    assert doc["optimizer"]["window_samples"] == 5
    guarded = [r for r in doc["runs"] if r["e2e_guard"]]
    free = [r for r in doc["runs"] if not r["e2e_guard"]]
    assert len(guarded) == len(free) == 1 and doc["null_runs"]
    run = guarded[0]
    assert run["start"] == [20.0, 0.05] and run["samples"] == doc["requests"]
    assert run["incumbents"][0]["samples"] == 0
    assert all(math.isfinite(i["ratio"]) for i in run["incumbents"])
    md = (out / "results.md").read_text()
    assert "gorgo bench tune" in md and "## Grid" in md and "E2E guard" in md
    (out / "results.md").unlink()
    assert cli_main([*argv, "--report-only"]) == 0  # from results.json alone
    assert (out / "results.md").read_text() == md
    (cache,) = json.loads((out / "static_cache.json").read_text()).values()
    assert len(cache) >= len(doc["grid"])  # the grid and every re-run incumbent, for next time


def test_bad_arguments_exit_2(tmp_path: Path) -> None:
    base = ["bench", "tune", "--trace", "chat:limit=20", "--capacity", "1",
            "--out", str(tmp_path)]
    assert cli_main([*base, "--start", "1"]) == 2
    assert cli_main([*base, "--opt", "no_such_field=1"]) == 2
    assert cli_main([*base, "--opt", "pairs=0"]) == 2
    assert cli_main([*base, "--grid", "1"]) == 2


@pytest.mark.parametrize("bench", ["tune", "sim"])
def test_a_trace_that_cannot_be_loaded_exits_2(bench: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bench", bench, "--trace", "no-such-trace", "--capacity", "1",
                     "--out", str(tmp_path)]) == 2
    assert f"bench {bench}: cannot load 'no-such-trace'" in capsys.readouterr().err


def test_with_weights_replaces_only_what_it_is_given(fleet: FleetSpec) -> None:
    name = fleet.replicas[0].name
    f = with_weights(fleet, 2.0, 0.5, {name: 123.0})
    assert (f.weights.rtt, f.weights.queue) == (2.0, 0.5)
    assert f.replicas[0].prefill_rate == 123.0
    assert [r.prefill_rate for r in f.replicas[1:]] == [r.prefill_rate for r in fleet.replicas[1:]]
    assert replace(f, weights=fleet.weights, replicas=fleet.replicas) == fleet


def test_static_cache_is_per_slice_and_code(tmp_path: Path) -> None:
    path = tmp_path / "static.json"
    old = "mooncake|paper|n=5|scale=1.0|gorgo|code=aaa"
    new = "mooncake|paper|n=5|scale=1.0|gorgo|code=bbb"
    other = "mooncake|paper|n=9|scale=1.0|gorgo|code=aaa"
    _save_cache(path, old, {"k": {"ttft_p95_ms": 1.0}})
    _save_cache(path, other, {"k": {"ttft_p95_ms": 2.0}})
    assert _load_cache(path, old) == {"k": {"ttft_p95_ms": 1.0}}
    assert _load_cache(path, new) == {}  # the simulation changed: nothing is reused
    _save_cache(path, new, {"k": {"ttft_p95_ms": 3.0}})
    assert _load_cache(path, old) == {}  # and the stale entries of this slice are dropped
    assert _load_cache(path, other) == {"k": {"ttft_p95_ms": 2.0}}
    assert len(model_digest()) == 16
