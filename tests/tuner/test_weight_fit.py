"""The weights under which the cost predicts the TTFT delivered: fitted over the registry."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from gorgo.core.terms import ANCHOR, EXCLUDED, FIXED, FREE, CostTerm
from tuner.samples import Sample
from tuner.weight_fit import WeightFit


def sample(rng: np.random.Generator, b: float, *, q_max: float = 3000.0,
           status: int = 200, penalty: float = 0.0) -> Sample:
    q = float(rng.uniform(0.0, q_max))
    ttft = 80.0 + 400.0 + 30.0 + b * q + float(rng.normal(0.0, 50.0))
    return Sample(ttft, ttft + 900.0, status, "r0", "near", "gorgo", 1, 0.0,
                  {"rtt": 80.0, "queue": q, "admission": 0.0, "prefill": 400.0,
                   "penalty": penalty}, 0, 100)


@pytest.mark.parametrize("b", [0.3, 1.0, 4.0])
def test_recovers_how_far_the_queue_estimate_is_off(b: float) -> None:
    fit = WeightFit(min_samples=40)
    rng = np.random.default_rng(1)
    for _ in range(200):
        fit.observe(sample(rng, b))
    assert fit.ready()
    w = fit.weights()
    assert w is not None and list(w) == ["rtt", "queue"]
    assert w["rtt"] == 1.0  # anchored: a request pays its round trip once
    assert w["queue"] == pytest.approx(b, rel=0.05)


def test_the_penalty_is_not_a_latency_and_stays_out() -> None:
    rng, rng2, noise = (np.random.default_rng(s) for s in (5, 5, 6))
    plain, penalised = WeightFit(min_samples=40), WeightFit(min_samples=40)
    for _ in range(200):
        plain.observe(sample(rng, 2.0))
        penalised.observe(sample(rng2, 2.0, penalty=float(noise.uniform(0, 1e4))))
    # the same requests, with penalties all over the place: the very same fit
    assert penalised.weights() == plain.weights()


def test_no_answer_without_enough_requests_or_without_queueing() -> None:
    rng = np.random.default_rng(2)
    fit = WeightFit(min_samples=40)
    for _ in range(39):
        fit.observe(sample(rng, 1.0))
    assert not fit.ready() and fit.weights() is None
    idle = WeightFit(min_samples=10)
    for _ in range(100):
        idle.observe(sample(rng, 1.0, q_max=1.0))  # nobody queued: nothing to say about it
    assert idle.ready() and idle.weights() is None


def test_failed_requests_are_not_fitted_and_the_window_forgets() -> None:
    rng = np.random.default_rng(3)
    fit = WeightFit(window=100, min_samples=40)
    for _ in range(100):
        fit.observe(sample(rng, 1.0, status=503))
    assert not fit.ready()
    for _ in range(100):
        fit.observe(sample(rng, 3.0))
    for _ in range(100):
        fit.observe(sample(rng, 0.5))
    assert fit.weights()["queue"] == pytest.approx(0.5, rel=0.05)


def test_a_nonsense_fit_gives_no_answer() -> None:
    rng = np.random.default_rng(4)
    fit = WeightFit(min_samples=20)
    for _ in range(100):
        fit.observe(sample(rng, -1.0))  # more queue, faster: no weight explains that
    assert fit.weights() is None
    with pytest.raises(ValueError):
        WeightFit(window=10, min_samples=20)


def _term(name: str, fit: str, weight: str | None = None) -> CostTerm:
    return CostTerm(name=name, doc=name, compute=lambda f, s: np.zeros(0), weight=weight,
                    fit=fit)


def test_every_free_term_of_a_registry_is_fitted() -> None:
    """A registry with two free terms: TTFT - anchor - fixed = c + b1 * a + b2 * d."""
    terms = [_term("rtt", ANCHOR, "rtt"), _term("a", FREE, "wa"), _term("d", FREE, "wd"),
             _term("prefill", FIXED), _term("penalty", EXCLUDED)]
    fit = WeightFit(min_samples=40, terms=terms)
    rng = np.random.default_rng(6)
    for _ in range(300):
        t = {"rtt": float(rng.uniform(10, 200)), "a": float(rng.uniform(0, 2000)),
             "d": float(rng.uniform(0, 1000)), "prefill": float(rng.uniform(50, 500)),
             "penalty": float(rng.uniform(0, 1e4))}
        ttft = 25.0 + t["rtt"] + t["prefill"] + 0.5 * t["a"] + 3.0 * t["d"] + rng.normal(0, 20)
        fit.observe(Sample(float(ttft), float(ttft) + 100, 200, "r0", "near", "gorgo", 1, 0.0,
                           t, 0, 100))
    w = fit.weights()
    assert w is not None and set(w) == {"rtt", "wa", "wd"}
    assert w["rtt"] == 1.0
    assert w["wa"] == pytest.approx(0.5, rel=0.03) and w["wd"] == pytest.approx(3.0, rel=0.03)
    with pytest.raises(ValueError, match="no weight"):
        WeightFit(terms=[_term("x", FREE)])


TRUE = {"rtt": 1.0, "queue": 2.0}


@pytest.mark.parametrize(("given", "better"), [
    ({"rtt": 0.05, "queue": 20.0}, True),  # the queue 10x overweighted, the round trip ignored
    ({"rtt": 1.0, "queue": 0.5}, True),  # the queue underweighted 4x
    ({"rtt": 1.0, "queue": 2.0}, False),  # the same weights: no better
    ({"rtt": 3.0, "queue": 2.0}, False),  # a constant RTT is an intercept: no worse prediction
])
def test_predicts_better_out_of_sample_only_beyond_the_noise(given: dict, better: bool) -> None:
    fit = WeightFit(min_samples=40)
    rng = np.random.default_rng(7)
    for _ in range(60):
        fit.observe(sample(rng, 2.0))
    assert fit.predicts_better(TRUE, given, 0.05, np.random.default_rng(0)) is better
    assert not fit.predicts_better(given, TRUE, 0.05, np.random.default_rng(0))



def test_a_few_outliers_do_not_make_worse_weights_predict_better() -> None:
    """3 of 120 requests with a stale queue estimate (60 s predicted, served in 1.5 s) made
    queue 0.05 "predict better" than the true 2.0 on squared error, and the correct start was
    replaced without an evaluation in 8 of 10 seeds: a better prediction is one of most
    requests, not of the sum of squares."""
    fit = WeightFit(min_samples=40)
    rng = np.random.default_rng(3)
    for i in range(120):
        s = sample(rng, 2.0)
        if i in (10, 50, 90):
            s = replace(s, terms={**s.terms, "queue": 60_000.0}, ttft_ms=2000.0)
        fit.observe(s)
    assert not fit.predicts_better({"rtt": 1.0, "queue": 0.05}, TRUE, 0.05,
                                   np.random.default_rng(0))

def test_plausible_moves_a_start_only_as_far_as_the_evidence_demands() -> None:
    fit = WeightFit(min_samples=40)
    rng = np.random.default_rng(9)
    for _ in range(120):
        fit.observe(sample(rng, 2.0))
    high = fit.plausible({"rtt": 0.05, "queue": 20.0}, 0.05, np.random.default_rng(0))
    low = fit.plausible({"rtt": 20.0, "queue": 0.05}, 0.05, np.random.default_rng(0))
    fitted = fit.weights()
    inside = fit.plausible(fitted, 0.05, np.random.default_rng(0))
    assert fitted is not None and high is not None and low is not None and inside is not None
    assert high["rtt"] == low["rtt"] == 1.0  # anchored: physics, not evidence
    # the interval's ends, either side of the fitted factor, and close to it with 120 requests
    assert 1.9 < low["queue"] < fitted["queue"] < high["queue"] < 2.1
    assert inside == fitted  # nothing rules the start out: it stays where it is


def test_no_answer_from_too_few_requests() -> None:
    rng = np.random.default_rng(8)
    fit = WeightFit(min_samples=40)
    for _ in range(39):
        fit.observe(sample(rng, 2.0))
    assert not fit.predicts_better(TRUE, {"rtt": 0.05, "queue": 20.0}, 0.05, rng)
    assert fit.plausible({"rtt": 0.05, "queue": 20.0}, 0.05, rng) is None


def test_rows_of_one_export_dominate_the_fit() -> None:
    rng = np.random.default_rng(10)
    fit = WeightFit(window=100, min_samples=40)
    for k in range(100):
        fit.observe(replace(sample(rng, 2.0), source=1 if k < 60 else k))
    assert fit.dominated(0.5)  # 60 of 100 rows from export 1
    for k in range(20):
        fit.observe(replace(sample(rng, 2.0), source=1000 + k))  # export 1's oldest rows leave
    assert not fit.dominated(0.5) and fit.dominated(0.3)  # 40 of 100
    offline = WeightFit(min_samples=40)
    for _ in range(50):
        offline.observe(sample(rng, 2.0))
    assert not offline.dominated(0.01)  # no export at all
