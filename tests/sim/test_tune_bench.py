"""`gorgo bench tune`: the optimiser in the offline simulation's loop, and the bench around it."""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import astuple, replace
from pathlib import Path

import pytest

from gorgo.cli import main as cli_main
from gorgo.core.decision import Decision
from gorgo.core.fleet import FleetSpec, parse_fleet
from gorgo.core.weights import Weights
from gorgo.sim.offline import RequestRecord, Simulation
from gorgo.sim.presets import fleet_document
from gorgo.sim.traces import chat_trace
from gorgo.sim.tunebench.points import grid, grid_axes, parse_start, point_key, static_key
from gorgo.sim.tunebench.run import (
    TuneSettings,
    TuneTrace,
    fleet_for_seed,
    load_cache,
    model_digest,
    null_config,
    sample_of,
    save_cache,
    tuned_run,
    with_weights,
)
from gorgo.sim.tunebench.stats import convergence, grid_best, stretch_interval, wilson
from gorgo.sim.workload import Workload, simulate, tokenization, workload_from_requests
from tuner.optimizer import OptimizerConfig

PROFILE = "h100-llama3-8b"
# Small windows so a few hundred requests hold many evaluations.
FAST = OptimizerConfig(window_samples=5, pairs=1, bootstrap=200, calibrate=False, history=10**6)


def W(rtt: float, queue: float) -> dict[str, float]:
    return {"rtt": rtt, "queue": queue}


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
    st = TuneSettings(FAST, W(20.0, 0.05), seed=2, tick_s=0.25, publish_delay_s=delay)
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
    st = TuneSettings(FAST, W(20.0, 0.05), seed=1, tick_s=0.0)
    _, trace = tuned_run(fleet, chat, 1.0, st)
    weights = {tuple(p[3].items()) for p in trace.published}
    assert tuple(W(20.0, 0.05).items()) in weights and len(weights) > 2  # candidates were live
    evals = [h for h in trace.history if h["event"] == "evaluation"]
    assert evals and all(h["samples"] <= trace.samples for h in evals)
    assert trace.incumbents[0][:2] == (0, W(20.0, 0.05))
    assert [i[0] for i in trace.incumbents] == sorted(i[0] for i in trace.incumbents)


def test_deterministic_for_a_seed(fleet: FleetSpec, chat: Workload) -> None:
    def run(seed: int) -> tuple[list, TuneTrace]:
        res, trace = tuned_run(fleet, chat, 1.0, TuneSettings(FAST, W(0.05, 20.0), seed=seed))
        return [astuple(r) for r in res.records], trace

    a, b, c = run(4), run(4), run(5)
    assert repr(a[0]) == repr(b[0])
    assert (a[1].published, a[1].sample_log, a[1].history) == (
        b[1].published, b[1].sample_log, b[1].history)
    assert a[1].published != c[1].published


def test_a_loop_that_keeps_the_weights_is_the_static_run(fleet: FleetSpec, chat: Workload) -> None:
    # A/A: new versions are published all along, but with the same weights, so every request
    # goes where the static run sends it, with the same latencies: the hooks change nothing.
    st = TuneSettings(null_config(FAST), W(1.0, 1.0), seed=3, tick_s=0.25, null=True)
    res, trace = tuned_run(fleet, chat, 1.0, st)
    static = simulate(with_weights(fleet, W(1.0, 1.0)), "gorgo", chat, 1.0, 3)
    assert len(trace.published) > 10
    assert [astuple(r) for r in res.records] == [astuple(r) for r in static.records]
    evals = [h for h in trace.history if h["event"] == "evaluation"]
    assert evals and all(h["incumbent"] == h["candidate"] == W(1.0, 1.0) for h in evals)


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


def test_a_burst_every_seed_meets_widens_the_a_a_interval() -> None:
    """20 stretches of 10 verdicts (10 seeds); in one stretch every seed accepts: 10 of 200,
    but one trial's worth of evidence, not ten."""
    verdicts = [(250 * k + seed, int(k == 3)) for k in range(20) for seed in range(10)]
    lo, hi, stretches = stretch_interval(verdicts)
    whi = wilson(10, 200)[1]
    assert stretches == 20 and lo == 0.0 and hi > whi and hi >= 0.1
    spread = [(250 * k + seed, int(seed == k % 10)) for k in range(20) for seed in range(10)]
    lo, hi, _ = stretch_interval(spread)  # one acceptance per stretch: no stretch differs
    assert lo == hi == 0.1
    assert stretch_interval([]) == (0.0, 1.0, 0)


