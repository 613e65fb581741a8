"""How much the open-loop replay of `chat` changes what a follow-up turn finds cached.

Every trace is replayed at its own timestamps, so a follow-up turn can leave before the answer it
continues has ended (docs/simulator.md). For each load and policy this replays the same `chat`
windows open and closed (`turns=closed`: a turn leaves no earlier than that answer's end) with
seed 1 and prints, averaged over the windows: the share of requests that are follow-ups; open,
the share of them sent before the answer they continue ended and before its first token;
closed, the share held back and the mean hold; and the share of the follow-ups' prompt tokens
found cached in each replay. `gorgo bench sim --trace chat:turns=closed` gives the policies'
p95s; docs/results.md ("Turns that wait for their answers") has both.

    .venv/bin/python -m bench.turns [--loads 0.5,0.8,0.95] [--windows 3] [--requests 1500]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import numpy as np

from gorgo.core.policies import REGISTRY
from gorgo.errors import OneLineParser, UserError, at_least, positive_number
from gorgo.sim.bench import GORGO, VARIANT, trace_windows
from gorgo.sim.offline import RequestRecord
from gorgo.sim.presets import resolve_fleet
from gorgo.sim.workload import Workload, simulate, tokenization, workload_from_requests


def _run(spec, policy: str, wl: Workload, scale: float) -> list[RequestRecord]:
    name, _, objective = policy.partition(VARIANT)
    if objective:
        spec = replace(spec, objective=objective)
    return simulate(spec, name, wl, scale, seed=1).records


def measure(policy: str, load: float, windows: int, requests: int, capacity: float,
            fleet: str) -> np.ndarray:
    """The row's figures, averaged over the windows (see the module docstring)."""
    spec = resolve_fleet(fleet)
    tok = tokenization(spec)
    rows = []
    for label, reqs in trace_windows("chat", requests, windows):
        wl_open = workload_from_requests(label, reqs, tok)
        wl_closed = workload_from_requests(label, reqs, tok, closed=True)
        scale = wl_open.scale_for_rate(capacity * load)
        ro = _run(spec, policy, wl_open, scale)
        rc = _run(spec, policy, wl_closed, scale)
        assert wl_closed.follows is not None
        pairs = [(k, b) for k, b in enumerate(wl_closed.follows) if b is not None]
        held = np.array([rc[k].arrival - wl_closed.arrivals[k] * scale for k, _ in pairs])
        rows.append((
            len(pairs) / len(reqs),
            np.mean([ro[k].arrival < ro[b].arrival + ro[b].e2e for k, b in pairs]),
            np.mean([ro[k].arrival < ro[b].arrival + ro[b].ttft for k, b in pairs]),
            np.mean(held > 1e-9),
            float(held.mean()),
            np.mean([ro[k].cached_tokens / ro[k].prompt_tokens for k, _ in pairs]),
            np.mean([rc[k].cached_tokens / rc[k].prompt_tokens for k, _ in pairs]),
        ))
    return np.mean(rows, axis=0)


def _loads(text: str) -> list[float]:
    try:
        loads = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}") from None
    if not all(0.0 < x < float("inf") for x in loads):
        raise argparse.ArgumentTypeError(f"loads must be finite and > 0, got {text!r}")
    return loads


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="bench.turns", description=__doc__.split("\n\n")[0])
    p.add_argument("--loads", type=_loads, default=[0.5, 0.8, 0.95],
                   help="comma-separated multiples of --capacity (default: 0.5,0.8,0.95)")
    p.add_argument("--policies", default=f"{GORGO}{VARIANT}e2e,cache-aware,round-robin")
    p.add_argument("--windows", type=at_least(1), default=3,
                   help="chat generator seeds 0..K-1 (default: 3)")
    p.add_argument("--requests", type=at_least(2), default=1500)
    p.add_argument("--capacity", type=positive_number, default=22.0,
                   help="req/s (default: 22, the tune bench's)")
    p.add_argument("--fleet", default="paper")
    try:
        args = p.parse_args(argv)
        policies = args.policies.split(",")
        unknown = [x for x in policies if x.partition(VARIANT)[0] not in REGISTRY]
        if unknown:
            raise UserError(f"--policies: unknown {', '.join(unknown)} (known: "
                            f"{', '.join(REGISTRY)}, and gorgo@OBJECTIVE)")
        print("| load | policy | follow-ups | open: sent before the answer ended | before its "
              "first token | closed: held back | mean hold (s) | follow-ups' prompt cached, "
              "open | closed |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for load in args.loads:
            for policy in policies:
                m = measure(policy, load, args.windows, args.requests, args.capacity,
                            args.fleet)
                print(f"| {load:g} | {policy} | {m[0]:.1%} | {m[1]:.1%} | {m[2]:.1%} | "
                      f"{m[3]:.1%} | {m[4]:.2f} | {m[5]:.1%} | {m[6]:.1%} |", flush=True)
    except (UserError, ValueError) as exc:
        print(f"{p.prog}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
