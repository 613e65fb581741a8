"""Prefill-rate calibration: recovers a known rate, and publishes nothing it cannot trust."""

from __future__ import annotations

import numpy as np
import pytest

from tuner.calibration import CalibrationConfig, PrefillCalibrator
from tuner.samples import Sample


def traffic(rng: np.random.Generator, n: int, *, rate: float, router_rate: float = 10_000.0,
            replica: str = "r0", rtt: float = 40.0, fixed: float = 12.0, noise: float = 5.0,
            queue: bool = True, uncached: tuple[int, int] = (64, 4096),
            status: int = 200) -> list[Sample]:
    """Requests whose true TTFT = RTT + fixed + (queued + uncached) / rate, as the router priced
    them at ``router_rate``."""
    out = []
    for _ in range(n):
        u = int(rng.integers(*uncached))
        q = float(rng.integers(0, 8000)) if queue else 0.0
        ttft = rtt + fixed + (u + q) / rate * 1000.0 + rng.normal(0.0, noise)
        out.append(Sample(
            ttft_ms=ttft, e2e_ms=ttft + 300.0, status=status, replica=replica, region="x",
            policy="gorgo", weights_version=1, predicted_ttft_ms=0.0, rtt_ms=rtt,
            queue_ms=q / router_rate * 1000.0, prefill_ms=u / router_rate * 1000.0,
            uncached_tokens=u, prompt_tokens=u))
    return out


@pytest.mark.parametrize("rate", [800.0, 5000.0, 40_000.0])
def test_recovers_the_true_rate_with_queueing(rate: float) -> None:
    cal = PrefillCalibrator(CalibrationConfig(window=400, min_samples=50))
    for s in traffic(np.random.default_rng(1), 400, rate=rate):
        cal.observe(s)
    est = cal.estimate("r0")
    assert est is not None
    assert est.rate == pytest.approx(rate, rel=0.05)
    assert est.intercept_ms == pytest.approx(12.0, abs=3.0)
    assert est.queue_ms_per_token == pytest.approx(1000.0 / rate, rel=0.1)
    assert cal.rates() == {"r0": est.rate}


def test_recovers_the_rate_without_queueing() -> None:
    cal = PrefillCalibrator()
    for s in traffic(np.random.default_rng(2), 200, rate=3000.0, queue=False):
        cal.observe(s)
    assert cal.rates()["r0"] == pytest.approx(3000.0, rel=0.05)


def test_replicas_are_fitted_separately() -> None:
    cal = PrefillCalibrator()
    rng = np.random.default_rng(3)
    for a, b in zip(traffic(rng, 300, rate=1000.0, replica="a"),
                    traffic(rng, 300, rate=8000.0, replica="b"), strict=True):
        cal.observe(a)
        cal.observe(b)
    rates = cal.rates()
    assert rates["a"] == pytest.approx(1000.0, rel=0.05)
    assert rates["b"] == pytest.approx(8000.0, rel=0.05)


def test_nothing_is_published_without_enough_evidence() -> None:
    rng = np.random.default_rng(4)
    few = PrefillCalibrator(CalibrationConfig(min_samples=50))
    for s in traffic(rng, 49, rate=2000.0):
        few.observe(s)
    assert few.estimate("r0") is None and few.rates() == {}
    # No spread in uncached tokens: the slope is not identifiable.
    flat = PrefillCalibrator()
    for s in traffic(rng, 300, rate=2000.0, uncached=(1000, 1001)):
        flat.observe(s)
    assert flat.rates() == {}
    # Errors are not latency samples.
    errs = PrefillCalibrator()
    for s in traffic(rng, 300, rate=2000.0, status=503):
        errs.observe(s)
    assert errs.rates() == {}


def test_insane_fits_are_never_published() -> None:
    rng = np.random.default_rng(5)
    # TTFT falls as prompts grow: negative slope.
    neg = PrefillCalibrator()
    for s in traffic(rng, 300, rate=-2000.0, queue=False, fixed=5000.0):
        neg.observe(s)
    assert neg.rates() == {}
    # Pure noise with no dependence on tokens: slope ~ 0, rate absurd or negative.
    noise = PrefillCalibrator(CalibrationConfig(max_rate=1e6))
    for s in traffic(rng, 300, rate=1e12, queue=False, noise=50.0):
        noise.observe(s)
    assert noise.rates() == {}


def test_window_forgets_old_behaviour() -> None:
    cal = PrefillCalibrator(CalibrationConfig(window=200, min_samples=50))
    rng = np.random.default_rng(6)
    for s in traffic(rng, 200, rate=1000.0):
        cal.observe(s)
    for s in traffic(rng, 200, rate=4000.0):
        cal.observe(s)
    assert cal.rates()["r0"] == pytest.approx(4000.0, rel=0.05)


def test_config_is_validated() -> None:
    for bad in (CalibrationConfig(window=10, min_samples=20), CalibrationConfig(min_rate=0),
                CalibrationConfig(min_spread_tokens=-1)):
        with pytest.raises(ValueError):
            PrefillCalibrator(bad)