@pytest.mark.slow
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
    assert doc["weight_keys"] == ["rtt", "queue"]
    assert set(doc["grid_points"]) == {"rtt", "queue"}
    assert all(set(g["weights"]) == {"rtt", "queue"} for g in doc["grid"].values())
    assert doc["optimizer"]["window_samples"] == 5
    guarded = [r for r in doc["runs"] if r["e2e_guard"]]
    free = [r for r in doc["runs"] if not r["e2e_guard"]]
    assert len(guarded) == len(free) == 1 and doc["null_runs"]
    run = guarded[0]
    assert run["start"] == W(20.0, 0.05) and run["samples"] == doc["requests"]
    assert set(run["final"]["weights"]) == {"rtt", "queue"}
    assert run["incumbents"][0]["samples"] == 0
    assert all(math.isfinite(i["ratio"]) for i in run["incumbents"])
    md = (out / "results.md").read_text()
    assert "gorgo bench tune" in md and "## Grid" in md and "E2E guard" in md
    (out / "results.md").unlink()
    assert cli_main([*argv, "--report-only"]) == 0  # from results.json alone
    assert (out / "results.md").read_text() == md
    (cache,) = json.loads((out / "static_cache.json").read_text()).values()
    assert len(cache) >= len(doc["grid"])  # the grid and every re-run incumbent, for next time


def test_early_samples_reach_the_tuner_at_the_first_token_once_each(
        fleet: FleetSpec, chat: Workload) -> None:
    st = TuneSettings(FAST, W(20.0, 0.05), seed=2)
    res, early = tuned_run(fleet, chat, 1.0, st)
    res_ends, ends = tuned_run(fleet, chat, 1.0, replace(st, early=False))
    assert early.samples == len(early.sample_log) == ends.samples == chat.n  # none counted twice
    served = [r for r in res.records if r.status == 200]
    got = sorted(round(x[1], 9) for x in early.sample_log if math.isfinite(x[3]))
    assert got == sorted(round(r.arrival + r.ttft, 9) for r in served)  # at the first token
    got_ends = sorted(round(x[1], 9) for x in ends.sample_log if math.isfinite(x[3]))
    assert got_ends == sorted(round(r.arrival + r.e2e, 9)
                              for r in res_ends.records if r.status == 200)  # at the end
    first = [next(h["t"] for h in t.history if h["event"] == "evaluation") for t in (early, ends)]
    assert first[0] < first[1]  # the first window closes sooner on first tokens
    evals = [h for h in early.history if h["event"] == "evaluation"]
    assert any(h["e2e_incumbent"] is not None for h in evals)  # the ends still join in


@pytest.mark.slow
def test_the_e2e_objective_searches_its_weights_and_ranks_the_grid_on_e2e(
        tmp_path: Path) -> None:
    out = tmp_path / "tune"
    argv = ["bench", "tune", "--trace", "chat:seed=2,users=8,rate=3,limit=80", "--fleet", "paper",
            "--capacity", "3", "--grid", "2", "--seeds", "1", "--jobs", "1", "--skip-null",
            "--objective", "e2e", "--start", "20,0.05,1,1,1", "--opt", "window_samples=5",
            "--opt", "pairs=1", "--opt", "bootstrap=200", "--out", str(out)]
    assert cli_main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["optimizer"]["objective"] == "e2e"
    assert all(set(g["weights"]) == {"rtt", "queue"} for g in doc["grid"].values())
    best = min(doc["grid"].values(), key=lambda g: g["e2e_p95_ms"])
    assert doc["grid_best"]["weights"] == best["weights"]
    keys = {"rtt", "queue", "decode", "interference", "reuse"}
    for run in doc["runs"]:
        assert set(run["start"]) == set(run["final"]["weights"]) == keys
        assert run["target_p95_ms"] == best["e2e_p95_ms"]
        for inc in run["incumbents"]:
            assert inc["ratio"] == pytest.approx(inc["static_e2e_p95_ms"] / best["e2e_p95_ms"])
    assert "--objective e2e" in doc["command"]
    md = (out / "results.md").read_text()
    assert "objective `e2e`" in md
    # The routers score under e2e too (their static runs are cached apart from ttft's), and the
    # grid points near the best are counted on p95 E2E, the objective's metric.
    cache = json.loads((out / "static_cache.json").read_text())
    assert all("|objective=e2e|" in key for key in cache)
    assert all("|w=" in key for key in cache)  # the requests' digest: a rewritten trace re-runs
    near = sum(v <= 1.05 * doc["grid_best"]["mean_p95_ms"]
               for v in doc["grid_mean_e2e_p95_ms"].values())
    assert f"; {near} of 4 grid points are within 5% of it." in md
    assert cli_main([*argv[:-2], "--start", "20,0.05", "--out", str(out)]) == 2  # 5 weights
    # Starts that differ only beyond (rtt, queue) are two starts, named by all five weights
    # (they were both "20, 0.05", their medians merged and their guard runs crossed).
    two = tmp_path / "two"
    assert cli_main([*argv[:-4], "--start", "20,0.05,1,1,1", "--start", "20,0.05,20,20,20",
                     "--out", str(two)]) == 0
    md = (two / "results.md").read_text()
    assert "start (20, 0.05, 1, 1, 1)" in md and "start (20, 0.05, 20, 20, 20)" in md
    assert "| p95 E2E / best on |" in md


