"""How often the tuner accepts a candidate under load that moves by itself, end to end.

The real `Tuner` (default optimiser, no weight fit, no calibration) is fed synthetic requests
whose TTFT does not depend on the weights: 300 ms x lognormal(0, 0.5) x the load of the moment.
Every acceptance is then a false one (the A/A rate); with ``--better F`` the candidate's windows
are F times as fast, and the acceptance rate is the test's power (F near 1: a new incumbent
is re-measured at full speed, and past `rollback` that is undone). The load either swings,
``exp(A sin(2 pi i / P + phase))`` for request i, a period P in requests (``--periods``; 0: no
swing) and a phase drawn per run, or walks (``--walk``: its log a random walk of sd A per
40-request window, slowly pulled back to 0). Prints one markdown row per load with the Wilson
95 % interval of the rate over every run's evaluations (docs/tuner.md, "A plan drawn at random").

    .venv/bin/python bench/tuner_load.py --periods 0,80,120,160,240,400 --runs 24
    .venv/bin/python bench/tuner_load.py --walk --amplitude 0.15 --runs 12 --better 0.9
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import numpy as np

from gorgo.sim.tunebench.stats import wilson
from tuner.optimizer import CANDIDATE, OptimizerConfig, Tuner
from tuner.samples import Sample

BASE_MS = 300.0
TERMS = {"rtt": 1.0, "queue": 0.0, "admission": 0.0, "prefill": 0.0, "penalty": 0.0}


def swing(amplitude: float, period: int, phase: float) -> Callable[[int], float]:
    if not period:
        return lambda i: 1.0
    return lambda i: math.exp(amplitude * math.sin(2 * math.pi * i / period + phase))


def walk(amplitude: float, rng: np.random.Generator, window: int) -> Callable[[int], float]:
    level = [0.0]

    def load(i: int) -> float:
        level[0] = 0.999 * (level[0] + amplitude / math.sqrt(window) * rng.standard_normal())
        return math.exp(level[0])

    return load


def run(load: Callable[[int], float], seed: int, requests: int, better: float,
        rng: np.random.Generator) -> tuple[int, int]:
    """(accepted, evaluations) of one tuner fed ``requests`` requests."""
    cfg = OptimizerConfig(model_step=False, calibrate=False, max_failures=10**6, min_sigma=1e-9)
    t = Tuner(cfg, {"rtt": 1.0, "queue": 1.0}, seed=seed)
    p = t.next_weights(0.0)
    now = 0.0
    for i in range(requests):
        now += 0.01
        factor = better if p.arm == CANDIDATE else 1.0
        ttft = BASE_MS * rng.lognormal(0.0, 0.5) * load(i) * factor
        t.observe(Sample(ttft, ttft + 400.0, 200, "r0", "near", "gorgo", p.weights.version, ttft,
                         dict(TERMS), 0, 100, start_unix_s=now))
        p = t.next_weights(now) or p
    return t.accepted, t.evaluations


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--periods", default="0,80,120,160,240,400", help="swing periods, requests")
    ap.add_argument("--walk", action="store_true", help="a random walk instead of swings")
    ap.add_argument("--amplitude", type=float, default=0.3)
    ap.add_argument("--runs", type=int, default=24, help="tuners per load, seeds 1000...")
    ap.add_argument("--requests", type=int, default=8000, help="requests per run")
    ap.add_argument("--better", type=float, default=1.0, help="candidate's TTFT factor")
    args = ap.parse_args()
    loads = ["walk"] if args.walk else [int(x) for x in args.periods.split(",")]
    print(f"candidate x{args.better:g}, amplitude {args.amplitude:g}, {args.runs} runs of "
          f"{args.requests} requests\n")
    print("| load | accepted / evaluations | rate | Wilson 95 % |")
    print("|---|---:|---:|---|")
    for what in loads:
        k = n = 0
        for r in range(args.runs):
            rng = np.random.default_rng(1000 + r)
            if what == "walk":
                load = walk(args.amplitude, rng, OptimizerConfig().window_samples)
                label = f"random walk, sd {args.amplitude:g} a window"
            else:
                load = swing(args.amplitude, int(what), float(rng.uniform(0, 2 * math.pi)))
                label = f"swing, period {what} requests" if what else "steady"
            a, e = run(load, 1000 + r, args.requests, args.better, rng)
            k, n = k + a, n + e
        lo, hi = wilson(k, n)
        print(f"| {label} | {k} / {n} | {100 * k / max(n, 1):.1f} % | "
              f"{100 * lo:.1f}-{100 * hi:.1f} % |", flush=True)


if __name__ == "__main__":
    main()
