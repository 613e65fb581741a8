"""What a replayed client tells the router of its output (`--trace SPEC,max_tokens=`), and that
the router learns the typical output from the engines' counters offline as it does live."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from gorgo.cli import main as cli_main
from gorgo.core.fleet import Shedding, parse_fleet
from gorgo.sim.bench import load_windows
from gorgo.sim.offline import Simulation
from gorgo.sim.presets import fleet_document
from gorgo.sim.traces import TraceError, chat_trace, load_trace
from gorgo.sim.workload import EXACT, simulate, split_client, tokenization, workload_from_requests


@pytest.mark.parametrize("spec, base, bound, closed", [
    ("mooncake", "mooncake", EXACT, False),
    ("azure:limit=50", "azure:limit=50", EXACT, False),
    ("azure:max_tokens=none", "azure", None, False),
    ("chat:seed=3,max_tokens=4096,users=9", "chat:seed=3,users=9", 4096, False),
    ("chat:max_tokens=EXACT", "chat", EXACT, False),
    ("chat:seed=1,turns=closed", "chat:seed=1", EXACT, True),
    ("chat:turns=Open,max_tokens=none", "chat", None, False),
])
def test_the_clients_options_are_split_off_the_trace_spec(spec: str, base: str, bound,
                                                           closed: bool) -> None:
    assert split_client(spec) == (base, bound, closed)


@pytest.mark.parametrize("spec", ["chat:max_tokens=0", "chat:max_tokens=-3", "chat:max_tokens=",
                                  "chat:max_tokens=2000000", "chat:max_tokens=" + "9" * 30,
                                  "chat:max_tokens=lots", "chat:max_tokens=1,max_tokens=2"])
def test_a_bad_bound_is_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        split_client(spec)


@pytest.mark.parametrize("spec", ["chat:turns=shut", "chat:turns=", "chat:turns=open,turns=closed"])
def test_a_bad_turns_option_is_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="turns"):
        split_client(spec)


def test_chat_marks_each_continuation_with_the_turn_it_continues() -> None:
    reqs = chat_trace(seed=2, users=20, rate=4.0, limit=300)
    by_index = {r.index: r for r in reqs}
    continued = [r for r in reqs if r.follows is not None]
    assert len(continued) > 100
    for r in continued:
        before = by_index[r.follows]
        assert before.session == r.session and before.index < r.index
        # this prompt is that prompt, its answer, and a new message
        assert r.parts[:len(before.parts)] == before.parts
        assert r.parts[len(before.parts)][1] == before.output_tokens


def test_closed_turns_wait_for_the_answer_they_continue() -> None:
    # Open loop, a follow-up left before the answer it continues had ended (most of them at this
    # load) and found its prompt uncached; closed, none leaves before that answer.
    spec = parse_fleet(fleet_document({"us-east": 1}))
    reqs = chat_trace(seed=4, users=8, rate=40.0, limit=120)
    tok = tokenization(spec)
    open_ = workload_from_requests("x", reqs, tok)
    closed = workload_from_requests("x", reqs, tok, closed=True)
    assert open_.follows is None and closed.follows is not None
    runs = {}
    for name, wl in (("open", open_), ("closed", closed)):
        res = simulate(spec, "round-robin", wl, 1.0, seed=1)
        assert all(r.status == 200 for r in res.records)
        runs[name] = res.records
    early = sum(runs["open"][k].arrival < runs["open"][p].arrival + runs["open"][p].e2e
                for k, p in enumerate(closed.follows) if p is not None)
    assert early > 10
    for k, p in enumerate(closed.follows):
        rec = runs["closed"][k]
        assert rec.arrival >= closed.arrivals[k]
        if p is not None:
            before = runs["closed"][p]
            assert rec.arrival >= before.arrival + before.e2e - 1e-9
    # a turn waited for its answer finds its prompt cached more often
    hit = {name: sum(r.cached_tokens for r in recs) for name, recs in runs.items()}
    assert hit["closed"] > hit["open"]


def test_a_refused_turn_releases_the_turn_that_waits_for_it() -> None:
    # Shedding at twice the fleet's capacity refuses turns (429, no answer): the turns after them
    # must still be sent, at their time, or the run never ends.
    spec = replace(parse_fleet(fleet_document({"us-east": 1})), shedding=Shedding(slo_ms=300.0))
    reqs = chat_trace(seed=4, users=8, rate=40.0, limit=150)
    wl = workload_from_requests("x", reqs, tokenization(spec), closed=True)
    assert wl.follows is not None
    recs = simulate(spec, "gorgo", wl, 1.0, seed=1).records
    refused = [k for k, r in enumerate(recs) if r.status == 429]
    waited = [k for k, p in enumerate(wl.follows) if p in refused]
    assert refused and waited
    assert all(recs[k].status in (200, 429) for k in range(len(recs)))
    for k in waited:
        before = recs[wl.follows[k]]
        assert recs[k].arrival >= wl.arrivals[k]
        assert recs[k].arrival <= max(wl.arrivals[k], before.arrival + 1.0)  # decided at once


def test_the_lookahead_bound_is_refused_with_closed_turns(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # It rolls the trace's arrivals forward at their times: a held turn ran its index past the
    # end (IndexError in the bench's pool).
    argv = ["bench", "sim", "--trace", "chat:seed=1,turns=closed", "--requests", "50",
            "--policies", "gorgo,oracle-lookahead", "--out", str(tmp_path), "--jobs", "1"]
    assert cli_main(argv) == 2
    assert "oracle-lookahead rolls the trace's arrivals forward" in capsys.readouterr().err
    spec = parse_fleet(fleet_document({"us-east": 1}))
    wl = workload_from_requests("x", chat_trace(seed=1, users=3, limit=30),
                                tokenization(spec), closed=True)
    with pytest.raises(ValueError, match="turns=closed"):
        simulate(spec, "oracle-lookahead@e2e", wl, 1.0, seed=1)


def test_closed_turns_need_a_trace_that_marks_them() -> None:
    spec = parse_fleet(fleet_document({"us-east": 1}))
    reqs = [replace(r, follows=None) for r in chat_trace(seed=1, users=3, limit=10)]
    with pytest.raises(ValueError, match="turns=closed needs a trace that marks its turns"):
        workload_from_requests("x", reqs, tokenization(spec), closed=True)


def test_only_the_offline_bench_knows_the_option() -> None:
    # a live replay cannot cut what its engines generate: the loaders refuse the option
    with pytest.raises(TraceError, match="max_tokens"):
        load_trace("chat:max_tokens=none")


def test_the_client_sends_the_bound_and_the_engine_generates_the_output() -> None:
    spec = parse_fleet(fleet_document({"us-east": 2}))
    reqs = chat_trace(seed=5, users=6, rate=4.0, limit=60)
    outputs = [r.output_tokens for r in reqs]
    exact = workload_from_requests("x", reqs, tokenization(spec))
    assert [f.max_tokens for f in exact.features] == outputs
    none = workload_from_requests("x", reqs, tokenization(spec), None)
    assert all(f.max_tokens is None for f in none.features)
    assert none.output_tokens == exact.output_tokens
    cap = min(outputs) + (max(outputs) - min(outputs)) // 2
    capped = workload_from_requests("x", reqs, tokenization(spec), cap)
    assert all(f.max_tokens == cap for f in capped.features)
    assert list(capped.output_tokens) == [min(o, cap) for o in outputs]
    # the same prompts: only what the router is told changes
    assert [f.block_hashes.tolist() for f in capped.features] == [
        f.block_hashes.tolist() for f in exact.features]


def test_bench_windows_carry_the_bound_in_their_label() -> None:
    spec = parse_fleet(fleet_document({"us-east": 2}))
    wl = load_windows("t", "chat:users=6,limit=40,max_tokens=none", spec, 30, 2, lambda m: None)
    assert [w.trace for w in wl] == ["chat:users=6,limit=40,seed=0[0:30] max_tokens=none",
                                     "chat:users=6,limit=40,seed=1[0:30] max_tokens=none"]
    assert all(f.max_tokens is None for w in wl for f in w.features)


def test_offline_the_router_learns_the_typical_output_from_the_engines() -> None:
    spec = parse_fleet(fleet_document({"us-east": 2, "ap-seoul": 1}))
    reqs = chat_trace(seed=2, users=20, rate=6.0, limit=300)
    wl = workload_from_requests("chat", reqs, tokenization(spec), 4096)
    sim = Simulation(spec, "gorgo", seed=1)
    sim.run(wl.arrivals.tolist(), wl.features, wl.output_tokens)
    outputs = sim.router.state.outputs
    assert outputs.typical() == pytest.approx(np.mean(wl.output_tokens), rel=0.25)
    assert outputs.typical_bound() == pytest.approx(4096)
    # so a 4,096 bound is priced near the typical output, not at 4,096
    assert outputs.expected(4096) < 2 * np.mean(wl.output_tokens)