def test_null_only_runs_the_a_a_runs_alone(tmp_path: Path) -> None:
    """Many seeds of A/A runs, for the false-accept rate, without the grid or tuned runs."""
    out = tmp_path / "aa"
    argv = ["bench", "tune", "--trace", "chat:seed=2,users=8,rate=3,limit=80", "--fleet", "paper",
            "--capacity", "3", "--seeds", "2", "--jobs", "1", "--null-only", "--opt",
            "window_samples=5", "--opt", "pairs=1", "--opt", "bootstrap=200", "--out", str(out)]
    assert cli_main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    assert "grid" not in doc and "runs" not in doc and "--null-only" in doc["command"]
    assert [r["seed"] for r in doc["null_runs"]] == [1, 2]
    total = doc["null_total"]
    assert total["evaluations"] == sum(r["evaluations"] for r in doc["null_runs"]) > 0
    assert total["accepted"] == sum(r["accepted"] for r in doc["null_runs"])
    assert all(len(r["verdicts"]) == r["evaluations"] for r in doc["null_runs"])
    assert 0.0 <= total["ci95_stretches"][0] <= total["ci95_stretches"][1] <= 1.0
    md = (out / "results.md").read_text()
    assert "False accepts" in md and "resampling whole stretches" in md
    assert not list(out.glob("*.png"))
    (out / "results.md").unlink()
    assert cli_main([*argv, "--report-only"]) == 0 and (out / "results.md").read_text() == md
    assert cli_main([*argv, "--skip-null"]) == 2


def test_bad_arguments_exit_2(tmp_path: Path) -> None:
    base = ["bench", "tune", "--trace", "chat:limit=20", "--capacity", "1",
            "--out", str(tmp_path)]
    assert cli_main([*base, "--start", "1"]) == 2
    assert cli_main([*base, "--start", "warp=2"]) == 2
    assert cli_main([*base, "--opt", "no_such_field=1"]) == 2
    assert cli_main([*base, "--opt", "pairs=0"]) == 2
    assert cli_main([*base, "--grid", "1"]) == 2
    for bad in ("1", "3/3", "-1/2", "a/b"):
        assert cli_main([*base, "--window", bad]) == 2


def test_a_trace_window_is_the_slice_bench_sim_draws(tmp_path: Path) -> None:
    """``--window W/K``: the A/A runs on window W of K, as `gorgo bench sim --windows K` cuts
    the trace (the chat generator: its seed + W), named in results.json."""
    out = tmp_path / "w"
    argv = ["bench", "tune", "--trace", "chat:seed=2,users=8,rate=3,limit=80", "--fleet", "paper",
            "--capacity", "3", "--seeds", "1", "--jobs", "1", "--null-only", "--window", "1/2",
            "--opt", "window_samples=5", "--opt", "pairs=1", "--opt", "bootstrap=200",
            "--out", str(out)]
    assert cli_main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["slice"].startswith("chat:seed=3,") and doc["slice"].endswith("[0:70]")
    assert "--window 1/2" in doc["command"] and doc["slice"] in (out / "results.md").read_text()


@pytest.mark.parametrize("bench", ["tune", "sim"])
def test_a_trace_that_cannot_be_loaded_exits_2(bench: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bench", bench, "--trace", "no-such-trace", "--capacity", "1",
                     "--out", str(tmp_path)]) == 2
    assert f"bench {bench}: cannot load 'no-such-trace'" in capsys.readouterr().err


def test_with_weights_replaces_only_what_it_is_given(fleet: FleetSpec) -> None:
    name = fleet.replicas[0].name
    f = with_weights(fleet, W(2.0, 0.5), {name: 123.0})
    assert f.weights == Weights(W(2.0, 0.5))
    assert f.replicas[0].prefill_rate == 123.0
    assert [r.prefill_rate for r in f.replicas[1:]] == [r.prefill_rate for r in fleet.replicas[1:]]
    assert replace(f, weights=fleet.weights, replicas=fleet.replicas) == fleet


