"""bench/peers.py's arguments and --resume, without starting a router: every live and offline run
is replaced by a failure, so a test passes only if the script stops (or renders) before them."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from bench import peers
from gorgo.sim.replay import RequestRecord

SLICE = ["--routers", "gorgo", "--duration", "5", "--loads", "0.6", "--sim-seeds", "0"]


_RUN_OFFLINE = peers.run_offline  # the real one; every test's fixture replaces it

# The Mooncake trace parsed once for the module's tests (0.8 s a parse; its requests are frozen)
_TRACE = functools.cache(peers.load_trace)


@pytest.fixture(autouse=True)
def _no_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    def ran(*_: Any, **__: Any) -> None:
        raise AssertionError("a run started")

    for name in ("run_live", "run_offline", "ensure_peers"):
        monkeypatch.setattr(peers, name, ran)
    monkeypatch.setattr(peers, "stop_on_signals", lambda: None)  # keep pytest's handlers
    monkeypatch.setattr(peers, "load_trace", _TRACE)


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert peers.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bench/peers.py: "), err
    return err


@pytest.mark.parametrize(("argv", "says"), [
    (["--routers", "foo"], "--routers: router 'foo'"),
    (["--routers", ","], "--routers: expected at least one router"),
    (["--loads", "0"], "--loads: must be a finite number > 0"),
    (["--loads", "0.6,x"], "--loads: expected a number, got 'x'"),
    (["--duration", "0"], "--duration: must be a finite number > 0"),
    (["--capacity", "0"], "--capacity: must be a finite number > 0"),
    (["--capacity", "nan"], "--capacity: must be >= 0"),
    (["--timeout", "-1"], "--timeout: must be >= 0"),
    (["--repeats", "-1"], "--repeats: must be >= 0"),
    (["--offset", "1e9", "--sim-seeds", "1"], "no requests in trace time 1e+09-1e+09 s"),
    (["--bound", "lots"], "--bound: expected exact, none or a number of tokens"),
    (["--trace", "nope"], "--trace: unknown trace source 'nope'"),
    (["--trace", "chat:seed=x"], "--trace: bad value for seed: 'x'"),
    (["--warmup", "-1"], "--warmup: must be >= 0"),
    (["--preconnect-ratio", "5"],
     "--preconnect-ratio: fleet.upstream.preconnect_ratio: must be <= 3, got 5.0"),
    (["--offset", "10", "--warmup", "20"], "--warmup 20 reaches before the trace's start"),
])
def test_a_bad_argument_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str],
                                               argv: list[str], says: str) -> None:
    # Each was a traceback (ValueError, ZeroDivisionError), exit 1.
    assert says in _refused(capsys, argv)


def test_missing_render_file_is_one_line(capsys: pytest.CaptureFixture[str],
                                         tmp_path: Path) -> None:
    err = _refused(capsys, ["--render", str(tmp_path / "none.json")])
    assert f"cannot read a saved run from {tmp_path / 'none.json'}" in err


def test_out_in_a_missing_folder_is_refused_before_the_offline_runs(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # It was a FileNotFoundError once the offline simulations (here: a failure) had run.
    out = tmp_path / "missing" / "x.json"
    err = _refused(capsys, [*SLICE, "--sim-seeds", "1", "--out", str(out)])
    assert f"cannot write {out}" in err


def _saved(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """A saved --out file of SLICE with one (made-up) gorgo run in it."""
    out = tmp_path / "run.json"
    assert peers.main([*SLICE, "--repeats", "0", "--out", str(out)]) == 0
    capsys.readouterr()
    data = json.loads(out.read_text())
    data["runs"].append(asdict(peers.Run(
        router="gorgo", load=0.6, seed=0, n=8, ok=8, ttft_p50_ms=1.0, ttft_p95_ms=4321.0,
        e2e_p95_ms=9876.0, cache_hit=3.0, regions={"us-east": 100.0}, wall_s=5.0)))
    out.write_text(json.dumps(data))
    return out


def test_resume_keeps_the_runs_of_the_same_slice(capsys: pytest.CaptureFixture[str],
                                                 tmp_path: Path) -> None:
    out = _saved(tmp_path, capsys)
    assert peers.main([*SLICE, "--repeats", "1", "--out", str(out), "--resume"]) == 0
    assert "- Envoy + gorgo, 0.6, 0: 4,321 / 9,876, 8/8" in capsys.readouterr().out


def test_another_trace_is_run_at_its_slices_own_capacity(capsys: pytest.CaptureFixture[str],
                                                         tmp_path: Path) -> None:
    # The slice's round-robin capacity, searched offline as the matrix searches a window's, is
    # the unit of --loads; the report names the trace, and --resume keeps to it.
    out = tmp_path / "chat.json"
    argv = ["--trace", "chat:seed=1", "--offset", "0", "--duration", "40", "--routers", "gorgo",
            "--loads", "0.6", "--sim-seeds", "0", "--repeats", "0", "--out", str(out)]
    assert peers.main(argv) == 0
    report = capsys.readouterr().out
    cfg = json.loads(out.read_text())["config"]
    assert cfg["trace"] == "chat:seed=1" and cfg["requests"] > 50
    spec = peers.parse_fleet(peers.PRESETS["paper"])
    capacity = peers.slice_capacity(spec, peers.select_window(
        peers.load_trace("chat:seed=1"), 0.0, 40.0), peers.tokenization(spec), lambda _: None)
    assert cfg["capacity"] == capacity != peers.PAPER_MOONCAKE_CAPACITY_RPS
    assert "Slice: `chat:seed=1` generator time 0-40 s" in report
    assert "(the slice's own round-robin capacity, searched offline)" in report
    assert peers.main([*argv[:-2], "--trace", "chat:seed=2", "--out", str(out),
                       "--resume"]) == 2
    searched, refused = capsys.readouterr().err.splitlines()
    assert searched.startswith("[peers] the slice's round-robin capacity: ")
    assert "was run with --trace chat:seed=1 (here chat:seed=2)" in refused


@pytest.mark.parametrize(("argv", "says"), [
    (["--offset", "300", "--duration", "20", "--capacity", "2"],
     "--offset 1200 (here 300), --duration 5 (here 20), --capacity 5.416 (here 2)"),
    (["--loads", "0.6,0.75"], "--loads 0.6 (here 0.6,0.75)"),
    (["--timeout", "60"], "--timeout 300 (here 60)"),
    (["--bound", "4096"], "--bound exact (here 4096)"),
    (["--warmup", "10"], "--warmup 0 (here 10)"),
    (["--preconnect-ratio", "3"], "--preconnect-ratio 2 (here 3)"),
])
def test_resume_refuses_a_run_of_other_arguments(capsys: pytest.CaptureFixture[str],
                                                 tmp_path: Path, argv: list[str],
                                                 says: str) -> None:
    # It rendered the saved 1200-1205 s, capacity 5.416 run's rows under the new slice's header.
    out = _saved(tmp_path, capsys)
    before = out.read_text()
    err = _refused(capsys, [*SLICE, *argv, "--out", str(out), "--resume"])
    assert f"--resume: {out} was run with {says};" in err
    assert out.read_text() == before


@pytest.mark.parametrize(("mode", "saved", "says"), [
    ("none", "none", "clients sending no `max_tokens` (the engines stop at the trace's output)"),
    ("4096", 4096, "clients sending `max_tokens` 4096 (the engines stop at the trace's output)"),
    ("exact", "exact", "clients sending each request's output as `max_tokens`"),
])
def test_the_clients_bound_is_recorded_and_reported(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, mode: str, saved: object,
        says: str) -> None:
    out = tmp_path / "run.json"
    assert peers.main([*SLICE, "--repeats", "0", "--bound", mode, "--out", str(out)]) == 0
    assert says in capsys.readouterr().out
    assert json.loads(out.read_text())["config"]["max_tokens"] == saved
    # a saved run from before the option read as exact
    data = json.loads(out.read_text())
    del data["config"]["max_tokens"]
    out.write_text(json.dumps(data))
    assert peers.main([*SLICE, "--repeats", "0", "--out", str(out), "--resume",
                       "--bound", "exact"]) == 0


def test_a_run_whose_answers_are_not_the_traces_lengths_fails() -> None:
    # a peer that dropped the stop point would have its engines generate the whole cap
    def rec(i: int, asked: int, got: int | None) -> RequestRecord:
        return RequestRecord(index=i, session=None, input_tokens=10, max_tokens=asked,
                             scheduled_s=0.0, completion_tokens=got)

    peers.check_lengths([rec(0, 40, 40), rec(1, 7, 7)], "some router")
    with pytest.raises(RuntimeError, match=r"1 of 2 answers were not the trace's length \(the "
                                           r"first: 4096 tokens for 40\): some router did not"):
        peers.check_lengths([rec(0, 40, 4096), rec(1, 7, 7)], "some router")
    # an answer without usage proves nothing: a router dropped it
    with pytest.raises(RuntimeError, match=r"1 of 2 answers .* None tokens for 7"):
        peers.check_lengths([rec(0, 40, 40), rec(1, 7, None)], "some router")


def _run(router: str, seed: int, ttft: float, e2e: float) -> dict[str, Any]:
    return asdict(peers.Run(router=router, load=0.6, seed=seed, n=8, ok=8, ttft_p50_ms=1.0,
                            ttft_p95_ms=ttft, e2e_p95_ms=e2e, cache_hit=3.0,
                            regions={"us-east": 100.0}, wall_s=5.0))


def test_across_pairs_each_run_with_the_peers_of_its_slice_and_seed(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    files = []
    for k, (offset, runs) in enumerate([
            (0.0, [_run("gorgo", 0, 800, 900), _run("sglang:cache_aware", 0, 1000, 1000),
                   _run("gorgo", 1, 600, 1100), _run("sglang:cache_aware", 1, 1000, 1000)]),
            (60.0, [_run("gorgo", 0, 450, 2000), _run("sglang:cache_aware", 0, 500, 2000),
                    _run("gorgo", 1, 9000, 9000)])]):  # seed 1: no peer run to pair with
        files.append(tmp_path / f"slice{k}.json")
        files[-1].write_text(json.dumps({"config": {"trace": "chat:seed=1", "offset_s": offset,
                                                    "trace_s": 60.0},
                                         "offline": {}, "runs": runs}))
    assert peers.main(["--across", *map(str, files)]) == 0
    out = capsys.readouterr().out
    assert "Over 2 slices (chat:seed=1 0-60 s; chat:seed=1 60-120 s)" in out
    # slice 0: TTFT (0.8 + 0.6) / 2 = 0.7, E2E (0.9 + 1.1) / 2 = 1.0; slice 1: 0.9 and 1.0
    assert "| 0.6 | Envoy + gorgo | 2 | 0.80 ± 1.27 | 1.00 ± 0.00 | 0.70 / 1.00; 0.90 / 1.00 |" \
        in out
    err = _refused(capsys, ["--across", str(files[0])])
    assert "--across: name two saved runs" in err
    err = _refused(capsys, ["--across", str(files[0]), str(files[0])])
    assert "slice (chat:seed=1 0-60 s) overlaps another file's" in err
    assert "--across prints its table" in _refused(
        capsys, ["--across", *map(str, files), "--write-docs"])
    # a slice where both routers' p95 was unbounded has no ratio: counted out, and said
    unbounded = json.loads(files[1].read_text())
    for r in unbounded["runs"][:2]:
        r["ttft_p95_ms"] = r["e2e_p95_ms"] = float("inf")
    files[1].write_text(json.dumps(unbounded))
    assert peers.main(["--across", *map(str, files)]) == 0
    assert "| 0.6 | Envoy + gorgo | 1 of 2 | 0.70 ± inf | 1.00 ± inf |" in capsys.readouterr().out
    capped = json.loads(files[1].read_text())
    capped["config"]["max_tokens"] = 4096
    files[1].write_text(json.dumps(capped))
    err = _refused(capsys, ["--across", *map(str, files)])
    assert "clients sent another max_tokens than the files before it" in err
    warmed = json.loads(files[0].read_text())
    warmed["config"]["warmup_s"] = 60.0
    files[1].write_text(json.dumps({**warmed, "config": {**warmed["config"], "offset_s": 60.0}}))
    err = _refused(capsys, ["--across", *map(str, files)])
    assert "was run with another --warmup or --preconnect-ratio than the files before it" in err
    # a file saved before the option ran on Envoy's default: not pooled with one at 2
    preconnected = json.loads(files[0].read_text())
    preconnected["config"]["preconnect_ratio"] = 2.0
    files[1].write_text(json.dumps({**preconnected,
                                    "config": {**preconnected["config"], "offset_s": 60.0}}))
    err = _refused(capsys, ["--across", *map(str, files)])
    assert "another --warmup or --preconnect-ratio" in err
    overlapping = json.loads(files[0].read_text())
    overlapping["config"]["offset_s"] = 30.0
    files[1].write_text(json.dumps(overlapping))
    err = _refused(capsys, ["--across", *map(str, files)])
    assert "slice (chat:seed=1 30-90 s) overlaps another file's" in err
    alone = json.loads(files[0].read_text())
    alone["runs"] = [r for r in alone["runs"] if r["router"] == "gorgo"]
    alone["config"]["offset_s"] = 200.0
    files[1].write_text(json.dumps(alone))
    files[0].write_text(json.dumps({**alone, "config": {**alone["config"], "offset_s": 300.0}}))
    err = _refused(capsys, ["--across", *map(str, files)])
    assert "no run of sglang:cache_aware to pair with" in err
    files[1].write_text(json.dumps({**alone, "config": {"trace": "chat"}}))  # no slice
    err = _refused(capsys, ["--across", *map(str, files)])
    assert "its config has no slice (offset_s, trace_s)" in err


def test_a_mooncake_spec_keeps_the_whole_traces_capacity(capsys: pytest.CaptureFixture[str],
                                                        tmp_path: Path) -> None:
    # Compared as text, "MOONCAKE" or "mooncake:limit=N" had the slice's capacity searched and
    # were reported as a generator.
    out = tmp_path / "m.json"
    assert peers.main([*SLICE, "--trace", "MOONCAKE", "--repeats", "0", "--out", str(out)]) == 0
    assert "Slice: Mooncake trace time 1200-1205 s" in capsys.readouterr().out
    cfg = json.loads(out.read_text())["config"]
    assert cfg["capacity"] == peers.PAPER_MOONCAKE_CAPACITY_RPS and not cfg["capacity_searched"]


def test_a_warmup_is_replayed_first_and_left_out_of_the_figures(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """--warmup sends the trace before the slice first, at the slice's time scale, to every
    router and to the offline twin; only the slice's requests are measured."""
    calls: list[tuple[list, set | None]] = []

    def offline(policy, fleet_doc, requests, scale, seed, tok, bound, measured):
        calls.append((list(requests), measured))
        return {"ttft_p95_ms": 1.0, "e2e_p95_ms": 2.0}

    monkeypatch.setattr(peers, "run_offline", offline)
    out = tmp_path / "w.json"
    argv = [*SLICE, "--sim-seeds", "1", "--repeats", "0", "--warmup", "10", "--out", str(out)]
    assert peers.main(argv) == 0
    trace = peers.load_trace("mooncake")
    sliced = peers.select_window(trace, 1200.0, 5.0)
    played, measured = calls[0]
    assert measured == {r.index for r in sliced}
    assert [r.index for r in played] == [r.index for r in peers.select_window(trace, 1190, 15)]
    assert [r.index for r in played[-len(sliced):]] == [r.index for r in sliced]
    assert min(r.arrival_s for r in played[-len(sliced):]) >= 10.0  # after the warm-up
    cfg = json.loads(out.read_text())["config"]
    assert cfg["requests"] == len(sliced) and cfg["warmup_requests"] == len(played) - len(sliced)
    report = capsys.readouterr().out
    assert (f"after a warm-up of the 10 s of trace before the slice ({len(played) - len(sliced)} "
            "requests, replayed at the same time scale and not measured)") in report
    assert "Envoy keeping 2 upstream connections per open stream" in report


