"""(1+1) evolution strategy over the cost weights, scored on the fleet's objective (live p95
TTFT by default; p95 E2E, or the SLO's miss rate: `OptimizerConfig.objective`).

The search space is the registry's weighted terms that the objective counts
(`gorgo.core.terms.weight_keys`, in registry order: ``rtt`` and ``queue`` for TTFT), each inside
the contract's bounds (``WEIGHT_BOUNDS`` of `gorgo.core.contract`) intersected with the
configured ``bounds``. Points of the search (incumbents, candidates, the fitted weights) are
mappings weight key -> factor; a `Proposal` carries them as `Weights` with a fresh version.

Pure and single-threaded: the caller feeds samples (`Tuner.observe`) and asks, with its own clock,
whether new weights should go live (`Tuner.next_weights(now)`). The live tuner drives it from OTLP
spans and a wall clock; an offline simulation can drive it from a virtual clock.

How one evaluation runs, and why (docs/tuner.md has the full story):

* Every window publishes its own weights version and routes ``window_samples`` requests (the
  routers count them), and it is scored on every one of them, attributed by the version that
  routed it: a window closed on its first completions would be scored on its fastest requests.
* Incumbent and candidate take turns in windows, in an order drawn at random per evaluation
  (`window_plan`), so the incumbent is re-measured under the same conditions instead of keeping
  the score of one lucky window forever, and no pattern of the load can side with one arm
  beyond what the spread of each arm's windows shows. While an evaluation waits for its slowest
  requests, the next one already routes; a verdict that changes the incumbent drops it.
* Lower p95 is better and the test is on the log ratio of the arms' p95s, each arm scored by the
  mean of its windows' log p95s: the candidate is accepted only if the upper (1 - fpr) bound of
  that ratio is below ``log(1 - margin)``. Its variance is what
  a seeded, window-stratified block bootstrap sees inside the windows plus a between-window term
  the tuner learns from how far its past windows of one arm fell apart, per lag (a burst that
  fills a window is one draw, which no resampling inside it sees; a trend parts windows the
  more, the further apart they ran), weighed by this evaluation's order. No score is negated and no
  multiplicative tolerance is applied to one. Before every request has reported back, only an
  acceptance that no outcome of the missing ones could undo is taken.
* A candidate must also not worsen E2E p95 by more than ``e2e_margin`` nor the error rate by more
  than ``max_error_increase``.
* Candidates are log-normal steps in log space, reflected at the bounds (a bound is not an
  attractor), with the 1/5 success rule for the step size; and, when it is far from the
  incumbent, the weights under which the cost predicts the TTFT delivered (`tuner.weight_fit`),
  which is how the search leaves bad weights fast. At the start of a search, fitted weights that
  predict the delivered TTFT better than the start weights beyond the noise (out of sample) take
  their place at once, and the start weights are the first candidate: the burden of proof is on
  the weights that mispredict, since a p95 over a few windows cannot show a 1.2x gap early
  enough (``model_start``). Small step size or many failures in a row:
  converged, and from then on the incumbent is monitored; a drift of live p95 restarts the search.
  A newly accepted incumbent stays on probation until it has been re-measured: if its live p95
  regresses past ``rollback``, the previous weights come back.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import numpy as np

from gorgo.core.contract import VERSION_MAX, WEIGHT_BOUNDS
from gorgo.core.fleet import finite_number
from gorgo.core.terms import E2E, OBJECTIVES, SLO, TTFT, WEIGHTED, weight_keys
from gorgo.core.weights import Weights
from gorgo.errors import UserError
from tuner.calibration import CalibrationConfig, PrefillCalibrator
from tuner.resample import block_indices
from tuner.samples import Sample
from tuner.weight_fit import FIT_WINDOW, WeightFit

INCUMBENT, CANDIDATE, MONITOR, BRIDGE = "incumbent", "candidate", "monitor", "bridge"
WARMUP = "warmup"
# A candidate from a random step, from the weight fit, or the start weights themselves once the
# fit took their place (`OptimizerConfig.model_start`)
STEP, MODEL, START = "step", "model", "start"
UNFINISHED_MS = 1e12  # stands in for a request that has not reported back, in the worst case
EVALUATING, CONVERGED = "evaluating", "converged"
STATE_FORMAT = 3  # 3: + the objective; 2 (still read, as ttft): weights are {key: factor};
# 1 (still read): [rtt, queue] lists
LEGACY_KEYS = ("rtt", "queue")  # what a format-1 list holds, in order
# The search space's dimensions under the default objective, in registry order: the weights that
# matter for TTFT. A tuner for another objective searches `weight_keys(objective)`
# (`OptimizerConfig.keys`): a weight its objective does not count would be searched blindly.
KEYS: tuple[str, ...] = weight_keys(TTFT)

Point = dict[str, float]  # weight key -> factor, one entry per KEYS
Bounds = dict[str, tuple[float, float]]


def normalize_bounds(value: Any, keys: Sequence[str] = KEYS) -> Bounds:
    """``[low, high]`` for every weight, or ``{key: [low, high]}`` for some (the others keep the
    contract's bounds): as one (low, high) per weight key of ``keys``, in their order. A weight
    of the registry outside ``keys`` is dropped (another objective's bound)."""
    def pair(v: Any, where: str) -> tuple[float, float]:
        xs = [finite_number(x) for x in v] if isinstance(v, list | tuple) else []
        if len(xs) != 2 or None in xs:  # float() of a 400-digit integer would raise
            raise ValueError(f"{where}: expected [low, high] of finite numbers, got {str(v)[:80]}")
        return xs[0], xs[1]

    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(WEIGHTED))
        if unknown:
            raise ValueError(f"bounds.{unknown[0]}: unknown weight (known: {', '.join(keys)})")
        return {k: pair(value[k], f"bounds.{k}") if k in value else WEIGHT_BOUNDS[k]
                for k in keys}
    if not isinstance(value, list | tuple):
        raise ValueError(f"bounds: expected [low, high] or {{weight: [low, high]}}, got {value!r}")
    return dict.fromkeys(keys, pair(value, "bounds"))


def _default_bounds() -> Bounds:
    return {k: WEIGHT_BOUNDS[k] for k in KEYS}


@dataclass(frozen=True, slots=True)
class OptimizerConfig:
    # per weight key; given as [low, high] (every weight) or {key: [low, high]} (those named)
    bounds: Bounds = field(default_factory=_default_bounds)
    initial_sigma: float = 0.5  # step size in log space (0.5 ~ a factor of 1.6)
    min_sigma: float = 0.03  # below this the search has converged
    max_sigma: float = 2.0
    step_up: float = 1.5  # sigma *= step_up on success ...
    success_rate: float = 0.2  # ... and shrinks on failure so that this rate holds it (1/5 rule)
    max_failures: int = 20  # failed evaluations in a row that also mean converged
    window_samples: int = 40  # requests a window routes (all of them are scored)
    min_window_s: float = 0.0  # and at least this long
    census_timeout_s: float = 300.0  # a closed window still missing requests is scored anyway
    pairs: int = 2  # incumbent/candidate window pairs per evaluation
    quantile: float = 0.95
    fpr: float = 0.05  # chance of accepting a candidate that is not better
    margin: float = 0.01  # the candidate must beat the incumbent's p95 by this fraction
    bootstrap: int = 2000
    block: int = 8  # bootstrap block (consecutive arrivals): bursts queue together
    # The bootstrap sees the noise inside a window, not a burst that lands in one window: the
    # test adds the variance between windows that the last `spread_history` evaluations showed
    # beyond what the bootstrap predicted for them (0: none, the bootstrap alone).
    spread_history: int = 20
    e2e_margin: float = 0.05
    max_error_increase: float = 0.02  # absolute error-rate increase a candidate may bring
    monitor_samples: int = 200  # window size once converged
    drift: float = 0.2  # converged, live p95 moved by more than this fraction ...
    drift_windows: int = 3  # ... in this many monitor windows in a row: search again
    restart_sigma: float = 0.5
    rollback: float = 0.2  # re-measured new incumbent worse than the old one was by this: undo
    calibrate: bool = True
    model_step: bool = True  # also propose the weights a fit of TTFT to the cost terms implies
    model_min_samples: int = 40
    model_retry: float = 0.5  # log distance the fit must move before it is proposed again
    model_pairs: int = 4  # an inconclusive but promising fitted candidate runs up to this many
    # At the start, fitted weights that predict TTFT better than the start weights (out of
    # sample, at `fpr`) become the incumbent, and the start weights must win them back.
    model_start: bool = True
    model_start_samples: int = 120  # and the first evaluation waits for this many to decide it
    model_start_factor: float = 10.0  # only a start with a weight off by more than this factor
    rate_change: float = 0.05  # publish a calibrated prefill rate only if it moved this much
    history: int = 500  # evaluation records kept in the state file
    policy: str = "gorgo"  # only requests this policy routed depend on the weights
    max_source_share: float = 0.5  # of a window's samples that one export may supply
    # What is minimised (the fleet's `objective`): p95 TTFT, p95 E2E, or the share of requests
    # missing the fleet's TTFT target `slo_ttft_ms` (slo); the search space is its weights.
    objective: str = TTFT
    slo_ttft_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.objective in OBJECTIVES:  # else validate() names it
            object.__setattr__(self, "bounds", normalize_bounds(self.bounds, self.keys))

    @property
    def keys(self) -> tuple[str, ...]:
        """The weights searched: those the objective counts, in registry order."""
        return weight_keys(self.objective)

    @property
    def needs_end(self) -> bool:
        """Whether a request counts only once its stream ended (its E2E is the score); TTFT and
        the SLO's TTFT target are scored on the early samples of the TTFT log."""
        return self.objective == E2E

    def search_bounds(self) -> Bounds:
        """The configured bounds intersected with the contract's, per weight key: what the
        routers would accept is the most the search may propose."""
        out = {}
        for k, (lo, hi) in self.bounds.items():
            clo, chi = WEIGHT_BOUNDS[k]
            out[k] = (max(lo, clo), min(hi, chi))
        return out

    def validate(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"optimizer: objective: must be one of {', '.join(OBJECTIVES)}, "
                             f"got {self.objective!r}")
        if self.objective == SLO and not self.slo_ttft_ms > 0:
            raise ValueError("optimizer: slo_ttft_ms: the slo objective needs a TTFT target > 0 "
                             "(the fleet's slo.ttft_ms)")
        for k, (lo, hi) in self.bounds.items():
            if not 0 < lo < hi:
                raise ValueError(f"optimizer: bounds.{k}: need 0 < low < high")
        for k, (lo, hi) in self.search_bounds().items():
            if not lo < hi:
                raise ValueError(f"optimizer: bounds.{k}: {list(self.bounds[k])} does not overlap "
                                 f"the routers' {list(WEIGHT_BOUNDS[k])}")
        checks = [
            (0 < self.min_sigma < self.initial_sigma <= self.max_sigma,
             "need 0 < min_sigma < initial_sigma <= max_sigma"),
            (0 < self.restart_sigma <= self.max_sigma, "need 0 < restart_sigma <= max_sigma"),
            (self.step_up > 1, "step_up must be > 1"),
            (0 < self.success_rate < 1, "success_rate must be in (0, 1)"),
            (self.max_failures >= 1, "max_failures must be >= 1"),
            (self.window_samples >= 5, "window_samples must be >= 5"),
            (self.min_window_s >= 0, "min_window_s must be >= 0"),
            (self.census_timeout_s > 0, "census_timeout_s must be > 0"),
            (self.block >= 1, "block must be >= 1"),
            (self.spread_history >= 0, "spread_history must be >= 0"),
            (self.model_min_samples >= 10, "model_min_samples must be >= 10"),
            (self.model_retry > 0, "model_retry must be > 0"),
            (self.model_start_factor > 1, "model_start_factor must be > 1"),
            (10 <= self.model_start_samples <= FIT_WINDOW,
             f"model_start_samples must be in [10, {FIT_WINDOW}] (the fit's window)"),
            (self.model_pairs >= self.pairs, "model_pairs must be >= pairs"),
            (self.pairs >= 1, "pairs must be >= 1"),
            (0 < self.quantile < 1, "quantile must be in (0, 1)"),
            (0 < self.fpr < 0.5, "fpr must be in (0, 0.5)"),
            (self.margin >= 0, "margin must be >= 0"),
            (self.bootstrap >= 100, "bootstrap must be >= 100"),
            (self.e2e_margin >= 0, "e2e_margin must be >= 0"),
            (0 <= self.max_error_increase <= 1, "max_error_increase must be in [0, 1]"),
            (self.monitor_samples >= 5, "monitor_samples must be >= 5"),
            (self.drift > 0, "drift must be > 0"),
            (self.drift_windows >= 1, "drift_windows must be >= 1"),
            (self.rollback > 0, "rollback must be > 0"),
            (self.rate_change >= 0, "rate_change must be >= 0"),
            (self.history >= 0, "history must be >= 0"),
            (bool(self.policy), "policy must be a policy name"),
            (0 < self.max_source_share <= 1, "max_source_share must be in (0, 1]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"optimizer: {message}")


@dataclass(frozen=True, slots=True)
class Proposal:
    """Weights (with their version) and prefill rates that should be live on every router."""

    weights: Weights
    prefill_rate: dict[str, float]
    arm: str
    keys: tuple[str, ...] = KEYS  # the searched weights (OptimizerConfig.keys)

    @property
    def point(self) -> Point:
        """The searched weights of the proposal; the others stay at their defaults."""
        return {k: self.weights[k] for k in self.keys}

    def body(self) -> dict[str, Any]:
        """The JSON body of the router's PUT /admin/weights: only the searched weights, so a
        weight the tuner does not tune keeps whatever the router has."""
        out: dict[str, Any] = {**self.point, "version": self.weights.version}
        if self.prefill_rate:
            out["prefill_rate"] = dict(self.prefill_rate)
        return out


@dataclass(slots=True)
class Window:
    """Every request routed under one weights version (two, if it was renumbered).

    A window is scored on all the requests it routed, not on the first ones to complete: those
    are the fast ones, and a window closed on completions is scored on its fastest requests.
    """

    arm: str
    version: int
    opened_at: float
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    arrival: list[float] = field(default_factory=list)  # s, to keep bursts together
    errors: int = 0
    routed_by: dict[int, int] = field(default_factory=dict)  # version -> decisions routers report
    closed_at: float | None = None  # when it stopped routing
    sources: Counter[int] = field(default_factory=Counter)  # samples received per export
    needs_end: bool = False  # a request counts once its E2E is in (the e2e objective)
    e2e_arrival: list[float] = field(default_factory=list)  # of the E2E values, as ``arrival``
    failed: set[str] = field(default_factory=set)  # decisions counted among ``errors``

    def add(self, s: Sample) -> None:
        """A decision's first sample: its TTFT (an early one: the stream is still open), and its
        E2E too unless early (`end` adds it then)."""
        if s.source is not None and not (self.needs_end and s.ok):  # (else counted at `end`)
            self.sources[s.source] += 1
        if s.ok:
            self.ttft.append(s.ttft_ms)
            if s.arrival_s > 0:  # 0: the start is unknown; arrival order is lost
                self.arrival.append(s.arrival_s)
            if not s.early:
                self.end(s)
        else:
            self.errors += 1
            self.failed.add(s.decision_id)

    def end(self, s: Sample) -> None:
        """The E2E of a decision whose TTFT this window already holds (or holds now). A stream
        that failed after its first byte is an error where the objective scores the whole
        request (else it would be neither scored nor an error: missing, then left out), as is
        one cut with a 2xx status (`Sample.cut`)."""
        scored = False
        if s.ok and not s.cut:
            self.e2e.append(s.e2e_ms)
            if s.arrival_s > 0:
                self.e2e_arrival.append(s.arrival_s)
            scored = True
        elif self.needs_end and s.decision_id not in self.failed:  # once per request
            self.errors += 1
            self.failed.add(s.decision_id)
            scored = True
        # Where the E2E is scored, the export that carried it is the one whose word counts
        # (`dominated`), not that of the request's early TTFT record.
        if self.needs_end and scored and s.source is not None:
            self.sources[s.source] += 1

    @property
    def n(self) -> int:
        """Requests scored so far: with a TTFT (with an E2E, if the objective needs one)."""
        return len(self.e2e) if self.needs_end else len(self.ttft)

    @property
    def received(self) -> int:
        return self.n + self.errors

    @property
    def routed(self) -> int:
        """Decisions made under this window; without a report from the routers, what arrived."""
        return max(sum(self.routed_by.values()), self.received)

    def dominated(self, share: float) -> bool:
        """One export supplied more than ``share`` of what this window received: its score would
        be that one sender's word."""
        return bool(self.sources) and max(self.sources.values()) > share * self.received

    @property
    def missing(self) -> int:
        return self.routed - self.received

    def complete(self, now: float, timeout_s: float) -> bool:
        """Closed, and every request it routed reported back (or it waited long enough)."""
        return self.closed_at is not None and (
            self.missing == 0 or now - self.closed_at >= timeout_s)

    def values(self, attr: str, fill: float | None) -> np.ndarray:
        """Values in arrival order; each missing request appended as ``fill`` (None: left out)."""
        v = np.asarray(getattr(self, attr), dtype=float)
        arrival = self.e2e_arrival if attr == "e2e" else self.arrival
        if len(arrival) == v.size:
            v = v[np.argsort(np.asarray(arrival), kind="stable")]
        if fill is not None and self.missing:
            v = np.concatenate([v, np.full(self.missing, fill)])
        return v


@dataclass(slots=True)
class Evaluation:
    """One incumbent-vs-candidate comparison: its windows in the order of ``plan``."""

    incumbent: Point
    plan: list[str]
    windows: list[Window] = field(default_factory=list)
    candidate: Point | None = None  # drawn when its first window opens
    kind: str = STEP
    looked_at: tuple[int, int, bool] | None = None  # (received, routed, final) at the last look
    epoch: int = 0  # the rate hints it routes under (`Tuner.follow`)

    def arm(self, arm: str) -> list[Window]:
        return [w for w in self.windows if w.arm == arm]


@dataclass(frozen=True, slots=True)
class Verdict:
    accepted: bool
    reason: str  # better | not_better | e2e_worse | more_errors | no_samples
    p95_incumbent: float
    p95_candidate: float
    diff_upper_ms: float  # the upper (1 - fpr) bound, as p95_c - p95_i in ms
    margin_ms: float
    e2e_incumbent: float
    e2e_candidate: float
    errors_incumbent: float
    errors_candidate: float
    n_incumbent: int
    n_candidate: int


def window_plan(pairs: int, rng: np.random.Generator | None, after: int = 0) -> list[str]:
    """``pairs`` incumbent and ``pairs`` candidate windows in an order drawn uniformly from all
    such orders. The test learns its between-window noise from how far each arm's windows fall
    apart, per lag, and only an order drawn at random makes that the noise of the arms'
    difference whatever the load does. A fixed ABBA order cancels a linear trend but not load
    that swings over 3-4 windows, where its arms' difference varies more than their windows do
    (A/A accepts of 8-16 %), and traffic whose period is one evaluation put the candidate on the
    light phase every time (78 % accepted; docs/tuner.md, "A plan drawn at random").

    ``rng`` None: the ABBA order (I C, C I, ... from pair ``after`` on), for an evaluation that
    has no noise learnt from evaluations to weigh its order by: its test is then the
    bootstrap's (and the warm-up's), which sees no trend, and ABBA is the order a trend cannot
    side with (a fleet filling up from empty lit the first windows: drawn, the first evaluation
    of Azure A/A runs under `e2e` was accepted in 8 of 12)."""
    if rng is None:
        return [arm for k in range(after, after + pairs)
                for arm in ((INCUMBENT, CANDIDATE) if k % 2 == 0 else (CANDIDATE, INCUMBENT))]
    plan = [CANDIDATE] * pairs + [INCUMBENT] * pairs
    return [plan[i] for i in rng.permutation(len(plan))]


def _error_rate(windows: Sequence[Window], missing: bool | None = None) -> float:
    """The arm's share of failed requests; one still missing is left out (None), or counted as
    an error (True) or a success (False)."""
    errors = sum(w.errors for w in windows)
    total = errors + sum(w.n for w in windows)
    if missing is not None:
        out = sum(w.missing for w in windows)
        total += out
        errors += out if missing else 0
    return errors / total if total else 0.0


def score_values(w: Window, cfg: OptimizerConfig, fill: float | None) -> np.ndarray:
    """What the objective scores of each request of ``w``, in arrival order (a request still
    missing as ``fill``, a latency in ms; None: left out): its TTFT, its E2E, or (slo) 1 where it
    missed the TTFT target and 0 where it met it."""
    if cfg.objective == E2E:
        return w.values("e2e", fill)
    v = w.values("ttft", fill)
    return (v > cfg.slo_ttft_ms).astype(float) if cfg.objective == SLO else v


def statistic(v: np.ndarray, cfg: OptimizerConfig) -> float:
    """The objective's score of some requests' values (lower is better): the p95 of a latency,
    the miss rate of the SLO."""
    return float(np.mean(v)) if cfg.objective == SLO else float(np.quantile(v, cfg.quantile))


def _bootstrap_quantile(
    parts: Sequence[np.ndarray], q: float | None, reps: int, block: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """Quantile of ``reps`` resamples; each window is resampled within itself (stratified) in
    circular blocks of consecutive arrivals, so a burst that queued together stays together and
    widens the interval instead of passing for independent evidence."""
    cols = []
    for v in parts:
        if v.size:
            cols.append(v[block_indices(v.size, block, reps, rng)])
    rows = np.concatenate(cols, axis=1)
    return rows.mean(axis=1) if q is None else _row_quantile(rows, q)


def _row_quantile(a: np.ndarray, q: float) -> np.ndarray:
    """np.quantile(a, q, axis=1) with linear interpolation, by one sort (several times faster)."""
    s = np.sort(a, axis=1)
    h = (a.shape[1] - 1) * q
    lo = math.floor(h)
    hi = min(lo + 1, a.shape[1] - 1)
    return s[:, lo] + (s[:, hi] - s[:, lo]) * (h - lo)


# (between, within, df, lag) of the windows of one arm ``lag`` windows apart, summed over the
# arms of one evaluation (`evaluation_spread`); lag 0: any (a state written before lags were kept)
Spread = tuple[float, float, float, int]
Positioned = Sequence[tuple[int, np.ndarray]]  # an arm's windows: (place in the evaluation, values)


def evaluation_spread(arms: Sequence[Positioned], cfg: OptimizerConfig,
                      rng: np.random.Generator) -> tuple[Spread, ...]:
    """How far apart the scores of an arm's windows fell, per lag (how many windows apart they
    ran): ``between``, half their squared difference; ``within``, what the within-window
    bootstrap says it should be (the mean of the two windows' bootstrap variances; equal to
    ``between`` on average if the bootstrap saw all the noise); and the degrees of freedom. The
    pairs of an arm of ``m`` windows count 2 / m each, so that summed over the lags an arm gives
    its deviations from its mean, ``(m - 1)`` bootstrap variances and ``m - 1`` degrees of
    freedom. Per lag because load that trends or swings moves windows further apart the further
    apart they ran, and the arms' difference weighs each lag by its plan (`compare`). A latency
    on log scores, so calm and loaded stretches of the trace pool on one scale (an arm with a
    score of 0 says nothing); the SLO's miss rate on its own linear scale, where a window that
    missed nothing is a score like any other (on the log scale one such resample, nearly always
    there at a 5-10 % miss rate, left the noise unlearnt: A/A accepts of 12.6 % on bursty
    traffic)."""
    slo = cfg.objective == SLO
    bq = None if slo else cfg.quantile
    by_lag: dict[int, list[float]] = {}
    for arm in arms:
        arm = [(pos, v) for pos, v in arm if v.size >= 2]
        if len(arm) < 2:
            continue
        x = np.array([statistic(v, cfg) for _, v in arm])
        reps = [_bootstrap_quantile([v], bq, cfg.bootstrap, cfg.block, rng) for _, v in arm]
        if not slo:
            if not (x > 0).all() or not all((r > 0).all() for r in reps):
                continue
            x, reps = np.log(x), [np.log(r) for r in reps]
        var = [float(np.var(r)) for r in reps]
        weight = 2.0 / len(arm)
        for j in range(len(arm)):
            for k in range(j + 1, len(arm)):
                acc = by_lag.setdefault(abs(arm[k][0] - arm[j][0]), [0.0, 0.0, 0.0])
                acc[0] += weight * (x[j] - x[k]) ** 2 / 2.0
                acc[1] += weight * (var[j] + var[k]) / 2.0
                acc[2] += weight
    return tuple((b, w, d, lag) for lag, (b, w, d) in sorted(by_lag.items()))


# Lag -> (variance a window's score adds between windows that far apart, its df), and 0 -> the
# same pooled over every lag; a latency's on the log scale, a miss rate's on its own
Noise = Mapping[int, tuple[float, float]]


LAG_PRIOR_DF = 2.0  # a lag's noise starts as the pooled noise, worth this many df (`window_noise`)


def window_noise(spreads: Iterable[Spread]) -> Noise:
    """The variance of a window's score that the bootstrap inside the windows does not see (a
    burst, a calm stretch, a trend), learnt from past evaluations: their windows' observed
    spread less what the bootstrap predicted, per degree of freedom, never below 0; pooled over
    every lag (key 0), and per lag, where a lag seen in few pairs leans on the pooled figure (as
    if it had LAG_PRIOR_DF degrees of freedom of it: a lag learnt from one pair would otherwise
    carry a t quantile in the thousands), its df at most the pooled df."""
    sums: dict[int, list[float]] = {}
    for b, w, d, lag in spreads:
        for key in {0, lag}:
            acc = sums.setdefault(key, [0.0, 0.0])
            acc[0] += b - w
            acc[1] += d
    pooled = sums.get(0)
    if pooled is None or not pooled[1] > 0:
        return {}
    g0 = max(pooled[0] / pooled[1], 0.0)
    noise: dict[int, tuple[float, float]] = {0: (g0, pooled[1])}
    for lag, (excess, df) in sums.items():
        if lag:
            noise[lag] = (max((excess + LAG_PRIOR_DF * g0) / (df + LAG_PRIOR_DF), 0.0),
                          min(df + LAG_PRIOR_DF, pooled[1]))
    return noise


_TINY_MS = 1e-3  # the floor of a window's p95 on the log scale (a window of stand-ins of 0 ms)


def _arm_replicates(parts: Sequence[np.ndarray], cfg: OptimizerConfig,
                    rng: np.random.Generator) -> np.ndarray:
    """Bootstrap replicates of an arm's score, on the scale the test compares arms.

    A latency: the mean of its windows' log p95s, each window resampled within itself. That is
    the scale the window noise is learnt on (`evaluation_spread`), where an arm's variance is a
    window's divided by their number. The p95 of the arm's pooled requests is not: it moves with
    the arm's slowest window (in A/A runs its variance was 1.04-1.56x the mean's), so a burst
    that filled one window passed for evidence. The SLO's miss rate: the pooled rate (a window
    may miss nothing, and log 0 is no score)."""
    if cfg.objective == SLO:
        return _bootstrap_quantile(parts, None, cfg.bootstrap, cfg.block, rng)
    return np.mean([np.log(np.maximum(
        _bootstrap_quantile([v], cfg.quantile, cfg.bootstrap, cfg.block, rng), _TINY_MS))
        for v in parts], axis=0)


def compare(
    incumbent: Sequence[Window],
    candidate: Sequence[Window],
    cfg: OptimizerConfig,
    rng: np.random.Generator,
    *,
    fill: tuple[float | None, float | None] | None = None,
    noise: Noise | None = None,
    missing_failed: bool = False,
    positions: tuple[Sequence[int], Sequence[int]] | None = None,
) -> Verdict:
    """Accept the candidate only if it is better beyond the noise and breaks no guard.

    ``fill`` (incumbent, candidate) stands in for requests a window routed that have not reported
    back yet; None leaves them out. ``missing_failed`` counts them in the error guard too, the
    candidate's as errors and the incumbent's as successes (the early look's worst case). Each
    arm is scored as `_arm_replicates` says (for a latency, the mean of its windows' log p95s).
    The difference's variance is the bootstrap's (inside the
    windows, read off its upper quantile) plus what ``noise`` (`window_noise`, on the test's
    scale) adds to the difference of the arms' means: for windows at ``positions`` (each arm's
    places in the evaluation), each pair's share at the noise of its lag (`between_windows`);
    without them, a window's pooled noise divided among each arm's windows. The bound is
    Student's t quantile on the sum's effective degrees of freedom (Satterthwaite's: the noise
    is an estimate). The verdict reports that bound in ms, as a difference from the incumbent's
    p95.
    """
    fi, fc = fill if fill is not None else (None, None)
    pi, pc = positions if positions is not None else (range(len(incumbent)),
                                                       range(len(candidate)))
    ti_pos = [(p, v) for p, v in zip(pi, (score_values(w, cfg, fi) for w in incumbent),
                                     strict=True) if v.size]
    tc_pos = [(p, v) for p, v in zip(pc, (score_values(w, cfg, fc) for w in candidate),
                                     strict=True) if v.size]
    ti_parts, tc_parts = [v for _, v in ti_pos], [v for _, v in tc_pos]
    ti, tc = _concat(ti_parts), _concat(tc_parts)
    ei = _concat([w.values("e2e", fi) for w in incumbent])
    ec = _concat([w.values("e2e", fc) for w in candidate])
    erri = _error_rate(incumbent, False if missing_failed else None)
    errc = _error_rate(candidate, True if missing_failed else None)
    if ti.size == 0 or tc.size == 0:
        nan = float("nan")
        return Verdict(False, "no_samples", nan, nan, nan, nan, nan, nan, erri, errc,
                       int(ti.size), int(tc.size))
    q = cfg.quantile
    p95_i, p95_c = statistic(ti, cfg), statistic(tc, cfg)
    e2e_i, e2e_c = _quantile_or_nan(ei, q), _quantile_or_nan(ec, q)
    reps_i = _arm_replicates(ti_parts, cfg, rng)
    diff = _arm_replicates(tc_parts, cfg, rng) - reps_i
    # The margin scales with what the incumbent measured, never with a filled-in stand-in: the
    # test must only get easier to pass as the incumbent's unknown requests get slower.
    known = ti if fi is None else _concat([score_values(w, cfg, None) for w in incumbent])
    scale = statistic(known, cfg) if known.size else 0.0
    margin = cfg.margin * scale
    # The bootstrap's spread read off its own quantiles (a few resamples full of stand-ins for
    # missing requests must not blow it up); with no noise learnt, the bound is that quantile.
    center = float(np.median(diff))
    z = _t_quantile(1.0 - cfg.fpr, math.inf)
    inside = (float(np.quantile(diff, 1.0 - cfg.fpr)) - center) / z
    if cfg.objective == SLO:
        # At least a binomial rate's variance, each arm's rate smoothed by one miss and one hit:
        # a resample of rare misses is narrow, and an arm that missed nothing had none at all
        # (A/A accepts of 6.9 % at a 5 % miss rate, 16 of 22 where the candidate missed none).
        floor = sum(r * (1.0 - r) / v.size for r, v in (
            ((float(v.sum()) + 1.0) / (v.size + 2.0), v) for v in (ti, tc)))
        inside = max(inside, math.sqrt(floor))
    outside, spread = between_windows(
        [p for p, _ in ti_pos] if positions is not None else None,
        [p for p, _ in tc_pos] if positions is not None else None,
        len(ti_parts), len(tc_parts), noise or {})
    var = inside**2 + outside
    # Only the noise term is an estimate: Satterthwaite's effective df for the sum (the
    # bootstrap's part counts as known), so no noise learnt means normal.
    eff = max(var**2 / spread, 1.0) if spread > 0 else math.inf
    upper = center + _t_quantile(1.0 - cfg.fpr, eff) * math.sqrt(var)
    if cfg.objective != SLO:  # a bound on the log ratio, in ms off the incumbent's p95
        upper = scale * math.expm1(upper) if scale > 0 else math.inf
    if not upper < -margin:
        reason = "not_better"
    elif e2e_c > e2e_i * (1.0 + cfg.e2e_margin):  # NaN (no stream of an arm ended): no guard
        reason = "e2e_worse"
    elif errc - erri > cfg.max_error_increase:
        reason = "more_errors"
    else:
        reason = "better"
    return Verdict(reason == "better", reason, p95_i, p95_c, upper, margin, e2e_i, e2e_c,
                   erri, errc, int(ti.size), int(tc.size))


def between_windows(at_i: Sequence[int] | None, at_c: Sequence[int] | None, n_i: int, n_c: int,
                    noise: Noise) -> tuple[float, float]:
    """What the noise between windows adds to the variance of the difference of the arms' mean
    scores, and the sum of its parts' squares over their degrees of freedom (Satterthwaite's
    denominator). The difference is a contrast of the windows (+1 / n_c per candidate window,
    -1 / n_i per incumbent one), so its variance is minus the sum over pairs of windows of
    twice their weights' product times the noise at their lag (where no lag was learnt, or no
    places are given: the pooled noise). A plan whose arms alternate against a trend is then
    charged little, one that runs an arm's windows back to back much (docs/tuner.md, "A plan
    drawn at random"). Never below 0 (lags learnt with little data can disagree)."""
    if 0 not in noise:
        return 0.0, 0.0
    if at_i is None or at_c is None:
        pooled, df = noise[0]
        total = pooled * (1.0 / n_i + 1.0 / n_c)
        return (total, total * total / df) if total > 0 else (0.0, 0.0)
    places = [(p, -1.0 / n_i) for p in at_i] + [(p, 1.0 / n_c) for p in at_c]
    coef: dict[int, float] = {}
    for j, (pj, cj) in enumerate(places):
        for pk, ck in places[j + 1:]:
            lag = abs(pj - pk)
            key = lag if lag in noise else 0
            coef[key] = coef.get(key, 0.0) - 2.0 * cj * ck
    parts = [(a * noise[key][0], noise[key][1]) for key, a in coef.items()]
    total = sum(v for v, _ in parts)
    if not total > 0:
        return 0.0, 0.0
    return total, sum(v * v / df for v, df in parts)


def _t_quantile(q: float, df: float) -> float:
    """Student's t quantile on ``df`` degrees of freedom (inf: the normal one). scipy is
    imported here, not at the top: the tuner needs it for this one number."""
    from scipy.stats import norm, t

    return float(norm.ppf(q) if math.isinf(df) else t.ppf(q, df))


def decide(ev: Evaluation, cfg: OptimizerConfig, rng: np.random.Generator,
           final: bool, noise: Noise | None = None) -> Verdict | None:
    """The verdict once every routed request reported back, or earlier if it is an acceptance
    that no outcome of the missing requests could undo.

    The final verdict fills the candidate's requests still missing past the census timeout in
    as slow as the timeout, and leaves the incumbent's out. The early look fills the
    incumbent's missing requests in as instantly fast successes and the candidate's as never
    finishing and as errors: if the candidate still wins and passes the guards, it wins. Left
    out of the error guard, a candidate with 1 error and 1 request out of 80 was accepted at
    1.27 % errors where, had that one failed, the verdict was more_errors at 2.5 % (a few
    requests that never finish lie beyond a p95, and under `slo` are a miss each, so the
    latency test alone let it through). A clear improvement is
    thus taken without waiting for the slowest stream of the evaluation; anything closer, and
    every rejection, waits for all of it. Such a verdict's incumbent score is inf (unknown)
    where the missing requests could still raise it.
    """
    inc, cand = ev.arm(INCUMBENT), ev.arm(CANDIDATE)
    positions = ([k for k, w in enumerate(ev.windows) if w.arm == INCUMBENT],
                 [k for k, w in enumerate(ev.windows) if w.arm == CANDIDATE])
    if final:
        # Still missing past the census timeout: the slowest requests (each out that long), or
        # samples lost on the way. Left out, the candidate was scored on its survivors (one
        # whose slowest tenth stalled for 450 s was accepted as 0.8-0.9x an incumbent of 68 s);
        # its are now that slow, the incumbent's still left out: only an acceptance pays for
        # what is unknown (scored so in both arms, a 5 % loss of samples put both p95s at the
        # stand-in, and nothing could be accepted).
        out_ms = cfg.census_timeout_s * 1000.0
        fill = (None, out_ms) if any(w.missing for w in cand) else None
        return compare(inc, cand, cfg, rng, fill=fill, noise=noise, positions=positions)
    worst = compare(inc, cand, cfg, rng, fill=(0.0, UNFINISHED_MS), noise=noise,
                    missing_failed=True, positions=positions)
    if not worst.accepted:
        return None
    # The incumbent's score with its missing requests at 0 ms understates it: kept as the
    # probation baseline, a 24x better candidate re-measured 2.5x slower was rolled back to the
    # far worse weights. Unless the missing requests cannot move it, it is unknown (inf).
    slowest = statistic(_concat([score_values(w, cfg, UNFINISHED_MS) for w in inc]), cfg)
    if slowest != worst.p95_incumbent:
        worst = replace(worst, p95_incumbent=math.inf)
    return worst


def hints_moved(old: Mapping[str, float], new: Mapping[str, float]) -> bool:
    """A replica's fleet-file rate changed (one that appears or goes is membership, not this)."""
    return any(k in old and old[k] != v for k, v in new.items())


def _quantile_or_nan(v: np.ndarray, q: float) -> float:
    """An arm's E2E p95; NaN while none of its streams has ended (early TTFT samples only)."""
    return float(np.quantile(v, q)) if v.size else math.nan


def _concat(parts: Sequence[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.empty(0)


def _reflect(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    span = hi - lo
    t = np.mod(x - lo, 2.0 * span)
    return lo + np.where(t <= span, t, 2.0 * span - t)


def _finite_or_none(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def _vec(p: Mapping[str, float], keys: Sequence[str]) -> np.ndarray:
    """A point as a vector, in ``keys`` order."""
    return np.array([p[k] for k in keys], dtype=float)


def _from_vec(x: Sequence[float] | np.ndarray, keys: Sequence[str]) -> Point:
    return {k: float(v) for k, v in zip(keys, x, strict=True)}


class VersionsExhausted(UserError):
    """No weights version is left to publish above what a router holds."""


def _exhausted(floor: int) -> VersionsExhausted:
    return VersionsExhausted(
        f"weights version {floor} is held or issued, and no newer one fits in int64: set the "
        "routers' weights again with a lower version (PUT /admin/weights) and restart the "
        "tuner")


class Tuner:
    """The (1+1)-ES state machine; see the module docstring."""

    def __init__(
        self,
        config: OptimizerConfig,
        initial: Mapping[str, float] | None = None,
        *,
        seed: int = 0,
        calibration: CalibrationConfig | None = None,
        next_version: int = 1,
        hints: dict[str, float] | None = None,
    ) -> None:
        config.validate()
        self.cfg = config
        self.rng = np.random.default_rng(seed)
        # The windows' order (`window_plan`) draws from a stream of its own, so the search's
        # candidates and bootstraps are the same draws whatever order the windows ran in.
        self.order_rng = np.random.default_rng([seed, 1])
        # hints: the fleet file's prefill rates (GET /admin/weights "prefill_rate_hint")
        self.calibrator = PrefillCalibrator(calibration, hints) if config.calibrate else None
        self.hints = dict(hints or {})
        # Bumped when a hint moves (`follow`); an evaluation or monitor window of an older one
        # routed under another cost model.
        self._hint_epoch = self._monitor_epoch = 0
        self.bounds = config.search_bounds()
        self.keys = config.keys
        # initial: weight key -> factor; a weight it does not name starts at the term's default
        self.incumbent: Point = self._clip(initial or {})
        self.incumbent_p95: float | None = None
        self.last_good: Point | None = None  # set while the incumbent is on probation
        self.last_good_p95: float | None = None
        self.sigma = config.initial_sigma
        self.failures = 0
        self.evaluations = 0
        self.accepted = 0
        self.phase = EVALUATING
        self.baseline_p95: float | None = None  # converged: the p95 that drift is measured from
        self.next_version = max(1, int(next_version))
        self.rates: dict[str, float] = {}
        self.history: list[dict[str, Any]] = []
        self.revision = 0  # bumped by every change worth persisting
        self.active: Proposal | None = None
        self.ignored = 0  # samples of a version that belongs to no current window
        self.other_policy = 0  # samples routed by a policy the weights do not steer
        self.fit = WeightFit(min_samples=config.model_min_samples) if config.model_step else None
        self.model_tried: Point | None = None
        self.seen = 0  # samples observed by this process
        self._windows: dict[int, Window] = {}  # version -> window still to be scored
        self._eval: Evaluation | None = None  # the evaluation routing now
        self._pending: list[Evaluation] = []  # routed, waiting for their requests to report
        self._open: Window | None = None  # routing now (None: a bridge or nothing is live)
        self._drift_run = 0  # monitor windows in a row beyond the drift threshold (signed)
        # Converged (`_start_monitor`): since when the incumbent is live, the longest request its
        # monitor windows saw, and how long it had been live when the baseline's window opened.
        self._monitor_since, self._longest_ms, self._baseline_age_ms = 0.0, 0.0, math.inf
        # Per evaluation, of the last `spread_history` scored: its windows' spread per lag
        self.spreads: list[tuple[Spread, ...]] = []
        # The warm-up's requests, until the first evaluation is scored: its window noise
        # (`_warmup_spread`) is that evaluation's, which has no scored one before it to learn from.
        self._warmup: Window | None = None
        self._warmup_memo: tuple[int, tuple[Spread, ...]] = (-1, ())

    # --- inputs -------------------------------------------------------------------------------

    def observe(self, s: Sample) -> None:
        self.seen += 1
        # The residuals do not depend on who chose the replica: every request calibrates, but
        # for one Envoy retried (served elsewhere than its terms and replica say).
        if self.calibrator is not None and not s.retried:
            self.calibrator.observe(s)
        if self.fit is not None and not s.retried:
            self.fit.observe(s)
        if s.policy != self.cfg.policy:
            self.other_policy += 1
            return
        w = self._windows.get(s.weights_version)
        if w is None:
            self.ignored += 1
            return
        w.add(s)

    def observe_end(self, s: Sample) -> None:
        """The span that ends a decision `observe` already had the early TTFT of: its E2E, for
        the window that holds the TTFT (calibration and the weight fit had the request then)."""
        if s.policy != self.cfg.policy:
            return
        w = self._windows.get(s.weights_version)
        if w is not None:
            w.end(s)

    def follow(self, replicas: Collection[str], hints: Mapping[str, float], *,
               moved: bool = False) -> None:
        """The replicas the routers know and their fleet-file rates: a calibrated rate, and the
        calibration rows, of a replica no router knows any more are forgotten, and so is its
        rate in the live proposal (what /status shows and a restarted router is sent).

        A hint that moved (a fleet reload; ``moved``: the caller saw one move on some router) is
        a new cost model from the next `next_weights` on: the evaluation routing now is run
        again (`_rerun`), converged the monitor's baseline starts over."""
        moved = moved or hints_moved(self.hints, hints)
        self.hints = dict(hints)
        kept = {k: v for k, v in self.rates.items() if k in replicas}
        before = dict(kept)
        if self.calibrator is not None:
            self.calibrator.follow(replicas, hints)
            # A rate calibrated under an old hint is held to the new one's bounds: kept as it
            # was, 2000 tokens/s still priced an engine hinted (and measured) at 50000 after
            # 1000 requests. Clamped, not dropped: a router keeps a rate it is not sent.
            for k, v in kept.items():
                lo, hi = self.calibrator.rate_bounds(k)
                kept[k] = min(max(v, lo), hi)
        if moved or kept != before:
            self._hint_epoch += 1
        if kept != self.rates:
            self.rates = kept
            self.revision += 1
        a = self.active
        if a is not None and set(a.prefill_rate) - set(replicas):
            self.active = Proposal(a.weights, {k: v for k, v in a.prefill_rate.items()
                                               if k in replicas}, a.arm, a.keys)

    def counting(self) -> list[int]:
        """Versions whose decision counts (`routed`) the caller should report."""
        return [v for v, w in self._windows.items() if w.arm not in (MONITOR, WARMUP)]

    def routed(self, version: int, decisions: int) -> None:
        """The routers made ``decisions`` with the tuned policy under ``version`` so far."""
        w = self._windows.get(version)
        if w is not None:
            w.routed_by[version] = max(w.routed_by.get(version, 0), int(decisions))

    def next_weights(self, now: float) -> Proposal | None:
        """New weights to publish now, or None while the live ones stand; VersionsExhausted,
        with nothing changed, once no version is left to issue."""
        if self.next_version >= VERSION_MAX:
            raise _exhausted(self.next_version - 1)
        if self.active is None:
            if self.phase == CONVERGED:
                return self._start_monitor(now)
            return self._start_warmup(now) if self._warming_up() else self._start_eval(now)
        if self.phase == CONVERGED:
            if self._monitor_epoch != self._hint_epoch:
                return self._start_monitor(now)
            return self._monitor(now)
        if self._eval is not None and self._eval.epoch != self._hint_epoch:
            return self._rerun(now)
        proposal = self._decide_pending(now)
        if proposal is not None:
            return proposal
        w, ev = self._open, self._eval
        if w is None or ev is None:  # a bridge: the incumbent holds, unscored
            return None if self._pending or self._warming_up() else self._start_eval(now)
        if w.routed < self.cfg.window_samples or now - w.opened_at < self.cfg.min_window_s:
            return None
        w.closed_at = now
        if len(ev.windows) < len(ev.plan):
            return self._open_window(ev.plan[len(ev.windows)], now)
        self._pending.append(ev)
        self._eval = None
        proposal = self._decide_pending(now)
        if proposal is not None:
            return proposal
        # While its slowest requests finish, the next evaluation already routes (its incumbent
        # windows stay valid unless the verdict changes the incumbent); one at a time.
        return self._bridge(now) if len(self._pending) > 1 else self._start_eval(now)

    def ensure_version_above(self, floor: int) -> None:
        """Never issue a version <= ``floor`` (a router already holds it); VersionsExhausted
        when none is left above it (the tuner issued versions past int64, then refused its own
        state file at the next start)."""
        if floor >= VERSION_MAX - 1:
            raise _exhausted(floor)
        if floor >= self.next_version:
            self.next_version = floor + 1
            self.revision += 1

    def renumber(self, floor: int) -> Proposal | None:
        """Re-issue the active proposal with a version above ``floor``; samples of either count."""
        self.ensure_version_above(floor)
        if self.active is None:
            return None
        old, v = self.active.weights.version, self._take_version()
        # the window its samples land in: an evaluation's, or the warm-up's (a bridge's; lost
        # here once, and the first evaluation went without its noise estimate)
        window = self._open
        if window is None and self._warmup is not None and self._warmup.version == old:
            window = self._warmup
        if window is not None:
            self._windows[v] = window
            window.version = v
        self.active = Proposal(self.active.weights.replace(version=v), self.active.prefill_rate,
                               self.active.arm, self.keys)
        return self.active

    # --- evaluation ---------------------------------------------------------------------------

    def _clip(self, w: Mapping[str, float]) -> Point:
        """Every weight key, inside the search bounds (missing: the term's default)."""
        unknown = sorted(set(w) - set(self.keys))
        if unknown:
            raise ValueError(f"unknown weight {unknown[0]!r} (known: {', '.join(self.keys)})")
        return {k: min(max(float(w.get(k, WEIGHTED[k].default)), lo), hi)
                for k, (lo, hi) in self.bounds.items()}

    def _take_version(self) -> int:
        v = self.next_version
        if v >= VERSION_MAX:  # the state keeps the next one, which must fit int64 too
            raise _exhausted(v - 1)
        self.next_version += 1
        self.revision += 1
        return v

    def _sample_candidate(self) -> Point:
        keys = self.keys
        lo = np.log([self.bounds[k][0] for k in keys])
        hi = np.log([self.bounds[k][1] for k in keys])
        x = np.log(_vec(self.incumbent, keys)) + self.sigma * self.rng.standard_normal(len(keys))
        return self._clip(_from_vec(np.exp(_reflect(x, lo, hi)), keys))

    def _warming_up(self) -> bool:
        """The first evaluation waits, with the incumbent bridged under an unscored version,
        until the weight fit has its samples (a few seconds of traffic; ``model_start_samples``
        when the fit may take the start's place, since that decision has no evaluation behind
        it): from bad weights the fit is the one candidate that can leave them at once.
        Unscored, so the evaluation's incumbent windows are as short as its candidate's, and a
        clear win is not held up by the stragglers of a long wait."""
        if self.fit is None or self.model_tried is not None or self.evaluations:
            return False
        need = max(self.cfg.model_min_samples,
                   self.cfg.model_start_samples if self.cfg.model_start else 0)
        return len(self.fit) < need and self.seen < 4 * need

    def _log_gap(self, a: Point, b: Point) -> np.ndarray:
        """|log a - log b|, per weight key."""
        return np.abs(np.log(_vec(a, self.keys)) - np.log(_vec(b, self.keys)))

    def _far(self, a: Point, b: Point) -> bool:
        """More than ``model_retry`` apart in log space."""
        return math.hypot(*self._log_gap(a, b)) > self.cfg.model_retry

    def _model_candidate(self) -> Point | None:
        """The fitted weights (a weight the fit says nothing about keeps the incumbent's), when
        they are far from the incumbent and from the last ones tried (a rejected fit is not
        proposed again until the fleet's behaviour moved it)."""
        if self.fit is None:
            return None
        fitted = self.fit.weights()
        if fitted is None:
            return None
        point = self._clip({**self.incumbent, **fitted})
        if self._far(point, self.incumbent) and (self.model_tried is None
                                                 or self._far(point, self.model_tried)):
            return point
        return None

    def _refresh_rates(self) -> bool:
        """Calibrated rates change only between evaluations, so both arms share one cost model
        (and between monitor windows); True if one changed."""
        if self.calibrator is None:
            return False
        changed = False
        for replica, rate in self.calibrator.rates().items():
            old = self.rates.get(replica)
            if old is None or abs(rate - old) > self.cfg.rate_change * old:
                self.rates[replica] = round(rate, 3)
                self.revision += 1
                changed = True
        return changed

    def _start_eval(self, now: float) -> Proposal:
        self.phase = EVALUATING
        self._refresh_rates()
        start = self._adopt_fit(now)
        self._eval = Evaluation(self.incumbent, window_plan(self.cfg.pairs, self._order()),
                                epoch=self._hint_epoch)
        if start is not None:
            self._eval.candidate, self._eval.kind = start, START
        return self._open_window(self._eval.plan[0], now)

    def _rerun(self, now: float) -> Proposal:
        """The evaluation routing now, again from its first window under the rates of a hint
        that moved (`follow`), with the same candidate; its windows so far are dropped unscored.
        Voided, not deferred: a router prices a replica it was sent no rate for at its file's
        new hint from the reload on, before the tuner hears of it, so holding the hint back here
        could not keep one rate across the windows (in a reproduction the incumbent's window
        priced a replica at 2000 tokens/s, the candidate's at 5000). The evaluations already
        waiting for their stragglers had routed before the tuner heard of it: scored as they
        are, but not extended across it (`_promising`)."""
        ev = self._eval
        assert ev is not None
        for version in self._versions_of(ev):
            del self._windows[version]
        self._record({"event": "discarded", "reason": "rate_hint",
                      "versions": [w.version for w in ev.windows]}, now)
        self._open = None
        self._refresh_rates()
        self._eval = Evaluation(ev.incumbent, window_plan(self.cfg.pairs, self._order()),
                                candidate=ev.candidate, kind=ev.kind, epoch=self._hint_epoch)
        return self._open_window(self._eval.plan[0], now)

    def _adopt_fit(self, now: float) -> Point | None:
        """At the start of a search (no evaluation yet, no fitted weights tried): the weights
        nearest the incumbent that the fit does not rule out take its place if one of its weights
        is off from them by more than ``model_start_factor`` and they predict TTFT better beyond
        the noise; the weights they replace are returned, to be the first evaluation's
        candidate. Only a grossly wrong start is replaced: how well weights predict is not how
        well they route (on the Azure trace, fitted queue weights of 0.1-0.4 predict better than
        1 and route 1.15-1.3x worse), so sane weights are left to the evaluations."""
        if not (self.cfg.model_start and self.evaluations == 0 and self.model_tried is None
                and self.fit is not None and not self._pending and self._eval is None):
            return None  # (an evaluation still open measured the incumbent this would replace)
        if self.fit.dominated(self.cfg.max_source_share):
            return None  # no single export decides: the evaluations will
        fitted = self._model_candidate()  # far from the incumbent, or None
        near = self.fit.plausible(self.incumbent, self.cfg.fpr, self.rng, self.cfg.block)
        if fitted is None or near is None:
            return None
        point = self._clip({**self.incumbent, **near})
        if not (self._log_gap(point, self.incumbent).max() > math.log(self.cfg.model_start_factor)
                and self.fit.predicts_better(point, self.incumbent, self.cfg.fpr, self.rng,
                                             self.cfg.block)):
            return None
        start = self.incumbent
        self.incumbent, self.incumbent_p95 = point, None
        self.model_tried = fitted  # the fit's own point: proposed again only once it moves
        self._record({"event": "adopted", "from": dict(start), "to": dict(point),
                      "fitted": dict(fitted)}, now)
        return start

    def _open_window(self, arm: str, now: float) -> Proposal:
        ev = self._eval
        assert ev is not None
        if arm == CANDIDATE and ev.candidate is None:
            model = self._model_candidate()
            if model is not None:
                ev.candidate, ev.kind = model, MODEL
                self.model_tried = model
                self.revision += 1
            else:
                ev.candidate = self._sample_candidate()
        v = self._take_version()
        w = Window(arm, v, now, needs_end=self.cfg.needs_end)
        self._windows[v] = w
        ev.windows.append(w)
        self._open = w
        point = ev.candidate if arm == CANDIDATE and ev.candidate else ev.incumbent
        self.active = Proposal(Weights(point, v), dict(self.rates), arm, self.keys)
        return self.active

    def _bridge(self, now: float) -> Proposal:
        """The incumbent under a version no window scores, until a pending verdict is in."""
        self._open = None
        self.active = Proposal(Weights(self.incumbent, self._take_version()), dict(self.rates),
                               BRIDGE, self.keys)
        return self.active

    def _start_warmup(self, now: float) -> Proposal:
        """The bridge of the warm-up, under a window that no arm scores: its requests, cut into
        evaluation-sized windows, show how much a window's score varies at these weights."""
        proposal = self._bridge(now)
        v = proposal.weights.version
        if self.cfg.spread_history and not self.spreads:
            self._warmup = Window(WARMUP, v, now, needs_end=self.cfg.needs_end)
            self._windows[v] = self._warmup
        return proposal

    def _warmup_spread(self) -> tuple[Spread, ...]:
        """The warm-up's window spread (`evaluation_spread` of one arm: its requests in arrival
        order, cut into windows of ``window_samples``), while the first evaluation is undecided:
        its test has no other noise estimate, and without one it is the bootstrap's alone, which
        let a bad start win its place back on a lucky window (docs/tuner.md). Recomputed only
        when the warm-up's requests changed (under ``e2e`` they end during the evaluation)."""
        w = self._warmup
        if w is None:
            return ()
        values = score_values(w, self.cfg, None)
        if self._warmup_memo[0] != values.size:
            k = self.cfg.window_samples
            parts = [(i // k, values[i:i + k]) for i in range(0, values.size - k + 1, k)]
            self._warmup_memo = (values.size, evaluation_spread(
                [parts], self.cfg, np.random.default_rng(values.size)))
        return self._warmup_memo[1]

    def _order(self) -> np.random.Generator | None:
        """Where the next windows' order comes from (`window_plan`): drawn once the evaluations
        have taught the noise per lag, ABBA before (and after a restart from a state file that
        holds only pooled spreads: a drawn order charged the pooled noise under-charges some)."""
        learnt = any(lag for spreads in self.spreads for *_, lag in spreads)
        return self.order_rng if learnt else None

    def _noise(self) -> Noise:
        """The window noise the next verdict adds: the evaluations', or the warm-up's before
        the first one is scored, pooled over its lags: the warm-up is where the load builds up
        from nothing, and the lags of a fill-up said the first evaluation's alternating orders
        were all but free of noise (Azure under `e2e`: 8 of 12 A/A runs accepted at their first
        evaluation, docs/tuner.md "A plan drawn at random")."""
        warmup = [(b, w, d, 0) for b, w, d, _ in self._warmup_spread()]
        return window_noise([*itertools.chain.from_iterable(self.spreads), *warmup])

    def _abandon(self) -> None:
        """Drop every evaluation in flight (the incumbent they measured is no longer live)."""
        self._windows = {}
        self._eval = None
        self._pending = []
        self._open = None

    def _decide_pending(self, now: float) -> Proposal | None:
        """Verdicts in order; one that changes the incumbent restarts the search from it."""
        while self._pending:
            ev = self._pending[0]
            final = all(w.complete(now, self.cfg.census_timeout_s) for w in ev.windows)
            seen = (sum(w.received for w in ev.windows), sum(w.routed for w in ev.windows), final)
            if seen == ev.looked_at:
                return None  # nothing new since the last look: same verdict (none)
            ev.looked_at = seen
            if any(w.dominated(self.cfg.max_source_share) for w in ev.windows):
                if not final:
                    return None  # other exports may still even it out
                self._pending.pop(0)  # one export would decide it: dropped unscored
                for version in self._versions_of(ev):
                    del self._windows[version]
                self._record({"event": "discarded", "reason": "one_export",
                              "versions": [w.version for w in ev.windows]}, now)
                continue
            verdict = decide(ev, self._test_config(ev), self.rng, final, self._noise())
            if verdict is None:
                return None
            self._pending.pop(0)
            if self._promising(ev, verdict):
                return self._extend(ev, verdict, now)
            for version in self._versions_of(ev):
                del self._windows[version]
            changed = self._apply(ev, verdict, now)
            if self.phase == CONVERGED:
                self._abandon()
                return self._start_monitor(now)
            if changed:
                self._abandon()
                return self._start_eval(now)
        return None

    def _versions_of(self, ev: Evaluation) -> dict[int, Window]:
        """The versions that count for ``ev``'s windows (a renumbered window has two)."""
        return {v: w for v, w in self._windows.items() if any(w is x for x in ev.windows)}

    def _looks(self) -> int:
        return max(1, self.cfg.model_pairs // self.cfg.pairs)

    def _test_config(self, ev: Evaluation) -> OptimizerConfig:
        """A fitted candidate may be looked at several times (`_extend`), so each look gets its
        share of the false-positive rate (Bonferroni) and the total stays at ``fpr``."""
        if ev.kind != MODEL or self._looks() == 1:
            return self.cfg
        return replace(self.cfg, fpr=self.cfg.fpr / self._looks())

    def _promising(self, ev: Evaluation, v: Verdict) -> bool:
        """A fitted candidate that measured better but not beyond the noise gets more windows
        instead of a rejection: it is proposed rarely and, from bad weights, it is the way out."""
        return (ev.kind == MODEL and v.reason == "not_better" and v.p95_candidate < v.p95_incumbent
                and len(ev.plan) < 2 * self._looks() * self.cfg.pairs
                and ev.epoch == self._hint_epoch)  # (more windows under another hint: no)

    def _extend(self, ev: Evaluation, v: Verdict, now: float) -> Proposal:
        """Route ``pairs`` more pairs of windows for ``ev``, in an order of their own
        (`window_plan`); the evaluation routing meanwhile (it
        measured the same incumbent, but its candidate is not the one being extended) is dropped."""
        self._record({"event": "extended", "candidate": dict(ev.candidate or ev.incumbent),
                      "p95_incumbent": v.p95_incumbent, "p95_candidate": v.p95_candidate,
                      "n_incumbent": v.n_incumbent, "n_candidate": v.n_candidate}, now)
        keep = self._versions_of(ev)
        self._abandon()
        self._windows = keep
        ev.plan = ev.plan + window_plan(self.cfg.pairs, self._order(), len(ev.plan) // 2)
        self._eval = ev
        return self._open_window(ev.plan[len(ev.windows)], now)

    def _learn_spread(self, ev: Evaluation) -> None:
        """Pool the spread of a scored evaluation's windows (reported requests only: a stand-in
        would fake one) for the tests of the evaluations after it. Resampled with a generator
        of its own, seeded by the evaluation's number, so that learning the spread leaves the
        search's random stream (candidates, verdicts) where it was."""
        n = self.cfg.spread_history
        if not n:
            return
        arms = [[(k, score_values(w, self.cfg, None)) for k, w in enumerate(ev.windows)
                 if w.arm == arm] for arm in (INCUMBENT, CANDIDATE)]
        rng = np.random.default_rng(self.evaluations)
        self.spreads.append(evaluation_spread(arms, self.cfg, rng))
        del self.spreads[:-n]
        self.revision += 1

    def _regressed(self, p95: float) -> bool:
        """On probation, the new incumbent's fresh p95 is compared with what the weights it
        replaced achieved (not with its own lucky winning window, which a re-measurement
        regresses from by chance alone)."""
        return (self.last_good is not None and self.last_good_p95 is not None
                and p95 > self.last_good_p95 * (1.0 + self.cfg.rollback))

    def _rollback(self, p95: float, now: float) -> None:
        assert self.last_good is not None
        self._record({"event": "rollback", "from": dict(self.incumbent),
                      "to": dict(self.last_good), "p95_live": p95,
                      "p95_last_good": self.last_good_p95}, now)
        self.incumbent = self.last_good
        self.incumbent_p95 = self.last_good_p95
        self.last_good = self.last_good_p95 = None
        self._step(success=False)

    def _step(self, *, success: bool) -> None:
        cfg = self.cfg
        if success:
            self.sigma = min(self.sigma * cfg.step_up, cfg.max_sigma)
            self.failures = 0
        else:
            p = cfg.success_rate
            self.sigma *= cfg.step_up ** (-p / (1.0 - p))
            self.failures += 1
        self.revision += 1

    def _apply(self, ev: Evaluation, v: Verdict, now: float) -> bool:
        """Act on a verdict; True if the incumbent changed."""
        inc = ev.arm(INCUMBENT)
        candidate = ev.candidate or ev.incumbent
        self.evaluations += 1
        # The warm-up's noise was the first evaluation's only: at bad weights its queues grow
        # through it, a trend that kept among the evidence for `spread_history` evaluations
        # refused every candidate (0 accepted in 21 evaluations, Mooncake window 0).
        self._warmup = None
        self._learn_spread(ev)
        known = _concat([score_values(w, self.cfg, None) for w in inc])
        # No latency at all (every request failed, or none reported back): nothing to re-measure
        if known.size:
            p95_i = statistic(known, self.cfg)
            if self._regressed(p95_i):
                self._rollback(p95_i, now)
                return True
            self.last_good = self.last_good_p95 = None  # re-measured without regression
        self._record({
            "event": "evaluation", "kind": ev.kind, "incumbent": dict(ev.incumbent),
            "candidate": dict(candidate), "accepted": v.accepted, "reason": v.reason,
            "p95_incumbent": v.p95_incumbent, "p95_candidate": v.p95_candidate,
            "diff_upper_ms": v.diff_upper_ms, "margin_ms": v.margin_ms,
            "e2e_incumbent": v.e2e_incumbent, "e2e_candidate": v.e2e_candidate,
            "errors_incumbent": v.errors_incumbent, "errors_candidate": v.errors_candidate,
            "n_incumbent": v.n_incumbent, "n_candidate": v.n_candidate,
            "missing": sum(w.missing for w in ev.windows),
            "versions": [w.version for w in ev.windows], "sigma": self.sigma,
        }, now)
        changed = False
        if v.accepted:
            # On probation only against a known score of the weights it replaced (`decide`)
            self.last_good, self.last_good_p95 = (
                (self.incumbent, v.p95_incumbent) if math.isfinite(v.p95_incumbent)
                else (None, None))
            self.incumbent, self.incumbent_p95 = candidate, v.p95_candidate
            self.accepted += 1
            changed = True
        elif not math.isnan(v.p95_incumbent):  # NaN: nothing measured, the last score stands
            self.incumbent_p95 = v.p95_incumbent
        if ev.kind == STEP:  # the 1/5 rule is about random steps; a model proposal is not one
            self._step(success=v.accepted)
        if self.sigma < self.cfg.min_sigma or self.failures >= self.cfg.max_failures:
            self.phase = CONVERGED
            self._record({"event": "converged", "incumbent": dict(self.incumbent),
                          "p95": self.incumbent_p95}, now)
        return changed

    # --- converged: monitoring ----------------------------------------------------------------

    def _monitor(self, now: float) -> Proposal | None:
        w = self._open
        if w is None:
            return self._start_monitor(now)
        if (w.n < self.cfg.monitor_samples or now - w.opened_at < self.cfg.min_window_s
                or w.dominated(self.cfg.max_source_share)):
            return None
        return self._end_monitor_window(now)

    def _start_monitor(self, now: float) -> Proposal:
        """Publish the incumbent; a monitor window (larger than an evaluation's) sets the
        baseline that later windows are checked against for drift: the first to open once the
        version has been live for as long as the longest request its windows have seen (set
        again if a longer one comes). Not the first window: its requests all began under the
        new version, so it closes on the first to end, the short ones, while later windows
        also hold the long requests begun before them (under `e2e`, stationary traffic then
        read as a drift: a search restarted 45 s after it converged, in 3 of 3 seeds)."""
        self.phase = CONVERGED
        self.baseline_p95 = None
        self._monitor_epoch = self._hint_epoch  # a hint that moves starts it over (`follow`)
        self._monitor_since, self._longest_ms, self._baseline_age_ms = now, 0.0, math.inf
        self._drift_run = 0
        self._abandon()
        self._refresh_rates()
        v = self._take_version()
        w = Window(MONITOR, v, now, needs_end=self.cfg.needs_end)
        self._windows[v] = w
        self._open = w
        self.active = Proposal(Weights(self.incumbent, v), dict(self.rates), MONITOR, self.keys)
        return self.active

    def _restart(self, reason: str, p95: float, now: float) -> Proposal:
        self._record({"event": "restart", "reason": reason, "p95_live": p95,
                      "p95_baseline": self.baseline_p95}, now)
        self.sigma = max(self.sigma, self.cfg.restart_sigma)
        self.failures = 0
        self.revision += 1
        self._abandon()
        return self._start_eval(now)

    def _drifted(self, score: float, base: float, n: int) -> bool:
        """Whether a monitor window's score moved from the baseline by more than ``drift``; a
        miss rate also beyond binomial noise (two-sided, at ``fpr``, the baseline's window taken
        as ``monitor_samples``): a 20 % move of a 6 % rate over 200 requests is noise, and
        stationary traffic restarted the search about 15 times an hour."""
        if not abs(score - base) > self.cfg.drift * base:
            return False
        if self.cfg.objective != SLO:
            return True
        pooled = (score + base) / 2.0
        se = math.sqrt(pooled * (1.0 - pooled) * (1.0 / max(n, 1) + 1.0 / self.cfg.monitor_samples))
        return abs(score - base) > _t_quantile(1.0 - self.cfg.fpr / 2.0, math.inf) * se

    def _end_monitor_window(self, now: float) -> Proposal | None:
        w = self._open
        assert w is not None
        values = score_values(w, self.cfg, None)
        p95 = statistic(values, self.cfg)
        # The SLO's values are hits: its TTFTs in ms set the age guard too (skipped under SLO,
        # the first window's short requests were a baseline too)
        latencies = w.values("ttft", None) if self.cfg.objective == SLO else values
        self._longest_ms = max(self._longest_ms, float(np.max(latencies, initial=0.0)))
        if self._regressed(p95):
            self._rollback(p95, now)
            return self._restart("rollback", p95, now)
        self.last_good = self.last_good_p95 = None
        # Converged, the rates were refreshed only when a search restarted, so a recalibrated
        # (or re-hinted) engine stayed priced at its old rate; new rates are a new cost model,
        # so the drift baseline starts over under them.
        if self._refresh_rates() or (self.active is not None
                                     and self.rates != self.active.prefill_rate):
            return self._start_monitor(now)
        # A window counts once its version had been live, when it opened, for as long as the
        # longest request seen: the baseline's too, else it is set again from a later one.
        age_ms = (w.opened_at - self._monitor_since) * 1000.0
        if self._baseline_age_ms < self._longest_ms:
            self.baseline_p95, self._drift_run = None, 0
        base = self.baseline_p95
        if age_ms >= self._longest_ms:
            if base is None or base <= 0:
                self.baseline_p95, self._baseline_age_ms = p95, age_ms
                self.revision += 1
            elif self._drifted(p95, base, int(values.size)):
                step = 1 if p95 > base else -1
                self._drift_run = self._drift_run + step if self._drift_run * step > 0 else step
                if abs(self._drift_run) >= self.cfg.drift_windows:
                    return self._restart("drift", p95, now)
            else:
                self._drift_run = 0
        fresh = Window(MONITOR, w.version, now, needs_end=self.cfg.needs_end)
        for version, win in list(self._windows.items()):
            if win is w:
                self._windows[version] = fresh
        self._open = fresh
        return None

    # --- bookkeeping --------------------------------------------------------------------------

    def _record(self, entry: dict[str, Any], now: float) -> None:
        entry = {k: (_finite_or_none(v) if isinstance(v, float) else v) for k, v in entry.items()}
        entry["t"] = round(now, 3)
        entry["n"] = self.evaluations
        self.history.append(entry)
        if len(self.history) > self.cfg.history:
            del self.history[: len(self.history) - self.cfg.history]
        self.revision += 1

    def window_for(self, version: int) -> Window | None:
        """The window a sample of ``version`` counts for (None: it counts for none)."""
        return self._windows.get(version)

    def status(self) -> dict[str, Any]:
        w = self._open
        return {
            "phase": self.phase,
            "incumbent": {**self.incumbent, "p95_ms": _finite_or_none(self.incumbent_p95)},
            "on_probation": self.last_good is not None,
            "sigma": self.sigma,
            "failures": self.failures,
            "evaluations": self.evaluations,
            "accepted": self.accepted,
            "active": None if self.active is None else {
                **self.active.body(), "arm": self.active.arm},
            "window": None if w is None else {"arm": w.arm, "version": w.version,
                                              "samples": w.n, "errors": w.errors,
                                              "routed": w.routed},
            "pending_evaluations": len(self._pending),
            "awaiting_requests": sum(w.missing for ev in self._pending for w in ev.windows),
            "ignored_samples": self.ignored,
            "other_policy_samples": self.other_policy,
            "baseline_p95_ms": _finite_or_none(self.baseline_p95),
            "prefill_rate": dict(self.rates),
            # pooled ("variance", "df") and per lag (windows apart -> [variance, df])
            **_noise_status(self._noise()),
            "calibration": None if self.calibrator is None else self.calibrator.report(),
            "last": self.history[-1] if self.history else None,
        }

    # --- persistence --------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Everything needed to resume; an evaluation in progress restarts (samples are gone)."""
        return {
            "format": STATE_FORMAT,
            "objective": self.cfg.objective,
            "config": asdict(self.cfg),
            "incumbent": dict(self.incumbent),
            "incumbent_p95": _finite_or_none(self.incumbent_p95),
            "last_good": None if self.last_good is None else dict(self.last_good),
            "last_good_p95": _finite_or_none(self.last_good_p95),
            "sigma": self.sigma,
            "failures": self.failures,
            "evaluations": self.evaluations,
            "accepted": self.accepted,
            "phase": self.phase,
            "baseline_p95": _finite_or_none(self.baseline_p95),
            "next_version": self.next_version,
            "prefill_rate": dict(self.rates),
            "model_tried": None if self.model_tried is None else dict(self.model_tried),
            "history": list(self.history),
            "spreads": [[list(x) for x in ev] for ev in self.spreads],
            "rng": self.rng.bit_generator.state,
        }

    @classmethod
    def restore(
        cls,
        config: OptimizerConfig,
        state: dict[str, Any],
        *,
        calibration: CalibrationConfig | None = None,
        hints: dict[str, float] | None = None,
    ) -> Tuner:
        """A tuner resumed from a `snapshot` that `tuner.state_store.check_state` accepted (the
        live tuner's `load_state` checks every field); ValueError if it is incomplete."""
        try:
            fmt = state["format"]
            keys = config.keys
            t = cls(config, point_from_state(state["incumbent"], fmt, keys),
                    calibration=calibration, hints=hints, next_version=int(state["next_version"]))
            t.incumbent_p95 = _opt_float(state.get("incumbent_p95"))
            last_good = state.get("last_good")
            # Inside today's bounds, as the incumbent is: a rollback publishes them.
            t.last_good = (None if last_good is None
                           else t._clip(point_from_state(last_good, fmt, keys)))
            t.last_good_p95 = _opt_float(state.get("last_good_p95"))
            t.sigma = min(float(state["sigma"]), config.max_sigma)
            t.failures = int(state["failures"])
            t.evaluations = int(state["evaluations"])
            t.accepted = int(state["accepted"])
            t.phase = str(state["phase"])
            t.baseline_p95 = _opt_float(state.get("baseline_p95"))
            tried = state.get("model_tried")
            t.model_tried = (None if tried is None
                             else t._clip(point_from_state(tried, fmt, keys)))
            t.rates = {str(k): float(v) for k, v in dict(state.get("prefill_rate") or {}).items()}
            t.history = list(state.get("history") or [])[-config.history:] if config.history else []
            n = config.spread_history
            spreads = [_spreads_from_state(x) for x in state.get("spreads") or []]
            t.spreads = spreads[-n:] if n else []
            if state.get("rng") is not None:
                t.rng.bit_generator.state = state["rng"]
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"incomplete tuner state: {exc!r}") from None
        if state.get("objective", TTFT) != config.objective:
            t._new_objective(str(state.get("objective", TTFT)))
        return t

    def _new_objective(self, old: str) -> None:
        """Resumed under another objective: the weights carry over (projected onto the new
        search space), but no score of the old one means anything now, so the search starts
        again from them."""
        self._record({"event": "objective", "from": old, "to": self.cfg.objective}, 0.0)
        self.incumbent_p95 = self.last_good_p95 = self.baseline_p95 = None
        self.last_good = None
        # So is the old objective's window noise (another metric's spread: a 2x better TTFT
        # candidate was judged not better under the E2E spreads carried over) and its fit's try.
        self.spreads = []
        self.model_tried = None
        self.phase = EVALUATING
        self.sigma = max(self.sigma, self.cfg.restart_sigma)
        self.failures = 0


def _noise_status(noise: Noise) -> dict[str, Any]:
    """The window noise as `Tuner.status` reports it: pooled, and per lag."""
    variance, df = noise.get(0, (0.0, 0.0))
    return {"window_noise": {"variance": variance, "df": df,
                             "by_lag": {str(lag): list(v) for lag, v in sorted(noise.items())
                                        if lag}}}


def _spreads_from_state(x: list[Any]) -> tuple[Spread, ...]:
    """One evaluation's spreads as a state file holds them: a list of [between, within, df, lag]
    lists; written before lags were kept, one [between, within, df] list (any lag: 0), or before
    the df was kept, [between, within] of two-window arms (df 2)."""
    if not x or isinstance(x[0], list):
        return tuple((float(b), float(w), float(d), int(lag)) for b, w, d, lag in x)
    return ((float(x[0]), float(x[1]), float(x[2]) if len(x) > 2 else 2.0, 0),)


def point_from_state(v: Any, fmt: int, keys: Sequence[str] = KEYS) -> Point:
    """Weights over ``keys`` from a state file: ``{key: factor}`` (format 1: an ``[rtt, queue]``
    list). A weight the registry gained since the file was written, or one the file's objective
    did not search, takes its term's default; one ``keys`` lack (another objective's) is
    dropped."""
    if fmt == 1 and isinstance(v, list | tuple):
        if len(v) != len(LEGACY_KEYS):
            raise ValueError(f"expected [{', '.join(LEGACY_KEYS)}], got {v!r}")
        v = dict(zip(LEGACY_KEYS, v, strict=True))
    if not isinstance(v, Mapping):
        raise ValueError(f"expected {{{', '.join(keys)}}}, got {v!r}")
    unknown = sorted(set(v) - set(WEIGHTED))
    if unknown:
        raise ValueError(f"unknown weight {unknown[0]!r} (known: {', '.join(WEIGHTED)})")
    out = {}
    for k in keys:
        x = v.get(k, WEIGHTED[k].default)
        if isinstance(x, bool) or not isinstance(x, int | float) or not (
                math.isfinite(x) and x > 0):
            raise ValueError(f"weights must be finite and > 0, got {k}={x!r}")
        out[k] = float(x)
    return out


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


def config_from_mapping(raw: dict[str, Any], path: str = "optimizer") -> OptimizerConfig:
    """OptimizerConfig from a YAML mapping; unknown keys and wrong types name their field."""
    known = {f.name: f for f in fields(OptimizerConfig)}
    defaults = OptimizerConfig()
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in known:
            raise ValueError(f"{path}.{key}: unknown field (allowed: {', '.join(sorted(known))})")
        default = getattr(defaults, key)
        if key == "bounds":
            objective = raw.get("objective", defaults.objective)
            try:  # for the weights the configured objective searches, not the default's
                value = normalize_bounds(
                    value, weight_keys(objective) if objective in OBJECTIVES else KEYS)
            except ValueError as exc:  # names bounds or bounds.<key>
                raise ValueError(f"{path}.{exc}") from None
        elif isinstance(default, bool):
            if not isinstance(value, bool):
                raise ValueError(f"{path}.{key}: expected true or false")
        elif isinstance(default, str):
            if not isinstance(value, str):
                raise ValueError(f"{path}.{key}: expected a string, got {value!r}")
        elif isinstance(default, int):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{path}.{key}: expected an integer, got {value!r}")
        elif (x := finite_number(value)) is None:
            # YAML's .inf would pass every `>= 0` check (a margin no candidate can meet), and
            # float() of a 401-digit integer raised OverflowError: a traceback, not exit 2.
            raise ValueError(f"{path}.{key}: expected a finite number, got {str(value)[:40]}")
        else:
            value = x
        values[key] = value
    cfg = OptimizerConfig(**values)
    cfg.validate()
    return cfg
