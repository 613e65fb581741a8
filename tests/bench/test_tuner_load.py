from __future__ import annotations

import math

import numpy as np

from bench import tuner_load


def test_a_steady_a_a_run_counts_its_evaluations_and_a_far_better_candidate_wins() -> None:
    rng = np.random.default_rng(0)
    accepted, evaluations = tuner_load.run(tuner_load.swing(0.3, 0, 0.0), 1, 1600, 1.0, rng)
    assert evaluations == 10 and 0 <= accepted <= 2  # 1,600 requests: 10 evaluations of 160
    accepted, evaluations = tuner_load.run(tuner_load.swing(0.3, 160, 1.0), 1, 1600, 0.3, rng)
    assert evaluations >= 8 and accepted > evaluations / 2  # a 3x faster candidate wins


def test_the_loads() -> None:
    load = tuner_load.swing(0.3, 160, math.pi / 2)
    assert load(0) == math.exp(0.3) and abs(load(80) - math.exp(-0.3)) < 1e-12
    steps = tuner_load.walk(0.15, np.random.default_rng(0), 40)
    assert all(0.2 < steps(i) < 5.0 for i in range(4000))
