"""The queue weight under which the cost predicts the TTFT delivered."""

from __future__ import annotations

import numpy as np
import pytest

from tuner.samples import Sample
from tuner.weight_fit import QueueWeightFit


def sample(rng: np.random.Generator, b: float, *, q_max: float = 3000.0,
           status: int = 200) -> Sample:
    q = float(rng.uniform(0.0, q_max))
    ttft = 80.0 + 400.0 + 30.0 + b * q + float(rng.normal(0.0, 50.0))
    return Sample(ttft, ttft + 900.0, status, "r0", "near", "gorgo", 1, 0.0, 80.0, q, 400.0, 0,
                  100)


@pytest.mark.parametrize("b", [0.3, 1.0, 4.0])
def test_recovers_how_far_the_queue_estimate_is_off(b: float) -> None:
    fit = QueueWeightFit(min_samples=40)
    rng = np.random.default_rng(1)
    for _ in range(200):
        fit.observe(sample(rng, b))
    assert fit.ready()
    assert fit.queue_weight() == pytest.approx(b, rel=0.05)


def test_no_answer_without_enough_requests_or_without_queueing() -> None:
    rng = np.random.default_rng(2)
    fit = QueueWeightFit(min_samples=40)
    for _ in range(39):
        fit.observe(sample(rng, 1.0))
    assert not fit.ready() and fit.queue_weight() is None
    idle = QueueWeightFit(min_samples=10)
    for _ in range(100):
        idle.observe(sample(rng, 1.0, q_max=1.0))  # nobody queued: nothing to say about it
    assert idle.ready() and idle.queue_weight() is None


def test_failed_requests_are_not_fitted_and_the_window_forgets() -> None:
    rng = np.random.default_rng(3)
    fit = QueueWeightFit(window=100, min_samples=40)
    for _ in range(100):
        fit.observe(sample(rng, 1.0, status=503))
    assert not fit.ready()
    for _ in range(100):
        fit.observe(sample(rng, 3.0))
    for _ in range(100):
        fit.observe(sample(rng, 0.5))
    assert fit.queue_weight() == pytest.approx(0.5, rel=0.05)


def test_a_nonsense_fit_gives_no_answer() -> None:
    rng = np.random.default_rng(4)
    fit = QueueWeightFit(min_samples=20)
    for _ in range(100):
        fit.observe(sample(rng, -1.0))  # more queue, faster: no weight explains that
    assert fit.queue_weight() is None
    with pytest.raises(ValueError):
        QueueWeightFit(window=10, min_samples=20)
