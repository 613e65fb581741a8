"""Per-replica prefill rate from the residuals of live requests, by a windowed quantile fit.

The router prices prefill as ``uncached_tokens / prefill_rate``; the rate comes from the fleet file
and is only a hint. What a request actually paid beyond the network is ``TTFT - RTT``, so per
replica we fit

    TTFT - RTT  =  c  +  b * uncached_tokens        (rate = 1000 / b tokens/s)

over the replica's last ``window`` successful requests, and report a rate only when the fit can be
trusted. Two kinds of waiting corrupt the slope, and each is kept out its own way:

* Predicted queue. The router's queue estimate is worst exactly when a replica is overloaded (it
  was off by tens of seconds in simulation), and any regression on it leaks that error into the
  prefill slope: fitted rates came out up to 6x the true one. So only rows the router expected to
  wait little for (``queue_ms <= max_queue_share * prefill_ms``) are fitted at all; a replica
  whose window holds too few of them reports nothing.
* Unseen queue. Requests the router expected to start at once still wait behind chunks of other
  prompts, and short prompts wait relatively longer, which flattens a least-squares slope (rates
  5-16 % high at sane weights). Waiting only ever adds time, so we fit a low conditional
  ``quantile`` of TTFT - RTT, the service time of the requests that did not wait.

A fit is also rejected unless the older and newer halves of its rows agree on the slope (but a
fit that only counts when it says slower than the hint takes the newer half's rate when both
halves say so: a slow engine's backlog grows through its window), and a
rate is never outside ``[min_rate, max_rate]`` nor more than ``max_hint_factor`` away from the
fleet file's hint. Spans are evidence only as far as their sender is trusted, so no one export
(``Sample.source``) may hold more than ``max_source_share`` of a replica's window, and a fit counts
only if it also holds without the export that supplied the most rows: one burst of outliers
cannot set a rate. Everything is recomputed from the current window:
a replica whose window cannot confirm a rate is absent from `rates` (the optimizer keeps what it
published until a new fit replaces it: with only trustworthy fits published, "unconfirmed" is not
"wrong", and withdrawing a rate that prices a slow engine out would send traffic back to it).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np

from gorgo.core.contract import PREFILL_RATE_BOUNDS
from gorgo.core.terms import admission, prefill, queue, rtt
from tuner.samples import Sample

# The terms this fit is about, by name (`Sample.terms`): the rate prices prefill and queue alike.
RTT, QUEUE, PREFILL = rtt.TERM.name, queue.TERM.name, prefill.TERM.name
ADMISSION = admission.TERM.name

_TOKENS_PER_UNIT = 1000.0  # the slope is fitted per 1k tokens, for a well-conditioned system
_IRLS_ITERATIONS = 100
_IRLS_FLOOR_MS = 1e-3  # residuals below this count as exact fits in the reweighting
_Row = tuple[float, float, bool, float, int | None]


@dataclass(frozen=True, slots=True)
class CalibrationConfig:
    window: int = 400  # successful requests per replica, clean or not
    min_samples: int = 50  # clean rows (little predicted queue) needed in the window
    min_spread_tokens: float = 64.0  # standard deviation of uncached tokens needed for a slope
    min_rate: float = 100.0  # tokens/s
    max_rate: float = 1e7
    max_queue_share: float = 0.25  # a row is fitted only if queue_ms <= this * prefill_ms
    quantile: float = 0.1  # conditional quantile of TTFT - RTT fitted
    max_slope_disagreement: float = 0.25  # |slope(older half) - slope(newer half)| / slope
    slower_by: float = 0.3  # a queue-dominated replica's fit counts only if this much slower
    max_hint_factor: float = 10.0  # a rate stays within [hint / this, hint * this]
    max_source_share: float = 0.25  # of a replica's window that one export may fill

    def validate(self) -> None:
        if self.window < 3 or self.min_samples < 3 or self.min_samples > self.window:
            raise ValueError("calibration: need 3 <= min_samples <= window")
        lo, hi = PREFILL_RATE_BOUNDS
        if not lo <= self.min_rate < self.max_rate <= hi:  # else the routers refuse every publish
            raise ValueError(f"calibration: need {lo:g} <= min_rate < max_rate <= {hi:g} "
                             "(the routers' bounds on a prefill rate)")
        if self.min_spread_tokens < 0:
            raise ValueError("calibration: min_spread_tokens must be >= 0")
        if not self.max_queue_share >= 0:
            raise ValueError("calibration: max_queue_share must be >= 0")
        if not 0 < self.quantile < 1:
            raise ValueError("calibration: need 0 < quantile < 1")
        if not self.max_slope_disagreement > 0:
            raise ValueError("calibration: max_slope_disagreement must be > 0")
        if not 0 < self.slower_by < 1:
            raise ValueError("calibration: need 0 < slower_by < 1")
        if not self.max_hint_factor > 1:
            raise ValueError("calibration: max_hint_factor must be > 1")
        if not 0 < self.max_source_share <= 1:
            raise ValueError("calibration: need 0 < max_source_share <= 1")


@dataclass(frozen=True, slots=True)
class RateEstimate:
    rate: float  # tokens/s
    intercept_ms: float  # fixed per-request cost at the fitted quantile
    samples: int  # clean rows fitted
    window_rows: int  # successful requests in the window


# Why a fit published nothing: a short reason, which the tuner's /status shows per replica (an
# operator whose slow engine is not priced out needs to know which check held the rate back).
Fit = RateEstimate | str


def quantile_fit(x: np.ndarray, y: np.ndarray, tau: float) -> tuple[float, float] | None:
    """(intercept, slope) of the ``tau`` conditional quantile of y on x, by iteratively
    reweighted least squares on the check loss; None when the system is singular."""
    a = np.column_stack([np.ones_like(x), x])
    try:
        beta = np.linalg.lstsq(a, y, rcond=None)[0]
        for _ in range(_IRLS_ITERATIONS):
            r = y - a @ beta
            w = np.where(r >= 0, tau, 1.0 - tau) / np.maximum(np.abs(r), _IRLS_FLOOR_MS)
            nxt = np.linalg.solve(a.T @ (a * w[:, None]), a.T @ (w * y))
            done = np.allclose(nxt, beta, rtol=1e-7, atol=1e-9)
            beta = nxt
            if done:
                break
    except np.linalg.LinAlgError:
        return None
    if not np.all(np.isfinite(beta)):
        return None
    return float(beta[0]), float(beta[1])


class PrefillCalibrator:
    """Pure and clock-free: fed samples, asked for rates."""

    def __init__(self, config: CalibrationConfig | None = None,
                 hints: dict[str, float] | None = None) -> None:
        self.config = config or CalibrationConfig()
        self.config.validate()
        self.hints = dict(hints or {})  # the fleet file's rates, what the router falls back to
        # (uncached tokens, TTFT - RTT, clean, tokens ahead incl. its own, source) per
        # successful request, newest last.
        self._rows: dict[str, deque[_Row]] = {}
        self._sources: dict[str, Counter[int]] = {}  # rows in each window by export
        self._rate_used: dict[str, float] = {}  # the rate the router priced each replica at

    def follow(self, replicas: Collection[str], hints: Mapping[str, float]) -> None:
        """The replicas the routers know and their fleet-file rates: the rows of any other name
        (one a span made up, or a replica removed from the fleet) are forgotten."""
        self.hints = dict(hints)
        for name in set(self._rows) - set(replicas):
            del self._rows[name]
            self._sources.pop(name, None)
            self._rate_used.pop(name, None)

    def observe(self, s: Sample) -> None:
        if not s.ok:
            return
        cfg = self.config
        priced = s.uncached_tokens > 0 and s.terms[PREFILL] > 0
        used = s.uncached_tokens * 1000.0 / s.terms[PREFILL] if priced else math.nan
        if priced and not cfg.min_rate <= used <= cfg.max_rate:
            return  # priced at a rate no calibration publishes: no evidence for this fit
        rows = self._rows.setdefault(s.replica, deque())
        sources = self._sources.setdefault(s.replica, Counter())
        if s.source is not None:
            if sources[s.source] >= max(1, int(cfg.max_source_share * cfg.window)):
                return
            sources[s.source] += 1
        if len(rows) >= cfg.window:
            gone = rows.popleft()[4]
            if gone is not None:
                sources[gone] -= 1
                if not sources[gone]:
                    del sources[gone]
        rtt_ms, queue_ms, prefill_ms = (s.terms[name] for name in (RTT, QUEUE, PREFILL))
        if priced:
            self._rate_used[s.replica] = used
        rate_used = self._rate_used.get(s.replica)
        work = float("nan") if rate_used is None else (
            (queue_ms + prefill_ms) * rate_used / 1000.0)
        # A request that waited for a running slot (the admission term) did not run at once.
        clean = (queue_ms <= cfg.max_queue_share * prefill_ms
                 and s.terms[ADMISSION] <= cfg.max_queue_share * prefill_ms)
        rows.append((float(s.uncached_tokens), s.ttft_ms - rtt_ms, clean, work, s.source))

    def _slope(self, u: np.ndarray, y: np.ndarray) -> tuple[float, float] | str:
        """(intercept ms, ms per token), or why there is none."""
        if u.std() < self.config.min_spread_tokens:
            return f"token spread {u.std():.0f} under {self.config.min_spread_tokens:.0f}"
        fit = quantile_fit(u / _TOKENS_PER_UNIT, y, self.config.quantile)
        if fit is None:
            return "singular fit"
        if not fit[1] > 0:
            return "slope not positive"
        return fit[0], fit[1] / _TOKENS_PER_UNIT

    def estimate(self, replica: str) -> RateEstimate | None:
        est = self.verdict(replica)
        return est if isinstance(est, RateEstimate) else None

    def verdict(self, replica: str) -> Fit:
        """The replica's estimate, or why it has none (the clean fit's reason, then the
        queue-dominated fit's)."""
        cfg = self.config
        rows = self._rows.get(replica)
        if rows is None:
            return "no successful requests"
        clean = [(u, y, src) for u, y, ok, _, src in rows if ok]
        if len(clean) >= cfg.min_samples:
            est = self._robust_fit(replica, clean, len(rows))
            if isinstance(est, RateEstimate):
                return est
            # Clean rows that do not agree on a slope: a slow engine the router's queue
            # estimate (drained at the too-fast hinted rate) keeps feeding looks just so.
            why = f"clean rows: {est}"
        else:
            why = f"clean rows: {len(clean)} of {cfg.min_samples} needed"
        slower = self._slower(replica, rows)
        if isinstance(slower, RateEstimate):
            return slower
        return f"{why}; queued rows: {slower}"

    def _robust_fit(self, replica: str, data: list[tuple[float, float, int | None]],
                    window_rows: int, slower_than: float | None = None) -> Fit:
        """The fit of ``data`` (x, y, source), trusted only if the rows of the export that
        supplied the most of them do not carry it: without them the slope must agree as closely
        as the two halves of a window must."""
        cfg = self.config
        est = self._fit(replica, data, window_rows, slower_than)
        counts = Counter(src for _, _, src in data if src is not None)
        if isinstance(est, str) or not counts:
            return est
        top = counts.most_common(1)[0][0]
        rest = [row for row in data if row[2] != top]
        if len(rest) < cfg.min_samples:
            return f"{len(rest)} rows without the largest export, {cfg.min_samples} needed"
        other = self._fit(replica, rest, window_rows, slower_than)
        if isinstance(other, str):
            return f"without the largest export: {other}"
        if abs(est.rate / other.rate - 1.0) > cfg.max_slope_disagreement:
            return (f"{est.rate:.0f} tokens/s, {other.rate:.0f} without the largest export")
        return est

    def rate_bounds(self, replica: str) -> tuple[float, float]:
        """The rates a fit of ``replica`` may give: the configured range, within
        ``max_hint_factor`` of its fleet-file hint."""
        cfg = self.config
        hint = self.hints.get(replica)
        if hint is None:
            return cfg.min_rate, cfg.max_rate
        return (max(cfg.min_rate, hint / cfg.max_hint_factor),
                min(cfg.max_rate, hint * cfg.max_hint_factor))

    def _fit(self, replica: str, data: list[tuple[float, float, int | None]],
             window_rows: int, slower_than: float | None = None) -> Fit:
        """The quantile fit of ``data``, if its older and newer halves agree on the slope. With
        ``slower_than``, halves that disagree still give the newer half's fit when both are slower
        than that rate."""
        cfg = self.config
        arr = np.asarray([(u, y) for u, y, _ in data], dtype=float)
        x, y = arr[:, 0], arr[:, 1]
        fit = self._slope(x, y)
        if isinstance(fit, str):
            return fit
        intercept, slope = fit
        half = len(x) // 2
        rows = len(x)
        older, newer = self._slope(x[:half], y[:half]), self._slope(x[half:], y[half:])
        if isinstance(older, str):
            return f"older half: {older}"
        if isinstance(newer, str):
            return f"newer half: {newer}"
        if abs(older[1] - newer[1]) > cfg.max_slope_disagreement * slope:
            halves = (f"halves disagree: {1000.0 / older[1]:.0f} and {1000.0 / newer[1]:.0f} "
                      "tokens/s")
            if slower_than is None or 1000.0 / min(older[1], newer[1]) > slower_than:
                return halves
            # Both halves say slower: the newer half's, what the engine does now. A backlog
            # growing through the window makes it the slower one, an error that steers traffic
            # away and corrects itself as the backlog drains. The faster half, published here
            # before, held a 5x slower engine at 1.6-1.9x its true rate for 110 of its requests
            # (docs/tuner.md, "Prefill-rate calibration").
            (intercept, slope), rows = newer, len(x) - half
        rate = 1000.0 / slope
        lo, hi = self.rate_bounds(replica)
        if not lo <= rate <= hi:
            return f"{rate:.0f} tokens/s is outside [{lo:.0f}, {hi:.0f}]"
        return RateEstimate(rate=rate, intercept_ms=intercept, samples=rows,
                            window_rows=window_rows)

    def _slower(self, replica: str, rows: deque[_Row]) -> Fit:
        """A replica that always has a queue never yields clean rows, and the commonest reason is
        the one calibration exists for: an engine slower than its hint, which the router keeps
        feeding because it looks fast. Then the time to first token is the work ahead of the
        request (queued tokens plus its own) at the true rate, so that is fitted instead. The
        router's queue estimate makes this fit unreliable (under overload it has come out many
        times too fast), so it only ever counts when it says *slower* than the fleet file's hint,
        by more than ``slower_by``: the error it can make is to steer traffic away, never towards.
        The comparison is with the hint, not with the rate in use, which is this fit's own
        output once published (comparing with that would withdraw it again). Without a known
        hint, the rate the router priced the replica at stands in."""
        cfg = self.config
        hint = self.hints.get(replica, self._rate_used.get(replica))
        data = [(w, y, src) for _, y, _, w, src in rows if np.isfinite(w)]
        if hint is None:
            return "no rate to compare with"
        if len(data) < cfg.min_samples:
            return f"{len(data)} of {cfg.min_samples} needed"
        est = self._robust_fit(replica, data, len(rows), (1.0 - cfg.slower_by) * hint)
        if isinstance(est, str):
            return est
        if est.rate > (1.0 - cfg.slower_by) * hint:
            return f"{est.rate:.0f} tokens/s is not {cfg.slower_by:.0%} slower than {hint:.0f}"
        return est

    def rates(self) -> dict[str, float]:
        """Replica -> tokens/s for every replica with a trustworthy estimate."""
        out = {}
        for replica in sorted(self._rows):
            est = self.estimate(replica)
            if est is not None:
                out[replica] = est.rate
        return out

    def report(self) -> dict[str, dict[str, object]]:
        """Per replica: its window, the rate it would publish now, or why it would not."""
        out: dict[str, dict[str, object]] = {}
        for replica in sorted(self._rows):
            rows = self._rows[replica]
            est = self.verdict(replica)
            out[replica] = {"rows": len(rows), "clean": sum(1 for r in rows if r[2]),
                            "rate": est.rate if isinstance(est, RateEstimate) else None,
                            "withheld": est if isinstance(est, str) else None}
        return out
