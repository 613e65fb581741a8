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
as a candidate. The weights with the lowest p95 need not be the ones that predict best (a cached
prefix is worth more than its own prefill, since it keeps the next request's prefill cheap too),
so a fitted candidate must win an evaluation like any other, with one exception: at the start of
a search the optimiser asks for the weights nearest the start that the rows do not rule out
(`plausible`) and whether they predict the delivered TTFT better than the start beyond the noise
(`predicts_better`), to decide which of the two has to prove itself (see `tuner.optimizer`).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping, Sequence

import numpy as np

from gorgo.core.terms import ANCHOR, FIXED, FREE, TERMS, CostTerm
from tuner.resample import block_indices
from tuner.samples import Sample

FIT_WINDOW = 400  # the successful requests a fit is taken over, newest last


class WeightFit:
    """Pure and clock-free: fed samples, asked for the weights the fit implies."""

    def __init__(self, window: int = FIT_WINDOW, min_samples: int = 40,
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
        # (free terms..., anchored terms..., TTFT - anchored and fixed terms) per successful
        # request, newest last
        self._rows: deque[tuple[float, ...]] = deque(maxlen=window)
        self._sources: deque[int | None] = deque(maxlen=window)  # each row's export

    def observe(self, s: Sample) -> None:
        if s.ok:
            y = s.ttft_ms - sum(s.terms[name] for name in self.known)
            self._rows.append((*(s.terms[t.name] for t in self.free),
                               *(s.terms[t.name] for t in self.anchors), y))
            self._sources.append(s.source)

    def dominated(self, share: float) -> bool:
        """One export supplied more than ``share`` of the rows: what they say is one sender's
        word (offline rows have no export and never dominate)."""
        counts = Counter(x for x in self._sources if x is not None)
        return max(counts.values(), default=0) > share * len(self._rows)

    def ready(self) -> bool:
        return len(self._rows) >= self.min_samples

    def __len__(self) -> int:
        """Successful requests held (at most ``window``)."""
        return len(self._rows)

    def weights(self) -> dict[str, float] | None:
        """Weight key -> factor for every anchored (1) and free (fitted) weighted term; None until
        enough requests with enough spread in every free term give a positive, finite factor for
        each (without queueing there is nothing to say about the queue's weight)."""
        if len(self._rows) < self.min_samples:
            return None
        x, _, y = self._data()
        if x.shape[1] and (x.std(axis=0) < self.min_spread_ms).any():
            return None
        coef = _lstsq(x, y)
        out = {t.weight: 1.0 for t in self.anchors if t.weight is not None}
        for t, b in zip(self.free, coef[1:], strict=True):
            b = float(b)
            if not (np.isfinite(b) and b > 0):
                return None
            out[str(t.weight)] = b
        return out

    def plausible(self, near: Mapping[str, float], level: float, rng: np.random.Generator,
                  block: int = 8, reps: int = 2000) -> dict[str, float] | None:
        """The weights closest to ``near`` that the rows do not rule out: every anchored weight
        at 1 and every free one clipped into its block-bootstrap interval (``level`` in each
        tail). Under sane weights the router's queue estimates vary little and the fitted factor
        is noisy (0.1-0.8 where bad weights give a crisp 1.0 on the simulated fleet), so this
        moves a start only as far as the evidence demands; None where `weights` gives None or
        the interval has no positive value."""
        if self.weights() is None:
            return None
        x, _, y = self._data()
        idx = block_indices(y.size, block, reps, rng)
        design = np.concatenate([np.ones((y.size, 1)), x], axis=1)
        xs, ys = design[idx], y[idx]  # (reps, n, 1 + k), (reps, n)
        gram = np.einsum("rni,rnj->rij", xs, xs)
        moment = np.einsum("rni,rn->ri", xs, ys)
        ok = np.abs(np.linalg.det(gram)) > 1e-9
        coef = np.linalg.solve(gram[ok], moment[ok][..., None])[..., 0]
        out = {t.weight: 1.0 for t in self.anchors if t.weight is not None}
        for k, t in enumerate(self.free):
            lo, hi = np.quantile(coef[:, 1 + k], [level, 1.0 - level])
            if not hi > 0:
                return None
            here = float(near.get(str(t.weight), 1.0))
            out[str(t.weight)] = float(min(max(here, lo, 1e-9), hi))
        return out

    def predicts_better(self, weights: Mapping[str, float], than: Mapping[str, float],
                        fpr: float, rng: np.random.Generator, block: int = 8,
                        reps: int = 2000) -> bool:
        """Whether ``weights`` predict TTFT better than ``than`` beyond the noise.

        The rows are split into two folds of alternating blocks of ``block`` consecutive
        requests, and each fold is predicted by each of the two with an intercept taken on the
        other fold (a constant changes no choice). The per-request differences of squared error
        (intercept: the other fold's mean) and the signs of those of absolute error (its
        median) are block-bootstrapped, and the answer is yes only if both means' lower
        ``fpr`` quantiles are above 0: better on the whole and for most requests.
        """
        if len(self._rows) < self.min_samples:
            return False
        r_new, r_old = self._residual(weights), self._residual(than)
        fold = (np.arange(r_new.size) // block) % 2
        diff, wins = np.empty(r_new.size), np.empty(r_new.size)
        for f in (0, 1):
            test, train = fold == f, fold != f
            if not (test.any() and train.any()):
                return False
            diff[test] = ((r_old[test] - r_old[train].mean()) ** 2
                          - (r_new[test] - r_new[train].mean()) ** 2)
            # the median: a mean intercept moves with the outliers and misses every request
            wins[test] = np.sign(np.abs(r_old[test] - np.median(r_old[train]))
                                 - np.abs(r_new[test] - np.median(r_new[train])))
        idx = block_indices(diff.size, block, reps, rng)
        # Better for most requests too: on squared error alone 3 stale queue estimates of 120
        # (60 s predicted, 1.5 s served) made queue 0.05 predict better than a correct start,
        # replaced without evaluation in 8 of 10 seeds. The signs alone are no test either: on
        # near-equal weights, a fit's in-sample edge wins most requests (15 % yes at 40 rows).
        return bool(np.quantile(diff[idx].mean(axis=1), fpr) > 0.0
                    and np.quantile(wins[idx].mean(axis=1), fpr) > 0.0)

    def _residual(self, weights: Mapping[str, float]) -> np.ndarray:
        """What the cost under ``weights`` leaves of each row's TTFT (y is TTFT less every
        anchored term at 1 and every fixed term); a weight not given counts as 1."""
        x, a, y = self._data()
        w_free = np.array([float(weights.get(str(t.weight), 1.0)) for t in self.free])
        w_anchor = np.array([float(weights.get(str(t.weight), 1.0)) for t in self.anchors])
        return y + a @ (1.0 - w_anchor) - x @ w_free

    def _data(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(free terms, anchored terms, TTFT less anchored and fixed terms) of the rows."""
        data = np.asarray(self._rows, dtype=float).reshape(len(self._rows), -1)
        nf = len(self.free)
        return data[:, :nf], data[:, nf:-1], data[:, -1]


def _lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares of ``y`` on an intercept and ``x``: (c, b...)."""
    coef, *_ = np.linalg.lstsq(np.column_stack([np.ones_like(y), x]), y, rcond=None)
    return coef
