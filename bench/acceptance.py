"""How often the tuner's acceptance test takes a candidate, by how much better it really is.

Synthetic windows (2 per arm, 40 requests each, the defaults), TTFTs either independent
(log-normal, sigma 0.5) or in bursts of 8 that share a queueing factor (log-normal sigma 0.3, times
an independent sigma 0.2), as Mooncake's simultaneous arrivals queue together. The candidate's
TTFTs are the incumbent's distribution scaled by the given factor; a factor of 1.00 measures the
false-positive rate. Printed as the Markdown table in docs/tuner.md, "Measured behaviour".

    .venv/bin/python bench/acceptance.py [--trials 300] [--null-trials 1000]
"""

from __future__ import annotations

import argparse

import numpy as np

from tuner.optimizer import CANDIDATE, INCUMBENT, OptimizerConfig, Window, compare

SCALES = (1.0, 1.05, 0.95, 0.9, 0.8, 0.7)
BASE_MS = 300.0


def windows(rng: np.random.Generator, arm: str, scale: float, bursty: bool) -> list[Window]:
    out = []
    for k in range(2):
        w = Window(arm, k, 0.0)
        if bursty:
            ttft = np.repeat(rng.lognormal(0.0, 0.3, 5), 8) * rng.lognormal(0.0, 0.2, 40)
        else:
            ttft = rng.lognormal(0.0, 0.5, 40)
        w.ttft = list(BASE_MS * scale * ttft)
        w.e2e = [x + 500.0 for x in w.ttft]
        out.append(w)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=300)
    ap.add_argument("--null-trials", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    head = " | ".join(f"{s:.2f}" for s in SCALES)
    print(f"| TTFTs, bootstrap | candidate p95 / incumbent {head} |")
    print("|---|" + "---|" * len(SCALES))
    for label, bursty in (("independent log-normal", False), ("bursts of 8", True)):
        for block in (1, OptimizerConfig().block):
            cfg = OptimizerConfig(block=block, model_step=False)
            cells = []
            for scale in SCALES:
                rng = np.random.default_rng(args.seed)
                n = args.null_trials if scale == 1.0 else args.trials
                hits = sum(compare(windows(rng, INCUMBENT, 1.0, bursty),
                                   windows(rng, CANDIDATE, scale, bursty), cfg, rng).accepted
                           for _ in range(n))
                cells.append(f"{100.0 * hits / n:.1f} %")
            print(f"| {label}, block {block} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
