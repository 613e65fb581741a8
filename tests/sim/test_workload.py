"""What a replayed client tells the router of its output (`--trace SPEC,max_tokens=`), and that
the router learns the typical output from the engines' counters offline as it does live."""

from __future__ import annotations

import numpy as np
import pytest

from gorgo.core.fleet import parse_fleet
from gorgo.sim.bench import load_windows
from gorgo.sim.offline import Simulation
from gorgo.sim.presets import fleet_document
from gorgo.sim.traces import TraceError, chat_trace, load_trace
from gorgo.sim.workload import EXACT, split_client_bound, tokenization, workload_from_requests


@pytest.mark.parametrize("spec, base, bound", [
    ("mooncake", "mooncake", EXACT),
    ("azure:limit=50", "azure:limit=50", EXACT),
    ("azure:max_tokens=none", "azure", None),
    ("chat:seed=3,max_tokens=4096,users=9", "chat:seed=3,users=9", 4096),
    ("chat:max_tokens=EXACT", "chat", EXACT),
])
def test_the_bound_option_is_split_off_the_trace_spec(spec: str, base: str, bound) -> None:
    assert split_client_bound(spec) == (base, bound)


@pytest.mark.parametrize("spec", ["chat:max_tokens=0", "chat:max_tokens=-3", "chat:max_tokens=",
                                  "chat:max_tokens=2000000", "chat:max_tokens=" + "9" * 30,
                                  "chat:max_tokens=lots", "chat:max_tokens=1,max_tokens=2"])
def test_a_bad_bound_is_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        split_client_bound(spec)


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