def _record(index: int, replica: str | None, ttft: float, outcome: str = "ok") -> RequestRecord:
    return RequestRecord(index=index, session=None, input_tokens=100, max_tokens=10,
                         scheduled_s=0.0, outcome=outcome, ttft_ms=ttft, e2e_ms=ttft + 100.0,
                         replica=replica, prompt_tokens=100, cached_tokens=0)


def test_a_runs_figures_and_shares_are_of_the_measured_requests() -> None:
    region_of = {"a": "near", "b": "far"}
    records = [_record(0, "b", 5000.0), _record(1, "b", 5000.0),  # the warm-up
               _record(2, "a", 100.0), _record(3, "a", 200.0), _record(4, "b", 300.0)]
    finished = {"a": 2, "b": 3}  # the engines count the warm-up too
    whole = peers.summarize_run("gorgo", 0.6, 0, records, finished, region_of, 1.0)
    assert whole.n == 5 and whole.ttft_p95_ms == 5000.0
    assert whole.regions == {"near": 40.0, "far": 60.0}
    warm = peers.summarize_run("gorgo", 0.6, 0, records, finished, region_of, 1.0, {2, 3, 4})
    assert warm.n == warm.ok == 3 and warm.ttft_p95_ms < 300.0
    assert warm.regions == pytest.approx({"near": 200 / 3, "far": 100 / 3})
    # a router that did not pass the engine's replica header on: no share, rather than a guess
    records[4] = _record(4, None, 300.0)
    unknown = peers.summarize_run("gorgo", 0.6, 0, records, finished, region_of, 1.0, {2, 3, 4})
    assert all(math.isnan(v) for v in unknown.regions.values())


