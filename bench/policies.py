"""Decision time of every registered policy: ``Router.route`` at 6 and 1,000 replicas.

Each request is a realistic 32 KB prompt (8,192 tokens, 128 blocks at the default 64 tokens per
block): an 8 KB system prompt shared by everyone, 16 KB of per-session context and an 8 KB tail of
its own. The prefix index is warmed with a few thousand such requests first, about 64 stay in
flight, requests arrive at half the fleet's prefill capacity, every replica has an RTT and half
have a fresh engine scrape, so each policy runs its full path. Timed: ``Router.route`` alone
(feature extraction is the caller's and is done up front). irb's weight solve runs off the
request path, so it is timed separately.

    .venv/bin/python bench/policies.py [--replicas 6 1000] [--decisions 1000]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import string
import time

import numpy as np

from gorgo.core.contract import SESSION_HEADER
from gorgo.core.features import RequestFeatures, extract_features
from gorgo.core.fleet import FleetSpec, parse_fleet
from gorgo.core.policies import REGISTRY
from gorgo.core.router import Router
from gorgo.core.tokens import Tokenization

REGIONS = ("us-east", "eu-frankfurt", "ap-seoul")
RTT_MS = {"us-east": 37.0, "eu-frankfurt": 279.0, "ap-seoul": 456.0}
IN_FLIGHT = 64
SESSIONS = 48


def fleet(n: int) -> dict:
    return {
        "regions": {r: {} for r in REGIONS},
        "replicas": [
            {"name": f"r{i}", "engine": "sim", "region": REGIONS[i % 3],
             "address": f"10.0.{i // 250}.{i % 250}:80",
             "prefill_rate": 8000 + 1000 * (i % 5)}
            for i in range(n)
        ],
    }


def prompts(count: int, tok: Tokenization, seed: int = 0) -> list[RequestFeatures]:
    rng = np.random.default_rng(seed)
    letters = np.array(list(string.ascii_letters + "     "))

    def chunk(n: int) -> str:
        return "".join(rng.choice(letters, n))

    system = chunk(8 * 1024)
    contexts = [chunk(16 * 1024) for _ in range(SESSIONS)]
    out = []
    for _ in range(count):
        sid = int(rng.integers(SESSIONS))
        body = json.dumps({"prompt": system + contexts[sid] + chunk(8 * 1024)}).encode()
        headers = {SESSION_HEADER: f"s{sid}"}
        out.append(extract_features("/v1/completions", headers, body, tok))
    return out


def measure(spec: FleetSpec, name: str, warm: list[RequestFeatures],
            timed: list[RequestFeatures]) -> tuple[np.ndarray, float]:
    """Decision times in µs, and the policy's refresh time in ms (NaN if it has none)."""
    r = Router(dataclasses.replace(spec, policy=name))
    s = r.state
    for i, region_idx in enumerate(s.region_idx):
        s.observe_rtt(i, RTT_MS[REGIONS[region_idx]] * (1.0 + 0.01 * (i % 7)))
    policy = r.policies[name]
    # Arrivals at half the fleet's prefill capacity, so irb solves a feasible plan.
    step = warm[0].prompt_tokens / (0.5 * float(s.prefill_rate.sum()))
    now = 0.0
    open_ids: list[str] = []
    for f in warm:
        now += step
        open_ids.append(r.route(f, now).id)
        if len(open_ids) > IN_FLIGHT:
            r.complete(open_ids.pop(0))
    for i in range(0, s.n, 2):
        s.observe_engine(i, now, queue_reqs=2.0, running_reqs=8.0, kv_usage=0.4)
    refresh_ms = float("nan")
    if policy.refresh_interval_s > 0:
        t0 = time.perf_counter()
        policy.refresh(s)
        refresh_ms = (time.perf_counter() - t0) * 1e3
    out = np.empty(len(timed))
    for k, f in enumerate(timed):
        now += step
        t0 = time.perf_counter_ns()
        d = r.route(f, now)
        out[k] = (time.perf_counter_ns() - t0) / 1e3
        open_ids.append(d.id)
        if len(open_ids) > IN_FLIGHT:
            r.complete(open_ids.pop(0))
    return out, refresh_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, nargs="+", default=[6, 1000])
    ap.add_argument("--decisions", type=int, default=1000)
    args = ap.parse_args()
    rows: dict[str, list[str]] = {name: [] for name in REGISTRY}
    notes = []
    for n in args.replicas:
        spec = parse_fleet(fleet(n))
        tok = Tokenization(spec.chars_per_token, spec.block_tokens)
        warm = prompts(max(1000, 2 * n), tok, seed=1)
        timed = prompts(args.decisions, tok, seed=2)
        for name in REGISTRY:
            times, refresh_ms = measure(spec, name, warm, timed)
            p50, p99 = np.percentile(times, [50, 99])
            rows[name] += [f"{p50:.0f}", f"{p99:.0f}"]
            if not np.isnan(refresh_ms):
                notes.append(f"{name} refresh (LP solve) at {n} replicas: {refresh_ms:.1f} ms")
    head = " | ".join(f"p50 {n} | p99 {n}" for n in args.replicas)
    print(f"| policy (µs) | {head} |")
    print("|---" * (1 + 2 * len(args.replicas)) + "|")
    for name, cells in rows.items():
        print(f"| {name} | {' | '.join(cells)} |")
    for line in notes:
        print(line)


if __name__ == "__main__":
    main()
