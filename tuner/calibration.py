"""Per-replica prefill rate from the residuals of live requests, by windowed least squares.

The router prices prefill as ``uncached_tokens / prefill_rate`` and queue wait as
``waiting_tokens / prefill_rate``; the rate comes from the fleet file and is only a hint. What the
request actually paid beyond the network is ``TTFT - RTT``, so per replica we fit

    TTFT - RTT  =  c  +  b_u * uncached_tokens  +  b_q * queued_tokens

over the last ``window`` successful requests, and the rate is ``1000 / b_u`` tokens/s. The
intercept absorbs fixed per-request cost (scheduling, first decode step); the queue gets its own
slope so that an imperfect queue estimate does not bias the prefill slope. Queued tokens are not on
the span, but the decision carries ``queue_ms`` and ``prefill_ms`` priced at the rate the router
used, so ``queued = queue_ms * uncached / prefill_ms``. A rate is reported only from enough
samples, with enough spread in uncached tokens to identify the slope, and inside sane bounds: a
noisy fit must never publish a zero, negative or absurd rate.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from tuner.samples import Sample


@dataclass(frozen=True, slots=True)
class CalibrationConfig:
    window: int = 400
    min_samples: int = 50
    min_spread_tokens: float = 64.0  # standard deviation of uncached tokens needed for a slope
    min_rate: float = 100.0  # tokens/s
    max_rate: float = 1e7

    def validate(self) -> None:
        if self.window < 3 or self.min_samples < 3 or self.min_samples > self.window:
            raise ValueError("calibration: need 3 <= min_samples <= window")
        if not 0 < self.min_rate < self.max_rate:
            raise ValueError("calibration: need 0 < min_rate < max_rate")
        if self.min_spread_tokens < 0:
            raise ValueError("calibration: min_spread_tokens must be >= 0")


@dataclass(frozen=True, slots=True)
class RateEstimate:
    rate: float  # tokens/s
    intercept_ms: float
    queue_ms_per_token: float
    samples: int


class PrefillCalibrator:
    """Pure and clock-free: fed samples, asked for rates."""

    def __init__(self, config: CalibrationConfig | None = None) -> None:
        self.config = config or CalibrationConfig()
        self.config.validate()
        self._rows: dict[str, deque[tuple[float, float, float]]] = {}
        self._rate_used: dict[str, float] = {}

    def observe(self, s: Sample) -> None:
        if not s.ok:
            return
        if s.uncached_tokens > 0 and s.prefill_ms > 0:
            self._rate_used[s.replica] = s.uncached_tokens * 1000.0 / s.prefill_ms
        if s.queue_ms > 0:
            rate_used = self._rate_used.get(s.replica)
            if rate_used is None:
                return  # queued tokens unknown until this replica's rate has been seen
            queued = s.queue_ms * rate_used / 1000.0
        else:
            queued = 0.0
        rows = self._rows.setdefault(s.replica, deque(maxlen=self.config.window))
        rows.append((float(s.uncached_tokens), queued, s.ttft_ms - s.rtt_ms))

    def estimate(self, replica: str) -> RateEstimate | None:
        cfg = self.config
        rows = self._rows.get(replica)
        if rows is None or len(rows) < cfg.min_samples:
            return None
        data = np.asarray(rows)
        u, q, y = data[:, 0], data[:, 1], data[:, 2]
        if u.std() < cfg.min_spread_tokens:
            return None
        cols = [np.ones_like(u), u]
        with_queue = q.std() > 0
        if with_queue:
            cols.append(q)
        coef, *_ = np.linalg.lstsq(np.column_stack(cols), y, rcond=None)
        slope = float(coef[1])
        if not slope > 0:
            return None
        rate = 1000.0 / slope
        if not cfg.min_rate <= rate <= cfg.max_rate:
            return None
        return RateEstimate(
            rate=rate,
            intercept_ms=float(coef[0]),
            queue_ms_per_token=float(coef[2]) if with_queue else float("nan"),
            samples=len(rows),
        )

    def rates(self) -> dict[str, float]:
        """Replica -> tokens/s for every replica with a trustworthy estimate."""
        out = {}
        for replica in sorted(self._rows):
            est = self.estimate(replica)
            if est is not None:
                out[replica] = est.rate
        return out
