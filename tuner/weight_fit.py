"""The weights under which the cost predicts the TTFT the fleet actually delivered.

The cost is a prediction of TTFT in milliseconds, the sum of the registry's terms
(`gorgo.core.terms`), each weighted by its weight. How the fit treats a term is its ``fit`` role:

* ANCHOR: physics fixes the weight at 1 (a request pays its network round trip once), so the term
  is subtracted at weight 1 and its weight is proposed as 1;
* FIXED: not weighted (the prefill is priced at the calibrated rate), subtracted as it is;
* FREE: the weight is fitted, since the router's estimate may be off by a factor (its queue);
* EXCLUDED: not a latency prediction (the failure penalty): left out altogether.

Over the last ``window`` successful requests we fit, by least squares,

    TTFT - sum(ANCHOR) - sum(FIXED)  =  c + sum_k b_k * FREE_k

and propose 1 for every anchored weight and ``b_k`` for every free one. With today's registry
that is ``TTFT - RTT - prefill = c + b * queue``, proposing ``(rtt 1, queue b)``. Unlike a random
step this does not depend on where the search stands: a few dozen requests routed under any
weights, even very bad ones, say where the predictive weights are, so the optimiser proposes them
as a candidate. It is only a proposal: the weights with the lowest p95 need not be the ones that
predict best (a cached prefix is worth more than its own prefill, since it keeps the next
request's prefill cheap too), so the proposal must win an evaluation like any other candidate,
and the evolution strategy refines from wherever it lands.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from gorgo.core.terms import ANCHOR, FIXED, FREE, TERMS, CostTerm
from tuner.samples import Sample


class WeightFit:
    """Pure and clock-free: fed samples, asked for the weights the fit implies."""

    def __init__(self, window: int = 400, min_samples: int = 40,
                 min_spread_ms: float = 10.0, terms: Sequence[CostTerm] = TERMS) -> None:
        if not 3 <= min_samples <= window:
            raise ValueError("weight fit: need 3 <= min_samples <= window")
        self.min_samples = min_samples
        self.min_spread_ms = min_spread_ms
        self.free = [t for t in terms if t.fit == FREE]
        for t in self.free:
            if t.weight is None:
                raise ValueError(f"weight fit: free term {t.name!r} has no weight to fit")
        self.anchors = [t for t in terms if t.fit == ANCHOR]
        self.known = [t.name for t in terms if t.fit in (ANCHOR, FIXED)]  # subtracted at 1
        # (free terms..., TTFT - anchored and fixed terms) per successful request, newest last
        self._rows: deque[tuple[float, ...]] = deque(maxlen=window)

    def observe(self, s: Sample) -> None:
        if s.ok:
            y = s.ttft_ms - sum(s.terms[name] for name in self.known)
            self._rows.append((*(s.terms[t.name] for t in self.free), y))

    def ready(self) -> bool:
        return len(self._rows) >= self.min_samples

    def weights(self) -> dict[str, float] | None:
        """Weight key -> factor for every anchored (1) and free (fitted) weighted term; None until
        enough requests with enough spread in every free term give a positive, finite factor for
        each (without queueing there is nothing to say about the queue's weight)."""
        if len(self._rows) < self.min_samples:
            return None
        data = np.asarray(self._rows, dtype=float)
        x, y = data[:, :-1], data[:, -1]
        if x.shape[1] and (x.std(axis=0) < self.min_spread_ms).any():
            return None
        coef, *_ = np.linalg.lstsq(np.column_stack([np.ones_like(y), x]), y, rcond=None)
        out = {t.weight: 1.0 for t in self.anchors if t.weight is not None}
        for t, b in zip(self.free, coef[1:], strict=True):
            b = float(b)
            if not (np.isfinite(b) and b > 0):
                return None
            out[str(t.weight)] = b
        return out