def test_static_cache_is_per_slice_and_code(tmp_path: Path) -> None:
    path = tmp_path / "static.json"
    old = "mooncake|paper|n=5|scale=1.0|gorgo|code=aaa"
    new = "mooncake|paper|n=5|scale=1.0|gorgo|code=bbb"
    other = "mooncake|paper|n=9|scale=1.0|gorgo|code=aaa"
    save_cache(path, old, {"k": {"ttft_p95_ms": 1.0}})
    save_cache(path, other, {"k": {"ttft_p95_ms": 2.0}})
    assert load_cache(path, old) == {"k": {"ttft_p95_ms": 1.0}}
    assert load_cache(path, new) == {}  # the simulation changed: nothing is reused
    save_cache(path, new, {"k": {"ttft_p95_ms": 3.0}})
    assert load_cache(path, old) == {}  # and the stale entries of this slice are dropped
    assert load_cache(path, other) == {"k": {"ttft_p95_ms": 2.0}}
    assert len(model_digest()) == 16


def test_the_digest_covers_the_code_that_scores_a_run(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A change to `run_metrics` (what a static run's p95 is) kept the digest, and the grid
    scored the old way was reused beside tuned runs scored the new way."""
    import importlib.util

    import gorgo.sim.bench as bench

    before = model_digest()
    copy = tmp_path / "bench.py"
    copy.write_text(Path(bench.__file__).read_text() + "\n# scored otherwise\n")
    real = importlib.util.find_spec

    def find_spec(name: str, *args: object):
        spec = real(name, *args)
        if name == "gorgo.sim.bench":
            spec.origin = str(copy)
        return spec

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert model_digest() != before


def test_a_request_at_time_zero_reaches_the_tuner_with_its_arrival(
        fleet: FleetSpec, chat: Workload) -> None:
    """Simulated times go out as Unix times: 0 is the tuner's "start unknown", so the requests
    at t = 0 lost their place in their window's arrival order."""
    rec = RequestRecord(0, 0.0, 100, 10, replica=0, status=200, ttft=0.5, e2e=1.0)
    d = Decision(replica=0, policy="gorgo", scores=None)
    sample = sample_of(rec, d, fleet, 1.0)
    assert sample.arrival_s > 0 and sample.start_unix_s + 1.0 == sample.end_unix_s


def test_start_points_grid_and_keys_follow_the_registry() -> None:
    assert parse_start("20,0.05") == W(20.0, 0.05)  # values in registry order
    assert parse_start("queue=0.5") == W(1.0, 0.5)  # named; the rest at its default
    assert parse_start("rtt=2, queue=3") == W(2.0, 3.0)
    for bad in ("1", "1,2,3", "warp=1", "rtt=0,queue=1", "rtt=x"):
        with pytest.raises(ValueError, match="--start"):
            parse_start(bad)
    axes = grid_axes({"rtt": (0.1, 10.0), "queue": (1.0, 4.0)}, 3)
    assert axes == {"rtt": [pytest.approx(0.1), pytest.approx(1.0), pytest.approx(10.0)],
                    "queue": [pytest.approx(1.0), pytest.approx(2.0), pytest.approx(4.0)]}
    points = grid(axes)
    assert len(points) == 9 and all(list(p) == ["rtt", "queue"] for p in points)
    # the cache key of two weights is the one earlier versions of the bench wrote
    assert static_key(W(1.0, 0.5), {"r1": 3.0}, 2) == "1.0|0.5|r1=3.0|2"
    assert point_key(W(1.0, 0.5)) == "1.0|0.5"
    static = {static_key(p, {}, s): {"ttft_p95_ms": 100.0 + p["rtt"] + 10 * p["queue"] + s,
                                     "e2e_p95_ms": 1.0} for p in points for s in (1, 2)}
    best = grid_best(points, [1, 2], static)
    assert best.weights == {"rtt": pytest.approx(0.1), "queue": pytest.approx(1.0)}
    assert best.per_seed_p95_ms == {1: pytest.approx(111.1), 2: pytest.approx(112.1)}


def test_a_third_weight_makes_a_cartesian_grid() -> None:
    """Written for any number of weights: K values each, every combination."""
    axes = {"a": [1.0, 2.0], "b": [3.0, 4.0, 5.0], "c": [6.0, 7.0]}
    points = grid(axes, ("a", "b", "c"))
    assert len(points) == 12 and len({tuple(p.values()) for p in points}) == 12
    assert points[0] == {"a": 1.0, "b": 3.0, "c": 6.0} and points[1] == {"a": 1.0, "b": 3.0,
                                                                          "c": 7.0}


def test_the_report_imports_matplotlib_only_to_draw() -> None:
    import subprocess
    import sys

    code = ("import sys, gorgo.sim.tunebench.cli, gorgo.sim.tunebench.report\n"
            "print('matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "False"
