"""The queue weight under which the cost predicts the TTFT the fleet actually delivered.

The cost is a prediction of TTFT in milliseconds: a request pays its network round trip once
(``w_rtt = 1``) and its prefill at the calibrated rate, so the one factor physics leaves open is
how far the router's queue estimate is from the wait requests really had. Over the last
``window`` successful requests we fit

    TTFT - RTT - prefill  =  c + b * queue

by least squares; ``(1, b)`` are the weights of a cost that predicts TTFT. Unlike a random step
this does not depend on where the search stands: a few dozen requests routed under any weights,
even very bad ones, say where the predictive weights are, so the optimiser proposes them as a
candidate. It is only a proposal: the weights with the lowest p95 need not be the ones that
predict best (a cached prefix is worth more than its own prefill, since it keeps the next
request's prefill cheap too), so the proposal must win an evaluation like any other candidate,
and the evolution strategy refines from wherever it lands.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from tuner.samples import Sample


class QueueWeightFit:
    """Pure and clock-free: fed samples, asked for the queue weight."""

    def __init__(self, window: int = 400, min_samples: int = 40,
                 min_spread_ms: float = 10.0) -> None:
        if not 3 <= min_samples <= window:
            raise ValueError("weight fit: need 3 <= min_samples <= window")
        self.min_samples = min_samples
        self.min_spread_ms = min_spread_ms
        self._rows: deque[tuple[float, float]] = deque(maxlen=window)

    def observe(self, s: Sample) -> None:
        if s.ok:
            self._rows.append((s.queue_ms, s.ttft_ms - s.rtt_ms - s.prefill_ms))

    def ready(self) -> bool:
        return len(self._rows) >= self.min_samples

    def queue_weight(self) -> float | None:
        """``b``, or None until enough requests with enough spread in queue wait give a positive
        slope (without queueing there is nothing to say about the queue's weight)."""
        if len(self._rows) < self.min_samples:
            return None
        data = np.asarray(self._rows)
        q, y = data[:, 0], data[:, 1]
        if q.std() < self.min_spread_ms:
            return None
        coef, *_ = np.linalg.lstsq(np.column_stack([np.ones_like(q), q]), y, rcond=None)
        b = float(coef[1])
        return b if np.isfinite(b) and b > 0 else None