def test_the_offline_twin_measures_the_same_requests() -> None:
    spec = peers.parse_fleet(peers.PRESETS["paper"])
    tok = peers.tokenization(spec)
    played = peers.select_window(peers.load_trace("mooncake"), 1190.0, 15.0)
    measured = {r.index for r in played if r.arrival_s >= 10.0}
    assert 0 < len(measured) < len(played)
    doc = peers.PRESETS["paper"]
    every = _RUN_OFFLINE("gorgo", doc, played, 1.0, 0, tok)
    assert _RUN_OFFLINE("gorgo", doc, played, 1.0, 0, tok, measured={r.index for r in played}) \
        == every
    wl = peers.workload_from_requests("slice", played, tok)
    records = peers.Simulation(peers.parse_fleet(doc), "gorgo", seed=0).run(
        wl.arrivals.tolist(), wl.features, wl.output_tokens).records
    ttfts = [rec.ttft * 1000.0 for rec, req in zip(records, played, strict=True)
             if req.index in measured]
    got = _RUN_OFFLINE("gorgo", doc, played, 1.0, 0, tok, measured=measured)
    assert got["ttft_p95_ms"] == peers._p_all(ttfts, 95) != every["ttft_p95_ms"]


def test_the_preconnect_ratio_reaches_the_fleet_every_run_gets(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    docs: list[dict] = []

    def offline(policy, fleet_doc, *_: Any) -> dict[str, float]:
        docs.append(fleet_doc)
        return {"ttft_p95_ms": 1.0, "e2e_p95_ms": 2.0}

    monkeypatch.setattr(peers, "run_offline", offline)
    out = tmp_path / "r.json"
    assert peers.main([*SLICE, "--sim-seeds", "1", "--repeats", "0", "--preconnect-ratio", "1",
                       "--out", str(out)]) == 0
    assert docs and all(peers.parse_fleet(d).upstream.preconnect_ratio == 1.0 for d in docs)
    assert json.loads(out.read_text())["config"]["preconnect_ratio"] == 1.0
    assert "Envoy opening an upstream connection when a request needs one" in \
        capsys.readouterr().out


def test_a_fractional_warmup_replays_nothing_after_the_slice(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # Rebased to offset - warmup, the slice's end was recomputed in floating point: 15 requests
    # at exactly trace time 1710 were replayed (unmeasured) after this 1700-1710 s slice.
    calls: list[tuple[list, set]] = []
    monkeypatch.setattr(peers, "run_offline", lambda _p, _d, requests, *a: calls.append(
        (list(requests), a[-1])) or {"ttft_p95_ms": 1.0, "e2e_p95_ms": 2.0})
    assert peers.main(["--routers", "gorgo", "--offset", "1700", "--duration", "10",
                       "--warmup", "2.3", "--loads", "0.6", "--sim-seeds", "1",
                       "--repeats", "0"]) == 0
    played, measured = calls[0]
    trace = {r.index: r for r in peers.load_trace("mooncake")}
    assert measured == {r.index for r in peers.select_window(list(trace.values()), 1700, 10)}
    assert all(r.index in measured or 1697.7 <= trace[r.index].arrival_s < 1700 for r in played)
    assert measured <= {r.index for r in played}
    assert [r.arrival_s for r in played] == sorted(r.arrival_s for r in played)


def test_a_run_saved_before_the_ratio_was_recorded_says_so(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # Missing, it read as 1: commit 1a1aa94 ran at 2 without recording it.
    out = _saved(tmp_path, capsys)
    data = json.loads(out.read_text())
    del data["config"]["preconnect_ratio"]
    data["config"].update(finished_at="then", load_after=0.0, wall_s=1.0)
    out.write_text(json.dumps(data))
    assert peers.main(["--render", str(out)]) == 0
    assert "Envoy's upstream preconnect ratio not recorded" in capsys.readouterr().out
    err = _refused(capsys, [*SLICE, "--out", str(out), "--resume"])
    assert "--preconnect-ratio not recorded (here 2)" in err
