"""How often the tuner's acceptance test takes a candidate, by how much better it really is.

Synthetic windows (2 per arm, 40 requests each, the defaults), TTFTs either independent
(log-normal, sigma 0.5) or in bursts of 8 that share a queueing factor (log-normal sigma 0.3, times
an independent sigma 0.2), as Mooncake's simultaneous arrivals queue together. The candidate's
TTFTs are the incumbent's distribution scaled by the given factor; a factor of 1.00 measures the
false-positive rate. The "spread" rows add the noise between windows as the tuner does
(`spread_history`): learnt from the windows of the trials before, as the tuner learns it from its
own past evaluations. Printed as the Markdown table in docs/tuner.md, "Measured behaviour".

    .venv/bin/python bench/acceptance.py [--trials 300] [--null-trials 1000]
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np

from tuner.optimizer import (
    CANDIDATE,
    INCUMBENT,
    OptimizerConfig,
    Spread,
    Window,
    compare,
    evaluation_spread,
    score_values,
    window_noise,
)

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
    default = OptimizerConfig()
    for label, bursty in (("independent log-normal", False), ("bursts of 8", True)):
        for block, learn in ((1, False), (default.block, False), (default.block, True)):
            cfg = OptimizerConfig(block=block, model_step=False,
                                  spread_history=default.spread_history if learn else 0)
            cells = []
            for scale in SCALES:
                rng = np.random.default_rng(args.seed)
                n = args.null_trials if scale == 1.0 else args.trials
                spreads: list[tuple[Spread, ...]] = []
                hits = sum(trial(rng, cfg, scale, bursty, spreads) for _ in range(n))
                cells.append(f"{100.0 * hits / n:.1f} %")
            extra = ", spread" if learn else ""
            print(f"| {label}, block {block}{extra} | " + " | ".join(cells) + " |", flush=True)


def trial(rng: np.random.Generator, cfg: OptimizerConfig, scale: float, bursty: bool,
          spreads: list[tuple[Spread, ...]]) -> bool:
    """One comparison, with the window noise the trials before it taught (``spreads``, which it
    extends: every arm's windows, like the tuner's, whatever the verdict)."""
    inc = windows(rng, INCUMBENT, 1.0, bursty)
    cand = windows(rng, CANDIDATE, scale, bursty)
    accepted = compare(inc, cand, cfg, rng,
                       noise=window_noise(itertools.chain.from_iterable(spreads))).accepted
    if cfg.spread_history:
        # independent draws, in no order: each arm's windows at places 0, 1 (compare, given no
        # places, charges the noise pooled over lags)
        arms = [[(k, score_values(w, cfg, None)) for k, w in enumerate(arm)] for arm in (inc, cand)]
        spreads.append(evaluation_spread(arms, cfg, rng))
        del spreads[:-cfg.spread_history]
    return accepted


if __name__ == "__main__":
    main()
