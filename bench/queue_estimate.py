"""How far the router's queue estimate is from the engines' truth, decision by decision (offline).

At every decision of a policy, the router's `FleetState.waiting_tokens` (what the `queue` term
and `kv-cost` read) is set beside the prefill tokens each simulated engine really has pending,
and the chosen replica's in-flight count beside the others'. This is how issue 13's burst finding
was made (docs/results.md, "Bursts and the engine view of the queue"): an estimate thousands of
tokens above engines that had almost nothing pending, and uneven batches from chasing it.

    .venv/bin/python bench/queue_estimate.py [--trace azure] [--fleet one-region] [--load 0.8]
        [--requests 1500] [--window 0/3] [--seed 1] [--capacity RPS]
        [--policies gorgo@ttft,least-load,cache-aware-tree]

``--capacity`` is the window's capacity in req/s (the load unit); without it the capacity is
searched as `gorgo bench sim` does (slower). Prints one row per policy.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

import numpy as np

from gorgo.core.decision import Decision
from gorgo.core.features import RequestFeatures
from gorgo.core.policies import make_policy
from gorgo.core.policies.base import Policy
from gorgo.core.state import FleetState
from gorgo.sim.bench import policy_setup, trace_windows
from gorgo.sim.capacity import find_capacity
from gorgo.sim.offline import Simulation
from gorgo.sim.presets import resolve_fleet
from gorgo.sim.workload import tokenization, workload_from_requests


@dataclass
class Probe:
    """Wraps the policy a run routes by and records the state at each of its decisions."""

    sim: Simulation
    inner: Policy
    estimate: list[np.ndarray] = field(default_factory=list)
    truth: list[np.ndarray] = field(default_factory=list)
    inflight: list[np.ndarray] = field(default_factory=list)
    chosen: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.inner.name

    def __getattr__(self, attr: str):  # the router reads other policy attributes
        return getattr(self.inner, attr)

    def choose(self, f: RequestFeatures, s: FleetState) -> Decision:
        d = self.inner.choose(f, s)
        self.estimate.append(s.waiting_tokens().copy())
        self.truth.append(np.array([e.metrics().pending_prefill_tokens
                                    for e in self.sim.engines], dtype=float))
        self.inflight.append(s.inflight_reqs.copy())
        self.chosen.append(d.replica)
        return d


def run(spec_name: str, trace: str, policy: str, load: float, requests: int, window: int,
        windows: int, seed: int, capacity: float | None) -> dict[str, float]:
    spec0 = resolve_fleet(spec_name)
    label, reqs = trace_windows(trace, requests, windows)[window]
    workload = workload_from_requests(label, reqs, tokenization(spec0))
    if capacity is None:
        capacity = find_capacity(spec0, workload).rate_rps
    name, spec = policy_setup(policy, spec0)
    probes: list[Probe] = []

    def factory(sim: Simulation) -> Policy:
        probes.append(Probe(sim, make_policy(name, spec)))
        return probes[-1]  # type: ignore[return-value]

    sim = Simulation(spec, name, seed=seed, policy_factory=factory)
    res = sim.run((workload.arrivals * workload.scale_for_rate(load * capacity)).tolist(),
                  workload.features, workload.output_tokens)
    p = probes[0]
    est, truth, inflight = np.array(p.estimate), np.array(p.truth), np.array(p.inflight)
    rows = np.arange(len(p.chosen))
    ttft = np.array([r.ttft for r in res.records]) * 1000.0
    return {
        "estimate_minus_truth": float((est - truth).mean()),
        "truth_at_chosen": float(truth[rows, p.chosen].mean()),
        "chosen_least_pending": float((truth[rows, p.chosen] <= truth.min(axis=1) + 1).mean()),
        "inflight_spread": float((inflight.max(axis=1) - inflight.min(axis=1)).mean()),
        "ttft_p50_ms": float(np.percentile(ttft, 50)),
        "ttft_p95_ms": float(np.percentile(ttft, 95)),
        "capacity_rps": capacity,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="azure")
    ap.add_argument("--fleet", default="one-region")
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--window", default="0/3", help="W/K: window W of K, as gorgo bench sim cuts")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--capacity", type=float, default=None, help="req/s (default: searched)")
    ap.add_argument("--policies", default="gorgo@ttft,least-load,cache-aware-tree")
    a = ap.parse_args(argv)
    w, _, k = a.window.partition("/")
    print(f"{a.trace} x {a.fleet}, load {a.load}, window {a.window}, seed {a.seed}; tokens and "
          "requests are means over decisions")
    print("| policy | estimate - truth (tokens) | truth at chosen | chosen = least pending | "
          "in-flight spread | TTFT p50 / p95 (ms) |")
    print("|---|---:|---:|---:|---:|---|")
    for policy in a.policies.split(","):
        m = run(a.fleet, a.trace, policy, a.load, a.requests, int(w), int(k or 1), a.seed,
                a.capacity)
        print(f"| {policy} | {m['estimate_minus_truth']:,.0f} | {m['truth_at_chosen']:,.0f} | "
              f"{100 * m['chosen_least_pending']:.0f} % | {m['inflight_spread']:.1f} | "
              f"{m['ttft_p50_ms']:,.0f} / {m['ttft_p95_ms']:,.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
