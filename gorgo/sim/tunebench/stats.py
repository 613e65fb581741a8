"""The statistics of `gorgo bench tune`: the grid's best point, convergence, rolling p95 of live
traffic, Wilson intervals, and the per-run summaries that results.json holds.

Pure functions over plain data (static results keyed by `points.static_key`, a run's `TuneTrace`),
so they are tested without simulating anything.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gorgo.core.terms import E2E, SLO, TTFT
from gorgo.sim.tunebench.points import Point, point_key, static_key

if TYPE_CHECKING:
    from gorgo.sim.tunebench.run import TuneSettings, TuneTrace

LIVE_WINDOW, LIVE_EVERY = 500, 100  # rolling p95 of live traffic, in samples
# A/A evaluations decided within one stretch of this many samples of the slice, in any seed, met
# the same part of the trace (seeds vary jitter, never the trace): they resample together.
STRETCH_SAMPLES = 250
LEVELS = (0.1, 0.25, 1.0)  # looser tolerances reported beside --tolerance
LIVE_MAX = "live_p95_max_ms"  # a static run's worst rolling p95, to compare the tuned runs with
SLO_MISS = "slo_miss"  # a static run's share of requests over the SLO's TTFT target (or failed)
# The static metric each objective is scored on: the grid's best and convergence follow it.
OBJECTIVE_METRIC = {TTFT: "ttft_p95_ms", E2E: "e2e_p95_ms", SLO: SLO_MISS}


@dataclass(frozen=True)
class GridBest:
    """The grid's best point; its ``*_p95_ms`` figures are the objective's metric (a p95 TTFT
    or E2E, or the SLO's miss share), ``per_seed_e2e_ms`` always the p95 E2E."""

    weights: Point  # weight key -> factor
    mean_p95_ms: float
    per_seed_p95_ms: dict[int, float]
    per_seed_e2e_ms: dict[int, float]


def grid_best(points: Sequence[Point], seeds: Sequence[int],
              static: Mapping[str, Mapping[str, float]],
              metric: str = OBJECTIVE_METRIC[TTFT]) -> GridBest:
    """The grid point with the lowest mean ``metric`` over seeds (the first of equals)."""
    best: GridBest | None = None
    for p in points:
        p95 = {s: static[static_key(p, {}, s)][metric] for s in seeds}
        mean = float(np.mean(list(p95.values())))
        if best is None or mean < best.mean_p95_ms:
            e2e = {s: static[static_key(p, {}, s)]["e2e_p95_ms"] for s in seeds}
            best = GridBest(dict(p), mean, p95, e2e)
    assert best is not None
    return best


def score_ratio(score: float, target: float) -> float:
    """``score / target``; a target of 0 (an SLO nobody misses) is met only by 0."""
    if target > 0:
        return score / target
    return 1.0 if score <= 0 else math.inf


def grid_means(points: Sequence[Point], seeds: Sequence[int],
               static: Mapping[str, Mapping[str, float]], metric: str) -> dict[str, float]:
    """`points.point_key` -> mean of ``metric`` over seeds, for every grid point."""
    return {point_key(p): float(np.mean([static[static_key(p, {}, s)][metric] for s in seeds]))
            for p in points}


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson interval of a binomial proportion."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, mid - half), min(1.0, mid + half))


def stretch_interval(verdicts: Sequence[tuple[int, int]], stretch: int = STRETCH_SAMPLES,
                     reps: int = 10_000, seed: int = 0) -> tuple[float, float, int]:
    """95 % interval of the pooled acceptance rate of (samples at the verdict, accepted)
    verdicts from runs over one trace slice, resampling whole stretches of the slice (the
    verdicts of every seed in one ``stretch`` of samples): a burst that fools the test in one
    seed fools it in all, so counting each verdict as an independent trial (`wilson`) gives an
    interval too narrow. Returns (low, high, stretches)."""
    groups: dict[int, list[int]] = {}
    for at, accepted in verdicts:
        groups.setdefault(int(at) // stretch, []).append(int(accepted))
    if not groups:
        return (0.0, 1.0, 0)
    k = np.array([sum(g) for g in groups.values()], dtype=float)
    n = np.array([len(g) for g in groups.values()], dtype=float)
    pick = np.random.default_rng(seed).integers(0, len(k), size=(reps, len(k)))
    rate = k[pick].sum(axis=1) / n[pick].sum(axis=1)
    lo, hi = np.quantile(rate, [0.025, 0.975])
    return (float(lo), float(hi), len(k))


def null_total(nulls: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    if not nulls:
        return None
    k = sum(r["accepted"] for r in nulls)
    n = sum(r["evaluations"] for r in nulls)
    lo, hi = wilson(k, n)
    out = {"accepted": k, "evaluations": n, "rate": k / n if n else None, "ci95": [lo, hi]}
    if all("verdicts" in r for r in nulls):  # results.json of older runs lack them
        tlo, thi, stretches = stretch_interval([tuple(v) for r in nulls for v in r["verdicts"]])
        out.update(ci95_stretches=[tlo, thi], stretches=stretches)
    return out


def convergence(ratios: Sequence[float], at: Sequence[int], tolerance: float) -> dict[str, Any]:
    """From each incumbent's static p95 / target and the sample count it took over at: when the
    run first came within ``tolerance``, and from when on it stayed there (None: it did not)."""
    ok = [r <= 1.0 + tolerance for r in ratios]
    first = next((n for n, good in zip(at, ok, strict=True) if good), None)
    stays: int | None = None
    if ok and ok[-1]:
        last_bad = max((k for k, good in enumerate(ok) if not good), default=-1)
        stays = at[last_bad + 1] if last_bad >= 0 else at[0]
    return {"first_within": first, "stays_within": stays}


def rolling_p95(ttft_ms: Sequence[float], window: int, every: int) -> list[tuple[int, float]]:
    """(samples, p95 of the last ``window`` samples' TTFT) every ``every`` samples: what a
    dashboard of live traffic shows while the tuner explores."""
    a = np.asarray(ttft_ms, dtype=float)
    out = []
    for end in range(window, a.size + 1, every):
        p = float(np.percentile(np.where(np.isfinite(a[end - window:end]), a[end - window:end],
                                         1e300), 95))
        out.append((end, math.inf if p >= 1e299 else p))
    return out


def summarize_null(label: str, settings: TuneSettings, trace: TuneTrace) -> dict[str, Any]:
    """An A/A run: how often the identical candidate was accepted, and the measured gap."""
    evals = [h for h in trace.history if h["event"] == "evaluation"]
    gaps = [(h["p95_candidate"] - h["p95_incumbent"]) / h["p95_incumbent"] for h in evals
            if h["p95_incumbent"] and h["p95_candidate"] is not None]
    return {
        "label": label, "seed": settings.seed, "weights": dict(settings.start),
        "samples": trace.samples, "evaluations": len(evals),
        "accepted": sum(bool(h["accepted"]) for h in evals),
        "rejected_for_e2e": sum(h["reason"] == "e2e_worse" for h in evals),
        "median_gap": float(np.median(gaps)) if gaps else None,
        # (samples seen at the verdict, accepted): where in the slice each one fell
        "verdicts": [[h["samples"], int(bool(h["accepted"]))] for h in evals],
    }


def summarize_run(
    label: str, settings: TuneSettings, trace: TuneTrace, run: dict[str, float],
    static: Mapping[str, Mapping[str, float]], best: GridBest, tolerance: float,
) -> dict[str, Any]:
    """Everything reported about one tuned run (see the package docstring for the definitions)."""
    seed = settings.seed
    target = best.per_seed_p95_ms[seed]
    metric = OBJECTIVE_METRIC[settings.config.objective]
    incs = []
    for n, weights, rates in trace.incumbents:
        m = static[static_key(weights, rates, seed)]
        incs.append({"samples": n, "weights": dict(weights), "prefill_rate": rates,
                     "static_ttft_p95_ms": m["ttft_p95_ms"], "static_e2e_p95_ms": m["e2e_p95_ms"],
                     "ratio": score_ratio(m[metric], target)})
    ratios, at = [i["ratio"] for i in incs], [i["samples"] for i in incs]
    conv = convergence(ratios, at, tolerance)
    levels = {f"{lv:g}": convergence(ratios, at, lv)["stays_within"]
              for lv in sorted({tolerance, *LEVELS})}
    evals = [h for h in trace.history if h["event"] == "evaluation"]
    worst = max(evals, key=lambda h: h["p95_candidate"] or 0.0, default=None)
    converged_at = next((h["samples"] for h in trace.history if h["event"] == "converged"), None)
    reasons: dict[str, int] = {}
    for h in evals:
        reasons[h["reason"]] = reasons.get(h["reason"], 0) + 1
    final = incs[-1]
    live = rolling_p95([x[3] for x in trace.sample_log], LIVE_WINDOW, LIVE_EVERY)
    return {
        "label": label,
        "start": dict(settings.start),
        "seed": seed,
        "e2e_guard": math.isfinite(settings.config.e2e_margin),
        "samples": trace.samples,
        "error_samples": trace.errors,
        "evaluations": len(evals),
        "accepted": sum(bool(h["accepted"]) for h in evals),
        "reasons": reasons,
        # acceptances whose new incumbent is worse than the old, re-run statically
        "worse_accepts": sum(b["ratio"] > a["ratio"] * (1.0 + tolerance)
                             for a, b in itertools.pairwise(incs)),
        "rollbacks": sum(h["event"] == "rollback" for h in trace.history),
        "restarts": sum(h["event"] == "restart" for h in trace.history),
        "optimizer_converged_at": converged_at,
        "target_p95_ms": target,
        **conv,
        "stays_within_by_tolerance": levels,
        "final": final,
        "worst_candidate_p95_ms": None if worst is None else worst["p95_candidate"],
        "worst_candidate_vs_incumbent": None if worst is None or not worst["p95_incumbent"]
        else worst["p95_candidate"] / worst["p95_incumbent"],
        "run_ttft_p95_ms": run["ttft_p95_ms"],
        "run_e2e_p95_ms": run["e2e_p95_ms"],
        "run_failed_pct": run["failed"],
        "incumbents": incs,
        "live_p95_ms": live,
        "live_p95_max_ms": max((p for _, p in live), default=math.nan),
        "best_live_p95_max_ms": static[static_key(best.weights, {}, seed)].get(
            LIVE_MAX, math.nan),
        "published": [list(p) for p in trace.published],
        "evaluations_log": [
            {k: h.get(k) for k in ("samples", "t", "kind", "incumbent", "candidate", "accepted",
                                   "reason", "p95_incumbent", "p95_candidate", "e2e_incumbent",
                                   "e2e_candidate", "n_incumbent", "n_candidate", "missing",
                                   "sigma")} for h in evals],
        "model_evaluations": sum(h.get("kind") == "model" for h in evals),
        "model_accepted": sum(h.get("kind") == "model" and bool(h["accepted"]) for h in evals),
        "extended": sum(h["event"] == "extended" for h in trace.history),
        # the start decided by prediction (`model_start`): when, and to what
        "adopted": next(({"samples": h["samples"], "to": h["to"]} for h in trace.history
                         if h["event"] == "adopted"), None),
        "start_won_back": sum(h.get("kind") == "start" and bool(h["accepted"]) for h in evals),
        "final_status": {k: trace.status.get(k) for k in ("phase", "sigma", "failures",
                                                          "ignored_samples")},
    }
