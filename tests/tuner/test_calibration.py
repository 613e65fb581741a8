"""Prefill-rate calibration: recovers a known rate, and publishes nothing it cannot trust."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tuner.calibration import CalibrationConfig, PrefillCalibrator, quantile_fit
from tuner.samples import Sample


def traffic(rng: np.random.Generator, n: int, *, rate: float, router_rate: float = 10_000.0,
            replica: str = "r0", rtt: float = 40.0, fixed: float = 12.0, noise: float = 2.0,
            hidden_wait_ms: float = 0.0, queue_tokens: int = 0, queue_error: float = 1.0,
            uncached: tuple[int, int] = (64, 4096), status: int = 200) -> list[Sample]:
    """Requests whose true TTFT = RTT + fixed + (queued + uncached) / rate + hidden wait, as the
    router priced them at ``router_rate``. The router predicts ``queue_tokens / 2`` to
    ``queue_tokens`` queued tokens, while on average ``queue_error`` times as many, with as much
    spread again, really are queued (an overloaded replica); on half the requests an unseen
    wait (exponential, mean ``hidden_wait_ms``) hits short prompts hardest, as waiting behind
    other prompts' chunks does."""
    out = []
    for _ in range(n):
        u = int(rng.integers(*uncached))
        q = float(rng.integers(queue_tokens // 2, queue_tokens)) if queue_tokens else 0.0
        real_q = q * rng.uniform(0.0, 2.0 * queue_error)
        hidden = 0.0
        if hidden_wait_ms and rng.random() < 0.5:
            hidden = rng.exponential(hidden_wait_ms) * (1.0 - u / uncached[1])
        ttft = (rtt + fixed + (u + real_q) / rate * 1000.0 + hidden
                + abs(rng.normal(0.0, noise)))
        out.append(Sample(
            ttft_ms=ttft, e2e_ms=ttft + 300.0, status=status, replica=replica, region="x",
            policy="gorgo", weights_version=1, predicted_ttft_ms=0.0,
            terms={"rtt": rtt, "queue": q / router_rate * 1000.0, "admission": 0.0,
                   "prefill": u / router_rate * 1000.0, "penalty": 0.0},
            uncached_tokens=u, prompt_tokens=u))
    return out


def feed(cal: PrefillCalibrator, samples: list[Sample]) -> PrefillCalibrator:
    for s in samples:
        cal.observe(s)
    return cal


@pytest.mark.parametrize("rate", [800.0, 5000.0, 40_000.0])
def test_recovers_the_true_rate(rate: float) -> None:
    cal = feed(PrefillCalibrator(CalibrationConfig(window=400, min_samples=50)),
               traffic(np.random.default_rng(1), 400, rate=rate))
    est = cal.estimate("r0")
    assert est is not None
    assert est.rate == pytest.approx(rate, rel=0.05)
    assert est.intercept_ms == pytest.approx(12.0, abs=3.0)
    assert est.samples == est.window_rows == 400
    assert cal.rates() == {"r0": est.rate}


def test_unseen_waiting_does_not_flatten_the_slope() -> None:
    # Short prompts wait longest behind others' chunks, which the router does not see: least
    # squares reads that as a cheaper token. The low quantile is the requests that did not wait.
    rng = np.random.default_rng(2)
    samples = traffic(rng, 400, rate=3000.0, hidden_wait_ms=800.0)
    x = np.array([s.uncached_tokens for s in samples], float)
    y = np.array([s.ttft_ms - s.terms["rtt"] for s in samples])
    ols_rate = 1000.0 / np.polyfit(x, y, 1)[0]
    assert ols_rate > 1.15 * 3000.0  # the defect this guards against
    cal = feed(PrefillCalibrator(), samples)
    assert cal.rates()["r0"] == pytest.approx(3000.0, rel=0.05)


def test_queue_dominated_rows_do_not_move_the_rate() -> None:
    rng = np.random.default_rng(3)
    cal = PrefillCalibrator(CalibrationConfig(window=400, min_samples=50))
    # An overloaded replica: predicted queue far above the prefill, and really 5x longer still.
    clean = traffic(rng, 100, rate=2000.0)
    overloaded = traffic(rng, 300, rate=2000.0, queue_tokens=200_000, queue_error=5.0)
    assert all(s.terms["queue"] > cal.config.max_queue_share * s.terms["prefill"]
               for s in overloaded[:50])
    for i, s in enumerate(overloaded):
        cal.observe(s)
        if i % 3 == 0 and clean:
            cal.observe(clean.pop())
    est = cal.estimate("r0")
    assert est is not None and est.samples == 100 and est.window_rows == 400
    assert est.rate == pytest.approx(2000.0, rel=0.05)


def test_an_overloaded_replica_fits_nothing_faster_than_its_hint() -> None:
    """Once r0's window holds too few clean rows, only a fit that says slower than the hint
    counts; the optimizer keeps the last rate it published until a new fit replaces it."""
    rng = np.random.default_rng(4)
    cal = feed(PrefillCalibrator(CalibrationConfig(window=200, min_samples=50),
                                 hints={"r0": 2000.0, "b": 9000.0}),
               traffic(rng, 200, rate=2000.0) + traffic(rng, 200, rate=9000.0, replica="b"))
    assert set(cal.rates()) == {"r0", "b"}
    # r0 becomes overloaded, its queue estimate 5x too short on average.
    feed(cal, traffic(rng, 140, rate=2000.0, queue_tokens=200_000, queue_error=0.2))
    assert "r0" in cal.rates()  # 60 clean rows left in its window still confirm it
    feed(cal, traffic(rng, 20, rate=2000.0, queue_tokens=200_000, queue_error=0.2))
    assert set(cal.rates()) == {"b"}
    # Clean traffic again: confirmed anew.
    feed(cal, traffic(rng, 200, rate=2000.0))
    assert cal.rates()["r0"] == pytest.approx(2000.0, rel=0.05)


def test_halves_that_disagree_publish_nothing_unless_both_say_slower_than_the_hint() -> None:
    rng = np.random.default_rng(5)
    cal = feed(PrefillCalibrator(CalibrationConfig(window=400, min_samples=50),
                                 hints={"r0": 5000.0}),
               traffic(rng, 200, rate=2000.0) + traffic(rng, 200, rate=4500.0))
    assert cal.rates() == {}
    assert "halves disagree" in str(cal.verdict("r0"))
    # An engine that slowed down through the window (or a backlog growing through it: a slow
    # engine the router still feeds) makes the halves disagree, but both say the engine is slower
    # than its hint: the newer half's rate, what the engine does now, is published.
    slow = feed(PrefillCalibrator(CalibrationConfig(window=400, min_samples=50),
                                  hints={"r0": 10_000.0}),
                traffic(rng, 200, rate=4000.0) + traffic(rng, 200, rate=1500.0))
    est = slow.estimate("r0")
    assert est is not None and est.rate == pytest.approx(1500.0, rel=0.05)
    assert est.samples == 200  # the newer half's rows
    # Sped up again (still slower than the hint): the newer half follows it back.
    feed(slow, traffic(rng, 200, rate=4000.0))
    back = slow.estimate("r0")
    assert back is not None and back.rate == pytest.approx(4000.0, rel=0.05)


def test_replicas_are_fitted_separately() -> None:
    cal = PrefillCalibrator()
    rng = np.random.default_rng(6)
    for a, b in zip(traffic(rng, 300, rate=1000.0, replica="a"),
                    traffic(rng, 300, rate=8000.0, replica="b"), strict=True):
        cal.observe(a)
        cal.observe(b)
    rates = cal.rates()
    assert rates["a"] == pytest.approx(1000.0, rel=0.05)
    assert rates["b"] == pytest.approx(8000.0, rel=0.05)


def test_nothing_is_published_without_enough_evidence() -> None:
    rng = np.random.default_rng(7)
    few = feed(PrefillCalibrator(CalibrationConfig(min_samples=50)),
               traffic(rng, 49, rate=2000.0))
    assert few.estimate("r0") is None and few.rates() == {}
    # The tuner's /status says which check held each rate back.
    assert few.report() == {"r0": {
        "rows": 49, "clean": 49, "rate": None,
        "withheld": "clean rows: 49 of 50 needed; queued rows: 49 of 50 needed"}}
    # No spread in uncached tokens: the slope is not identifiable.
    flat = feed(PrefillCalibrator(), traffic(rng, 300, rate=2000.0, uncached=(1000, 1001)))
    assert flat.rates() == {}
    assert "token spread 0 under 64" in str(flat.verdict("r0"))
    # Errors are not latency samples.
    errs = feed(PrefillCalibrator(), traffic(rng, 300, rate=2000.0, status=503))
    assert errs.rates() == {} and errs.verdict("r0") == "no successful requests"


def test_insane_fits_are_never_published() -> None:
    rng = np.random.default_rng(8)
    # TTFT falls as prompts grow: negative slope.
    neg = feed(PrefillCalibrator(), traffic(rng, 300, rate=-2000.0, fixed=5000.0))
    assert neg.rates() == {}
    # Pure noise with no dependence on tokens: slope ~ 0, rate absurd or negative.
    noise = feed(PrefillCalibrator(CalibrationConfig(max_rate=1e6)),
                 traffic(rng, 300, rate=1e12, noise=50.0))
    assert noise.rates() == {}


def test_window_forgets_old_behaviour() -> None:
    rng = np.random.default_rng(9)
    cal = feed(PrefillCalibrator(CalibrationConfig(window=200, min_samples=50)),
               traffic(rng, 200, rate=1000.0) + traffic(rng, 200, rate=4000.0))
    assert cal.rates()["r0"] == pytest.approx(4000.0, rel=0.05)


def test_quantile_fit_finds_the_lower_envelope() -> None:
    rng = np.random.default_rng(10)
    x = rng.uniform(0, 10, 2000)
    y = 3.0 + 2.0 * x + rng.exponential(5.0, 2000)  # one-sided noise above the line
    c, b = quantile_fit(x, y, 0.02)
    assert b == pytest.approx(2.0, rel=0.05) and c == pytest.approx(3.0, abs=0.5)
    assert quantile_fit(np.zeros(10), np.ones(10), 0.5) is None  # singular: no slope


def test_config_is_validated() -> None:
    for bad in (CalibrationConfig(window=10, min_samples=20), CalibrationConfig(min_rate=0),
                CalibrationConfig(min_spread_tokens=-1), CalibrationConfig(max_queue_share=-0.1),
                CalibrationConfig(quantile=0.0), CalibrationConfig(quantile=1.0),
                CalibrationConfig(max_slope_disagreement=0.0),
                CalibrationConfig(max_rate=1e12)):  # above what the routers take: 400 each time
        with pytest.raises(ValueError):
            PrefillCalibrator(bad)


def test_a_span_priced_at_an_impossible_rate_is_no_evidence() -> None:
    rng = np.random.default_rng(3)
    forged = dataclasses.replace(traffic(rng, 1, rate=5000.0)[0], uncached_tokens=10**9,
                                 prompt_tokens=10**9)  # as priced: at 1e10 tokens/s or more
    cal = feed(PrefillCalibrator(CalibrationConfig(window=400, min_samples=50)),
               [*traffic(rng, 200, rate=5000.0), forged, *traffic(rng, 200, rate=5000.0)])
    est = cal.estimate("r0")  # one such row held the fit back for the whole window before
    assert est is not None and est.rate == pytest.approx(5000.0, rel=0.05)
    assert est.window_rows == 400


def busy(rng: np.random.Generator, n: int, *, rate: float, router_rate: float) -> list[Sample]:
    """A replica that always has 2k-8k tokens queued ahead (the router's count of them is right
    to within ~20 %), priced at ``router_rate``."""
    out = []
    for _ in range(n):
        u = int(rng.integers(64, 4096))
        q = float(rng.integers(2_000, 8_000))
        ttft = 40.0 + 12.0 + (u + q * rng.lognormal(0.0, 0.2)) / rate * 1000.0
        out.append(Sample(ttft, ttft + 300.0, 200, "r0", "x", "gorgo", 1, 0.0,
                          {"rtt": 40.0, "queue": q / router_rate * 1000.0, "admission": 0.0,
                           "prefill": u / router_rate * 1000.0, "penalty": 0.0}, u, u))
    return out


def test_an_engine_slower_than_its_hint_is_found_though_it_is_never_idle() -> None:
    """The slow engine the router keeps feeding (it looks fast) always has a queue, so it never
    yields clean rows; the work ahead of each request at the true rate explains its TTFT."""
    rng = np.random.default_rng(11)
    cal = PrefillCalibrator(CalibrationConfig(), hints={"r0": 10_000.0})
    feed(cal, busy(rng, 400, rate=2_000.0, router_rate=10_000.0))
    est = cal.estimate("r0")
    # The low quantile favours the requests whose real queue was shortest, so the rate comes
    # out somewhat high; what matters is that it is far below the hint.
    assert est is not None and 1_800.0 <= est.rate <= 3_000.0
    # Published, the router prices it at that rate: the fit is compared with the hint, not with
    # its own output, so it still counts.
    feed(cal, busy(rng, 400, rate=2_000.0, router_rate=est.rate))
    again = cal.estimate("r0")
    assert again is not None and again.rate == pytest.approx(est.rate, rel=0.15)
    # Without the hint (a router that does not report it), the rate in use stands in.
    alone = feed(PrefillCalibrator(CalibrationConfig()),
                 busy(rng, 400, rate=2_000.0, router_rate=10_000.0))
    assert alone.estimate("r0") is not None


def test_a_queued_replica_that_looks_faster_than_its_hint_publishes_nothing() -> None:
    """Under overload the queue-based fit has come out many times too fast: it only ever counts
    when it says slower than the hint."""
    rng = np.random.default_rng(12)
    cal = PrefillCalibrator(CalibrationConfig(), hints={"r0": 10_000.0})
    feed(cal, traffic(rng, 400, rate=10_000.0, queue_tokens=8_000, queue_error=0.3))
    assert cal.estimate("r0") is None and cal.rates() == {}
