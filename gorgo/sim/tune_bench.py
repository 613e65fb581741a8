"""`gorgo bench tune`: the tuner's optimiser inside the offline simulation, against a grid search.

The tuned run is the live loop on a virtual clock. The simulated router is the real `Router`; each
request that completes becomes the `Sample` its span would have been (TTFT, E2E, status, replica,
region, the decision's weights version and predicted terms) and goes to `Tuner.observe` when its
last byte is back, in simulated time order. Every ``tick_s`` simulated seconds (as `gorgo tuner`
ticks) the bench asks `Tuner.next_weights(now)` and applies a proposal to the router's
`FleetState.set_weights` ``publish_delay_s`` later; a router refuses a version it has passed, as
the admin API does. A request with no first token (an engine refused it) becomes an error sample
with its close time as TTFT and E2E, so the error guard sees it.

Reference. Static weights on a log grid, on the same trace slice, load and seeds; the objective is
the p95 TTFT of the whole slice. The grid's best point is the one with the lowest mean p95 over
seeds, and its p95 on each seed is that seed's target (common random numbers: a tuned run on seed
s is compared with the grid on seed s).

Convergence. Every incumbent a tuned run holds is re-run statically (its weights and the prefill
rates published with it) on the same slice and seed. The run has converged at sample n when the
incumbent from n on, to the end of the run, stays within ``tolerance`` (5 %) of the seed's target;
samples are completed requests the router's `gorgo` policy routed, counted from the start.

A/A runs (`NullTuner`: the candidate is always the incumbent) measure how often the whole loop
accepts a candidate that is not better. Static runs are cached per trace slice, time scale and a
digest of the router and simulation source, so a rerun only simulates what changed.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import itertools
import json
import math
import multiprocessing as mp
import os
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from gorgo.core.decision import Decision
from gorgo.core.fleet import FleetSpec, Weights
from gorgo.sim.offline import RequestRecord, SimResult, Simulation
from gorgo.sim.stats import jsonable
from gorgo.sim.workload import Workload
from tuner.calibration import CalibrationConfig
from tuner.optimizer import OptimizerConfig, Proposal, Tuner
from tuner.samples import Sample

POLICY = "gorgo"
NULL_START = (1.0, 1.0)  # the fleet default: the A/A runs hold it throughout
LIVE_WINDOW, LIVE_EVERY = 500, 100  # rolling p95 of live traffic, in samples
RATIO_TICKS = (0.5, 0.7, 0.85, 1, 1.2, 1.5, 2, 3, 5)  # p95 / grid best, on a log axis
COARSE_TICKS = (0.5, 1, 2, 5, 10, 20, 50, 100, 200)
LEVELS = (0.1, 0.25, 1.0)  # looser tolerances reported beside --tolerance
LIVE_MAX = "live_p95_max_ms"  # a static run's worst rolling p95, to compare the tuned runs with
NO_TTFT_STATUS = 503


# ------------------------------------------------------------------------------ one tuned run


@dataclass(frozen=True)
class TuneSettings:
    """One tuned run: optimiser settings, start, seed, and how the loop around it behaves."""

    config: OptimizerConfig
    start: tuple[float, float]
    seed: int
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    tick_s: float = 0.5  # how often the tuner asks for new weights (simulated seconds)
    publish_delay_s: float = 0.0  # from the tuner's decision to the router applying it
    null: bool = False  # A/A: every candidate is the incumbent, so every acceptance is false


class NullTuner(Tuner):
    """Proposes the incumbent itself as the candidate: measures the false-accept rate of the
    whole loop (windows, lag, bursts), not just of `compare` on independent samples."""

    def _sample_candidate(self) -> tuple[float, float]:
        return self.incumbent


def null_config(config: OptimizerConfig) -> OptimizerConfig:
    """Never converges, so an A/A run evaluates for as long as the slice lasts."""
    return replace(config, min_sigma=1e-300, max_failures=10**9, model_step=False)


@dataclass
class TuneTrace:
    """What one tuned run did, indexed by samples observed so far."""

    samples: int = 0
    errors: int = 0
    # (arrival, completion, weights version that routed it, TTFT ms) of every sample, in order
    sample_log: list[tuple[float, float, int, float]] = field(default_factory=list)
    # (samples, simulated time, version, w_rtt, w_queue, arm) for every proposal applied
    published: list[tuple[int, float, int, float, float, str]] = field(default_factory=list)
    # (samples, w_rtt, w_queue, prefill rates) whenever the incumbent or its rates changed
    incumbents: list[tuple[int, float, float, dict[str, float]]] = field(default_factory=list)
    # the optimiser's history, each entry stamped with the samples seen when it was written
    history: list[dict[str, Any]] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)


def sample_of(rec: RequestRecord, d: Decision, spec: FleetSpec, now: float) -> Sample:
    """The span a completed request would have exported, as the tuner parses it."""
    rep = spec.replicas[d.replica]
    ok = rec.status == 200 and math.isfinite(rec.ttft)
    elapsed_ms = (now - rec.arrival) * 1000.0
    return Sample(
        ttft_ms=rec.ttft * 1000.0 if ok else elapsed_ms,
        e2e_ms=rec.e2e * 1000.0 if ok and math.isfinite(rec.e2e) else elapsed_ms,
        status=rec.status if rec.status else NO_TTFT_STATUS,
        replica=rep.name,
        region=rep.region,
        policy=d.policy,
        weights_version=d.weights_version,
        predicted_ttft_ms=_nonneg(d.predicted_ms),
        rtt_ms=_nonneg(d.rtt_ms),
        queue_ms=_nonneg(d.queue_ms),
        prefill_ms=_nonneg(d.prefill_ms),
        uncached_tokens=d.uncached_tokens,
        prompt_tokens=d.prompt_tokens,
        decision_id=d.id,
        end_unix_s=now,
    )


def _nonneg(x: float) -> float:
    return x if math.isfinite(x) and x >= 0 else 0.0


def fleet_for_seed(spec: FleetSpec, seed: int) -> FleetSpec:
    """As `sim.workload.simulate` names it, so tuned and static runs share every random draw."""
    return replace(spec, name=f"{spec.name}/seed{seed}")


def with_weights(spec: FleetSpec, rtt: float, queue: float,
                 rates: dict[str, float] | None = None) -> FleetSpec:
    """The fleet with static weights and, where given, prefill-rate hints replaced."""
    rates = rates or {}
    reps = tuple(replace(r, prefill_rate=rates.get(r.name, r.prefill_rate)) for r in spec.replicas)
    return replace(spec, weights=Weights(rtt, queue, 0), replicas=reps)


def tuned_run(
    spec: FleetSpec, workload: Workload, scale: float, settings: TuneSettings
) -> tuple[SimResult, TuneTrace]:
    """Run the slice with the optimiser in the loop; see the module docstring."""
    cfg = settings.config
    cls = NullTuner if settings.null else Tuner
    tuner = cls(cfg, initial=settings.start, seed=settings.seed, calibration=settings.calibration,
                hints={r.name: r.prefill_rate for r in spec.replicas})
    rtt0, queue0 = tuner.incumbent
    spec = fleet_for_seed(with_weights(spec, rtt0, queue0), settings.seed)
    trace = TuneTrace()

    def on_complete(rec: RequestRecord, d: Decision) -> None:
        if d.policy != cfg.policy:
            return
        s = sample_of(rec, d, spec, sim.now)
        trace.samples += 1
        trace.errors += not s.ok
        trace.sample_log.append((rec.arrival, sim.now, s.weights_version,
                                 s.ttft_ms if s.ok else math.inf))
        tuner.observe(s)
        if settings.tick_s <= 0:
            ask()

    def ask() -> None:
        for v in tuner.counting():  # what `gorgo tuner` reads from GET /admin/weights
            tuner.routed(v, sim.router.routed.get(v, {}).get(cfg.policy, 0))
        before = len(tuner.history)
        p = tuner.next_weights(sim.now)
        for entry in tuner.history[before:]:
            trace.history.append({**entry, "samples": trace.samples})
        inc = trace.incumbents[-1] if trace.incumbents else None
        if inc is None or (inc[1], inc[2], inc[3]) != (*tuner.incumbent, tuner.rates):
            trace.incumbents.append((trace.samples, *tuner.incumbent, dict(tuner.rates)))
        if p is None:
            return
        if settings.publish_delay_s > 0:
            sim.call_at(sim.now + settings.publish_delay_s, lambda: apply(p))
        else:
            apply(p)

    def apply(p: Proposal) -> None:
        state = sim.router.state
        if p.weights.version <= state.weights.version:
            return  # the admin API answers 409 to a version it has passed
        state.set_weights(p.weights, p.prefill_rate)
        w = p.weights
        trace.published.append((trace.samples, sim.now, w.version, w.rtt, w.queue, p.arm))

    def tick() -> None:
        ask()
        sim.call_at(sim.now + settings.tick_s, tick)

    sim = Simulation(spec, POLICY, seed=settings.seed, on_complete=on_complete)
    ask()  # the first window opens before the first request
    if settings.tick_s > 0:
        sim.call_at(settings.tick_s, tick)
    res = sim.run((workload.arrivals * scale).tolist(), workload.features,
                  workload.output_tokens)
    trace.status = tuner.status()
    return res, trace


# ---------------------------------------------------------------------------- worker processes

# Set in the parent before the pool forks; read by the workers (shared, not pickled).
_CTX: dict[str, Any] = {}


def static_metrics(
    rtt: float, queue: float, rates: dict[str, float], seed: int
) -> dict[str, float]:
    """p95 TTFT and E2E (and the rest of `sim.bench.run_metrics`) of static weights on the slice."""
    from gorgo.sim.bench import run_metrics
    from gorgo.sim.workload import simulate

    spec: FleetSpec = _CTX["spec"]
    fleet = with_weights(spec, rtt, queue, rates)
    t0 = time.perf_counter()
    res = simulate(fleet, POLICY, _CTX["workload"], _CTX["scale"], seed)
    m, _ = run_metrics(res, fleet)
    keep = ("ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms", "e2e_p95_ms", "failed", "cache_hit")
    out = {k: m[k] for k in keep}
    # Completion order, as the tuned run's live p95 is taken (failed requests close at once).
    done = sorted(res.records, key=lambda r: r.arrival + (r.e2e if r.status == 200 else 0.0))
    live = rolling_p95([r.ttft * 1000.0 if r.status == 200 else math.inf for r in done],
                       LIVE_WINDOW, LIVE_EVERY)
    out[LIVE_MAX] = max((p for _, p in live), default=math.nan)
    out["wall_s"] = time.perf_counter() - t0
    return out


def _static_job(job: tuple[str, float, float, tuple[tuple[str, float], ...], int]) -> Any:
    key, rtt, queue, rates, seed = job
    return key, static_metrics(rtt, queue, dict(rates), seed)


def _tune_job(job: tuple[str, TuneSettings]) -> Any:
    from gorgo.sim.bench import run_metrics

    label, settings = job
    t0 = time.perf_counter()
    res, trace = tuned_run(_CTX["spec"], _CTX["workload"], _CTX["scale"], settings)
    m, _ = run_metrics(res, _CTX["spec"])
    return label, settings, trace, {k: m[k] for k in ("ttft_p95_ms", "e2e_p95_ms", "failed")}, (
        time.perf_counter() - t0)


def _probe_job(rate: float) -> Any:
    from gorgo.sim.capacity import probe

    return probe(_CTX["spec"], _CTX["capacity_workload"], rate)


# ------------------------------------------------------------------------------------ analysis


# Modules (besides all of gorgo.core) whose source decides what a static run measures.
SIM_MODULES = ("gorgo.sim.offline", "gorgo.sim.engine", "gorgo.sim.kv_cache", "gorgo.sim.profiles",
               "gorgo.sim.workload",
               "gorgo.sim.traces", "gorgo.sim.link")


def model_digest() -> str:
    """Digest of the router and simulation source: cached static runs are reused only by the
    same code, so a change to the engine model or a policy never mixes old and new results."""
    import gorgo.core

    files = sorted(Path(gorgo.core.__file__).parent.rglob("*.py"))
    for name in SIM_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            files.append(Path(spec.origin))
    h = hashlib.blake2b(digest_size=8)
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def static_key(rtt: float, queue: float, rates: dict[str, float], seed: int) -> str:
    """Exact (repr) floats: an incumbent is re-run with the very weights it held."""
    r = ",".join(f"{k}={v!r}" for k, v in sorted(rates.items()))
    return f"{rtt!r}|{queue!r}|{r}|{seed}"


def grid_points(bounds: tuple[float, float], k: int) -> list[float]:
    return [float(x) for x in np.geomspace(bounds[0], bounds[1], k)]


@dataclass(frozen=True)
class GridBest:
    rtt: float
    queue: float
    mean_p95_ms: float
    per_seed_p95_ms: dict[int, float]
    per_seed_e2e_ms: dict[int, float]


def grid_best(points: Sequence[float], seeds: Sequence[int],
              static: dict[str, dict[str, float]]) -> GridBest:
    """The grid point with the lowest mean p95 TTFT over seeds."""
    best: GridBest | None = None
    for a in points:
        for b in points:
            p95 = {s: static[static_key(a, b, {}, s)]["ttft_p95_ms"] for s in seeds}
            mean = float(np.mean(list(p95.values())))
            if best is None or mean < best.mean_p95_ms:
                e2e = {s: static[static_key(a, b, {}, s)]["e2e_p95_ms"] for s in seeds}
                best = GridBest(a, b, mean, p95, e2e)
    assert best is not None
    return best


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson interval of a binomial proportion."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, mid - half), min(1.0, mid + half))


def summarize_null(label: str, settings: TuneSettings, trace: TuneTrace) -> dict[str, Any]:
    """An A/A run: how often the identical candidate was accepted, and the measured gap."""
    evals = [h for h in trace.history if h["event"] == "evaluation"]
    gaps = [(h["p95_candidate"] - h["p95_incumbent"]) / h["p95_incumbent"] for h in evals
            if h["p95_incumbent"] and h["p95_candidate"] is not None]
    return {
        "label": label, "seed": settings.seed, "weights": list(settings.start),
        "samples": trace.samples, "evaluations": len(evals),
        "accepted": sum(bool(h["accepted"]) for h in evals),
        "rejected_for_e2e": sum(h["reason"] == "e2e_worse" for h in evals),
        "median_gap": float(np.median(gaps)) if gaps else None,
    }


def null_total(nulls: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    if not nulls:
        return None
    k = sum(r["accepted"] for r in nulls)
    n = sum(r["evaluations"] for r in nulls)
    lo, hi = wilson(k, n)
    return {"accepted": k, "evaluations": n, "rate": k / n if n else None, "ci95": [lo, hi]}


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


def summarize_run(
    label: str, settings: TuneSettings, trace: TuneTrace, run: dict[str, float],
    static: dict[str, dict[str, float]], best: GridBest, tolerance: float,
) -> dict[str, Any]:
    """Everything reported about one tuned run (see the module docstring for the definitions)."""
    seed = settings.seed
    target = best.per_seed_p95_ms[seed]
    incs = []
    for n, rtt, queue, rates in trace.incumbents:
        m = static[static_key(rtt, queue, rates, seed)]
        incs.append({"samples": n, "rtt": rtt, "queue": queue, "prefill_rate": rates,
                     "static_ttft_p95_ms": m["ttft_p95_ms"], "static_e2e_p95_ms": m["e2e_p95_ms"],
                     "ratio": m["ttft_p95_ms"] / target})
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
        "start": list(settings.start),
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
        "best_live_p95_max_ms": static[static_key(best.rtt, best.queue, {}, seed)].get(
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
        "final_status": {k: trace.status.get(k) for k in ("phase", "sigma", "failures",
                                                          "ignored_samples")},
    }


# --------------------------------------------------------------------------------------- plots


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    return plt


def _num(x: float | None) -> float:
    """A JSON number back as a float (null: not finite, drawn as a gap)."""
    return math.nan if x is None else float(x)


def plot_convergence(runs: Sequence[dict[str, Any]], best: dict[str, Any], tolerance: float,
                     bounds: Sequence[float], path: Path) -> None:
    """Per start (columns): the incumbent's weights, and its static p95 / target, vs samples."""
    plt = _pyplot()
    guarded = [r for r in runs if r["e2e_guard"]]
    starts = list(dict.fromkeys(tuple(r["start"]) for r in guarded))
    seeds = sorted({r["seed"] for r in guarded})
    colors = {s: plt.get_cmap("tab10")(k % 10) for k, s in enumerate(seeds)}
    fig, axes = plt.subplots(3, len(starts), figsize=(6.0 * len(starts), 10.0), squeeze=False,
                             sharex="col")
    for col, start in enumerate(starts):
        top, mid, bottom = axes[0][col], axes[1][col], axes[2][col]
        for r in (r for r in guarded if tuple(r["start"]) == start):
            c = colors[r["seed"]]
            n = [i["samples"] for i in r["incumbents"]] + [r["samples"]]
            for ax, key in ((top, "rtt"), (mid, "queue")):
                ys = [i[key] for i in r["incumbents"]]
                ax.step(n, ys + ys[-1:], where="post", color=c, label=f"seed {r['seed']}")
            ratio = [i["ratio"] for i in r["incumbents"]]
            bottom.step(n, ratio + ratio[-1:], where="post", color=c,
                        label=f"seed {r['seed']} incumbent (static re-run)")
            live = r["live_p95_ms"]
            bottom.plot([x[0] for x in live], [_num(x[1]) / r["target_p95_ms"] for x in live],
                        color=c, linewidth=0.6, alpha=0.5)
            ev = r["evaluations_log"]
            bottom.scatter([e["samples"] for e in ev],
                           [_num(e["p95_candidate"]) / r["target_p95_ms"] for e in ev],
                           s=9, color=c, alpha=0.45, marker="x")
        top.axhline(best["rtt"], color="black", linestyle=":", label="grid best")
        mid.axhline(best["queue"], color="black", linestyle=":", label="grid best")
        bottom.axhline(1.0 + tolerance, color="black", linestyle=":",
                       label=f"grid best + {tolerance:.0%}")
        top.set_title(f"start (w_rtt, w_queue) = ({start[0]:g}, {start[1]:g})")
        top.set_ylabel("incumbent w_rtt")
        mid.set_ylabel("incumbent w_queue")
        bottom.set_ylabel("p95 TTFT / grid best")
        bottom.set_title(f"step: incumbent re-run statically; thin: live traffic (last "
                         f"{LIVE_WINDOW}); x: candidate arm", fontsize=8)
        bottom.set_xlabel("samples (completed requests)")
        for ax in (top, mid, bottom):
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
        for ax in (top, mid):
            ax.set_ylim(bounds[0] / 1.5, bounds[1] * 1.5)
        lo, hi = bottom.get_ylim()
        ticks = [t for t in (RATIO_TICKS if hi / lo < 8 else COARSE_TICKS) if lo <= t <= hi]
        bottom.set_yticks(ticks, [f"{t:g}" for t in ticks])
        bottom.set_yticks([], minor=True)
        top.legend(fontsize=7)
        bottom.legend(fontsize=7)
    fig.subplots_adjust(left=0.08, right=0.98, top=0.96, bottom=0.06, hspace=0.25, wspace=0.2)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_grid(doc: dict[str, Any], path: Path) -> None:
    """Mean p95 TTFT and E2E over seeds on the grid, with the tuned runs' incumbent paths."""
    plt = _pyplot()
    from matplotlib.colors import LogNorm
    from matplotlib.patches import Rectangle

    points, runs, best = doc["grid_points"], doc["runs"], doc["grid_best"]
    k = len(points)
    fig, axes = plt.subplots(1, 2, figsize=(13.0, 5.4))
    for ax, metric, title in ((axes[0], "grid_mean_p95_ms", "p95 TTFT (s)"),
                              (axes[1], "grid_mean_e2e_p95_ms", "p95 E2E (s)")):
        z = np.array([[_num(doc[metric][f"{a!r}|{b!r}"]) / 1e3 for a in points]
                      for b in points])  # rows: w_queue, columns: w_rtt
        edges = np.geomspace(points[0], points[-1], k)
        step = (math.log(points[-1]) - math.log(points[0])) / max(k - 1, 1) / 2
        edges = np.exp(np.concatenate([np.log(edges) - step, [math.log(points[-1]) + step]]))
        norm = LogNorm(vmin=float(np.nanmin(z)), vmax=float(np.nanmax(z)))
        mesh = ax.pcolormesh(edges, edges, z, norm=norm, cmap="viridis_r")
        fig.colorbar(mesh, ax=ax, label=f"mean {title} over seeds")
        for a_i, a in enumerate(points):
            for b_i, b in enumerate(points):
                ax.text(a, b, f"{z[b_i, a_i]:.3g}", ha="center", va="center", fontsize=6,
                        color="white" if norm(z[b_i, a_i]) > 0.55 else "black")
        for r in runs:
            if not r["e2e_guard"]:
                continue
            xs = [i["rtt"] for i in r["incumbents"]]
            ys = [i["queue"] for i in r["incumbents"]]
            ax.plot(xs, ys, "-o", markersize=2.5, linewidth=1.0, color="red", alpha=0.6)
            ax.plot(xs[-1:], ys[-1:], "s", markersize=5, color="red")
        b_a, b_b = points.index(best["rtt"]), points.index(best["queue"])
        ax.add_patch(Rectangle((edges[b_a], edges[b_b]), edges[b_a + 1] - edges[b_a],
                               edges[b_b + 1] - edges[b_b], fill=False, edgecolor="black",
                               linewidth=2.0, label="grid best p95 TTFT"))
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("w_rtt")
        ax.set_ylabel("w_queue")
        ax.set_title(f"{title}; red: incumbents of the tuned runs (square: final)", fontsize=10)
        ax.legend(fontsize=7, loc="lower left")
    fig.subplots_adjust(left=0.06, right=0.93, top=0.93, bottom=0.1, wspace=0.3)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from gorgo.sim.presets import PRESETS

    parser.add_argument("--trace", default="mooncake", metavar="SPEC",
                        help="trace spec as for `gorgo replay` (default: mooncake)")
    parser.add_argument("--fleet", default="paper",
                        help=f"preset ({', '.join(PRESETS)}) or fleet YAML path (default: paper)")
    parser.add_argument("--load", type=float, default=0.8,
                        help="multiple of the fleet capacity, as `gorgo bench sim` (default: 0.8)")
    parser.add_argument("--requests", type=int, default=None, metavar="N",
                        help="first N requests of the trace (default: all)")
    parser.add_argument("--capacity", type=float, default=None, metavar="RPS",
                        help="use this capacity (req/s) instead of searching")
    parser.add_argument("--capacity-cache", type=Path, default=None, metavar="FILE",
                        help="capacity cache shared with `gorgo bench sim` (default: "
                        "capacity.json next to --out)")
    parser.add_argument("--seeds", type=int, default=3, metavar="N",
                        help="seeds 1..N for every grid point and tuned run (default: 3)")
    parser.add_argument("--start", action="append", default=None, metavar="RTT,QUEUE",
                        help="bad starting weights of a tuned run; repeatable (default: "
                        "0.05,20 and 20,0.05)")
    parser.add_argument("--grid", type=int, default=7, metavar="K",
                        help="K x K static weights, log-spaced over the optimiser's bounds "
                        "(default: 7)")
    parser.add_argument("--tolerance", type=float, default=0.05,
                        help="converged: within this fraction of the grid's best p95 "
                        "(default: 0.05)")
    parser.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                        help="override an OptimizerConfig field (YAML value); repeatable")
    parser.add_argument("--calibrate", action="store_true",
                        help="let the tuner calibrate and publish prefill rates (default: off: "
                        "the preset fleets' hints are the engines' true rates, and the grid "
                        "uses them)")
    parser.add_argument("--tick-s", type=float, default=0.5,
                        help="simulated seconds between the tuner's checks, as `gorgo tuner` "
                        "tick_s; 0: after every sample (default: 0.5)")
    parser.add_argument("--publish-delay-s", type=float, default=0.0,
                        help="simulated delay from a proposal to the router applying it")
    parser.add_argument("--skip-null", action="store_true",
                        help="skip the A/A runs (candidate = incumbent) that measure the loop's "
                        "false-accept rate")
    parser.add_argument("--out", type=Path, default=Path("results/bench-tune"), metavar="DIR")
    parser.add_argument("--static-cache", type=Path, default=None, metavar="FILE",
                        help="JSON cache of static runs (default: static_cache.json in --out)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, metavar="J")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite results.md and the figures from --out's results.json")


def parse_start(text: str) -> tuple[float, float]:
    try:
        rtt, queue = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--start: expected RTT,QUEUE, got {text!r}") from None
    if not (rtt > 0 and queue > 0 and math.isfinite(rtt) and math.isfinite(queue)):
        raise ValueError(f"--start: weights must be finite and > 0, got {text!r}")
    return rtt, queue


def optimizer_config(opts: Sequence[str], calibrate: bool) -> OptimizerConfig:
    """Defaults plus ``KEY=VALUE`` overrides, typed and validated like the tuner's YAML."""
    import yaml

    from tuner.optimizer import config_from_mapping

    raw: dict[str, Any] = {}
    for item in opts:
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--opt: expected KEY=VALUE, got {item!r}")
        raw[key.strip()] = yaml.safe_load(value)
    cfg = config_from_mapping(raw, "--opt")
    # The bench keeps every history entry: it reports them all (nothing is persisted).
    return replace(cfg, calibrate=calibrate, history=10**9)


def main(args: argparse.Namespace) -> int:
    from gorgo.sim.bench import Progress, load_workload
    from gorgo.sim.presets import resolve_fleet

    try:
        spec = resolve_fleet(args.fleet)
        starts = [parse_start(s) for s in (args.start or ["0.05,20", "20,0.05"])]
        config = optimizer_config(args.opt, args.calibrate)
        if args.seeds < 1 or args.jobs < 1 or args.grid < 2:
            raise ValueError("--seeds and --jobs must be >= 1, --grid >= 2")
        if not args.load > 0 or not 0 < args.tolerance < 1:
            raise ValueError("--load must be > 0 and --tolerance in (0, 1)")
        if args.tick_s < 0 or args.publish_delay_s < 0:
            raise ValueError("--tick-s and --publish-delay-s must be >= 0")
    except ValueError as exc:
        print(f"bench tune: {exc}", file=sys.stderr)
        return 2
    out: Path = args.out
    if args.report_only:
        try:
            doc = json.loads((out / "results.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            print(f"bench tune: --report-only needs {out / 'results.json'}: {exc}",
                  file=sys.stderr)
            return 2
        print(render(out, doc)["summary_md"])
        return 0
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    workload = load_workload("bench tune", args.trace, spec, args.requests, log)
    if workload is None:
        return 2
    _CTX.update(spec=spec, workload=workload, capacity_workload=workload)
    seeds = list(range(1, args.seeds + 1))
    points = grid_points(config.bounds, args.grid)
    cache_path = args.static_cache or out / "static_cache.json"
    ctx = mp.get_context("fork")
    capacity = _capacity(args, spec, workload, ctx)
    scale = workload.scale_for_rate(args.load * capacity)
    _CTX["scale"] = scale  # before the pool forks: the workers see the whole context
    digest = model_digest()
    slice_key = (f"{args.trace}|{args.fleet}|{spec.name}|n={workload.n}|"
                 f"scale={scale!r}|{POLICY}|code={digest}")
    static = _load_cache(cache_path, slice_key)
    log(f"bench tune: {workload.n} requests at load {args.load:g} = "
        f"{args.load * capacity:.3f} req/s (time scale {scale:.4f}); {len(static)} static runs "
        f"cached")
    settings = []
    for start in starts:
        for seed in seeds:
            base = TuneSettings(config, start, seed, tick_s=args.tick_s,
                                publish_delay_s=args.publish_delay_s)
            settings.append((f"{start[0]:g},{start[1]:g} seed {seed} guard", base))
            settings.append((f"{start[0]:g},{start[1]:g} seed {seed} no-guard",
                             replace(base, config=replace(config, e2e_margin=math.inf))))
    if not args.skip_null:
        for seed in seeds:
            settings.append((f"null seed {seed}", TuneSettings(
                null_config(config), NULL_START, seed, tick_s=args.tick_s,
                publish_delay_s=args.publish_delay_s, null=True)))
    grid_jobs = [(static_key(a, b, {}, s), a, b, (), s) for a in points for b in points
                 for s in seeds]
    tuned: list[tuple[str, TuneSettings, TuneTrace, dict[str, float], float]] = []
    with ctx.Pool(args.jobs) as pool:
        todo = [j for j in grid_jobs if j[0] not in static]
        bar = Progress(len(settings) + len(todo), "bench tune")
        for r in pool.imap_unordered(_tune_job, settings):
            tuned.append(r)
            bar.step(f"{r[0]}: {r[2].samples} samples, {r[4]:.1f} s")
        for key, m in pool.imap_unordered(_static_job, todo):
            static[key] = m
            bar.step(f"grid: {m['wall_s']:.1f} s")
        _save_cache(cache_path, slice_key, static)
        best = grid_best(points, seeds, static)
        reeval = {}
        for seed in seeds:  # the grid best's worst live p95 (older cache entries lack it)
            key = static_key(best.rtt, best.queue, {}, seed)
            if LIVE_MAX not in static[key]:
                reeval[key] = (key, best.rtt, best.queue, (), seed)
        for _, st, trace, _, _ in tuned:
            if st.null:
                continue
            incs = trace.incumbents if math.isfinite(st.config.e2e_margin) else (
                trace.incumbents[-1:])  # without the guard only the final incumbent is needed
            for _, rtt, queue, rates in incs:
                key = static_key(rtt, queue, rates, st.seed)
                if key not in static:
                    reeval[key] = (key, rtt, queue, tuple(sorted(rates.items())), st.seed)
        bar = Progress(len(reeval), "re-run incumbents")
        for key, m in pool.imap_unordered(_static_job, list(reeval.values())):
            static[key] = m
            bar.step(f"{m['wall_s']:.1f} s")
        _save_cache(cache_path, slice_key, static)
    order = {label: k for k, (label, _) in enumerate(settings)}
    tuned.sort(key=lambda r: order[r[0]])
    runs, nulls = [], []
    for label, st, trace, run, _ in tuned:
        if st.null:
            nulls.append(summarize_null(label, st, trace))
            continue
        if not math.isfinite(st.config.e2e_margin):
            trace = replace(trace, incumbents=trace.incumbents[-1:])
        runs.append(summarize_run(label, st, trace, run, static, best, args.tolerance))
    doc = write_outputs(out, args, spec, workload.n, capacity, scale, config, points, seeds,
                        static, best, runs, nulls, digest)
    log(f"bench tune: done in {time.monotonic() - t_start:.0f} s; wrote {out / 'results.md'}")
    print(doc["summary_md"])
    return 0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _capacity(args: argparse.Namespace, spec: FleetSpec, workload: Workload, ctx: Any) -> float:
    """Capacity (req/s) exactly as `gorgo bench sim` defines and caches it."""
    from gorgo.sim.capacity import cache_key, cached_capacity, find_capacity
    from gorgo.sim.presets import PRESETS

    if args.capacity is not None:
        return float(args.capacity)
    label = args.fleet if args.fleet in PRESETS else Path(args.fleet).name
    key = cache_key(args.trace, label, spec, workload.n)
    cache = args.capacity_cache or args.out.parent / "capacity.json"

    def compute() -> Any:
        log(f"bench tune: searching capacity for {key} ...")
        with ctx.Pool(args.jobs) as pool:
            return find_capacity(spec, workload, key=key, jobs=args.jobs,
                                 run_many=lambda rates: pool.map(_probe_job, rates), log=log)

    return cached_capacity(cache, key, compute).rate_rps


def _load_cache(path: Path, slice_key: str) -> dict[str, dict[str, float]]:
    """Static runs of this very slice (trace, fleet, requests, time scale), else nothing."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return dict(doc.get(slice_key, {})) if isinstance(doc, dict) else {}


def _save_cache(path: Path, slice_key: str, static: dict[str, dict[str, float]]) -> None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        doc = {}
    prefix = slice_key.partition("|code=")[0]
    doc = {k: v for k, v in doc.items() if k.partition("|code=")[0] != prefix}  # stale code
    doc[slice_key] = static
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(jsonable(doc)) + "\n")
    tmp.replace(path)


# ------------------------------------------------------------------------------------- outputs




def reproduce_command(args: argparse.Namespace) -> str:
    parts = ["gorgo", "bench", "tune", "--trace", args.trace, "--fleet", str(args.fleet),
             "--load", f"{args.load:g}", "--seeds", str(args.seeds), "--grid", str(args.grid)]
    if args.requests is not None:
        parts += ["--requests", str(args.requests)]
    if args.capacity is not None:
        parts += ["--capacity", str(args.capacity)]
    for s in args.start or []:
        parts += ["--start", s]
    for o in args.opt:
        parts += ["--opt", o]
    if args.calibrate:
        parts.append("--calibrate")
    if args.tick_s != 0.5:
        parts += ["--tick-s", f"{args.tick_s:g}"]
    if args.publish_delay_s:
        parts += ["--publish-delay-s", f"{args.publish_delay_s:g}"]
    if args.tolerance != 0.05:
        parts += ["--tolerance", f"{args.tolerance:g}"]
    parts += ["--out", str(args.out)]
    return " ".join(shlex.quote(p) for p in parts)


def _x(v: float | None, digits: int, unit: float = 1.0) -> str:
    """A number for the tables; null (JSON for +inf: failed requests) shows as ∞."""
    return "∞" if v is None else f"{v / unit:.{digits}f}"


def _ratio(a: float | None, b: float) -> float | None:
    return None if a is None else a / b


def _s(ms: float | None) -> str:
    return "n/a" if ms is None or not math.isfinite(ms) else f"{ms / 1e3:.1f}"


def _samples_text(n: int | None, total: int) -> str:
    return f"not within {total}" if n is None else str(n)


def _median_samples(values: Sequence[int | None], total: int) -> str:
    """Median over seeds, a run that never got there counting as more than any that did."""
    keyed = sorted(values, key=lambda v: math.inf if v is None else v)
    mid = keyed[(len(keyed) - 1) // 2]
    if len(keyed) % 2 == 0:
        hi = keyed[len(keyed) // 2]
        if mid is not None and hi is not None:
            return f"{(mid + hi) / 2:g}"
        return _samples_text(mid, total) if mid is None else f">= {mid}"
    return _samples_text(mid, total)


def summary_markdown(doc: dict[str, Any]) -> str:
    """results.md: setup, the grid, convergence per start and seed, the E2E guard."""
    best = doc["grid_best"]
    points = doc["grid_points"]
    runs = doc["runs"]
    tol = doc["tolerance"]
    guarded = [r for r in runs if r["e2e_guard"]]
    free = {(tuple(r["start"]), r["seed"]): r for r in runs if not r["e2e_guard"]}
    non_default = {k: v for k, v in doc["optimizer"].items()
                   if v != doc["optimizer_defaults"].get(k) and k not in ("history", "calibrate")}
    md = [
        "# gorgo bench tune", "", "```", doc["command"], "```", "",
        f"- trace `{doc['trace']}`, {doc['requests']} requests; fleet `{doc['fleet']}`; load "
        f"{doc['load']:g} x capacity = {doc['rate_rps']:.3f} req/s (capacity "
        f"{doc['capacity_rps']:.3f} req/s as `gorgo bench sim` defines it)",
        f"- seeds {', '.join(map(str, doc['seeds']))}; the tuner asks for weights every "
        f"{doc['tick_s']:g} simulated s, proposals apply after {doc['publish_delay_s']:g} s; "
        f"prefill-rate calibration {'on' if doc['optimizer']['calibrate'] else 'off'}; router "
        f"and simulation code digest `{doc['model_digest']}`",
        "- optimiser: defaults" + (", except " + ", ".join(
            f"`{k}={v}`" for k, v in non_default.items()) if non_default else ""),
        "- samples: completed requests routed by `gorgo`, counted from the start; an incumbent's "
        "p95 is its weights re-run statically on the same slice and seed; converged = every "
        f"incumbent from then on within {tol:.0%} of the grid best's p95 on that seed", "",
        "## Grid: static weights, mean p95 TTFT over seeds (s)", "",
        "| w_rtt \\ w_queue | " + " | ".join(f"{b:.3g}" for b in points) + " |",
        "|---:|" + "---:|" * len(points),
    ]
    for a in points:
        cells = []
        for b in points:
            cell = _x(doc["grid_mean_p95_ms"][f"{a!r}|{b!r}"], 2, 1e3)
            cells.append(f"**{cell}**" if (a, b) == (best["rtt"], best["queue"]) else cell)
        md.append(f"| {a:.3g} | " + " | ".join(cells) + " |")
    within = sum(_num(v) <= (1 + tol) * best["mean_p95_ms"]
                 for v in doc["grid_mean_p95_ms"].values())
    md += [
        "", f"Best: (w_rtt, w_queue) = ({best['rtt']:.3g}, {best['queue']:.3g}), mean p95 TTFT "
        f"{best['mean_p95_ms'] / 1e3:.3f} s (per seed: " + ", ".join(
            f"{v / 1e3:.3f}" for v in best["per_seed_p95_ms"].values()) + " s), p95 E2E "
        + ", ".join(f"{v / 1e3:.1f}" for v in best["per_seed_e2e_ms"].values())
        + f" s; {within} of {len(points) ** 2} grid points are within {tol:.0%} of it.", "",
        "## Convergence from bad weights (E2E guard on)", "",
        "| start | seed | samples until within for good | first within | evaluations "
        f"(accepted; statically worse by > {tol:.0%}) | final incumbent | final p95 / best "
        "| worst candidate p95 (s; x incumbent) "
        f"| worst live p95, last {LIVE_WINDOW} (s; grid best's) | whole run p95 / best "
        "| optimiser converged at |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in guarded:
        f = r["final"]
        worst = r["worst_candidate_p95_ms"]
        wr = r["worst_candidate_vs_incumbent"]
        md.append(
            f"| {r['start'][0]:g}, {r['start'][1]:g} | {r['seed']} | "
            f"{_samples_text(r['stays_within'], r['samples'])} | "
            f"{_samples_text(r['first_within'], r['samples'])} | {r['evaluations']} "
            f"({r['accepted']}; {r['worse_accepts']}) | ({f['rtt']:.3g}, {f['queue']:.3g}) | "
            f"{_x(f['ratio'], 3)} | "
            + ("n/a" if worst is None else f"{worst / 1e3:.1f} ({_x(wr, 2)})") + " | "
            f"{_s(r['live_p95_max_ms'])} ({_s(r['best_live_p95_max_ms'])}) | "
            f"{_x(_ratio(r['run_ttft_p95_ms'], r['target_p95_ms']), 2)} | "
            f"{r['optimizer_converged_at'] or 'no'} |")
    md.append("")
    for start in dict.fromkeys(tuple(r["start"]) for r in guarded):
        rs = [r for r in guarded if tuple(r["start"]) == start]
        med = _median_samples([r["stays_within"] for r in rs], rs[0]["samples"])
        md.append(f"- start ({start[0]:g}, {start[1]:g}): median samples until within "
                  f"{tol:.0%} for good: {med} (of {rs[0]['samples']} per run)")
    if guarded:
        ignored = [r["final_status"]["ignored_samples"] / r["samples"] for r in guarded]
        per_eval = [r["samples"] / r["evaluations"] for r in guarded if r["evaluations"]]
        per_eval_text = f"{np.mean(per_eval):.0f}" if per_eval else "n/a (no evaluation)"
        md.append(f"- {per_eval_text} samples per evaluation on average; "
                  f"{np.mean(ignored):.0%} of all samples counted for no window (routed under a "
                  "warm-up or bridge version, or by an evaluation that was dropped)")
        fitted = sum(r.get("model_evaluations", 0) for r in guarded)
        md.append(f"- fitted-weights candidates: {fitted} evaluated, "
                  f"{sum(r.get('model_accepted', 0) for r in guarded)} accepted, "
                  f"{sum(r.get('extended', 0) for r in guarded)} extensions")
    if guarded:
        levels = list(guarded[0]["stays_within_by_tolerance"])
        md += ["", "Median over seeds of the samples until the incumbent stays within a "
               "tolerance of the grid best, by tolerance:", "",
               "| start | " + " | ".join(f"within {float(lv):.0%}" for lv in levels) + " |",
               "|---|" + "---:|" * len(levels)]
        for start in dict.fromkeys(tuple(r["start"]) for r in guarded):
            rs = [r for r in guarded if tuple(r["start"]) == start]
            md.append(f"| {start[0]:g}, {start[1]:g} | " + " | ".join(
                _median_samples([r["stays_within_by_tolerance"][lv] for r in rs],
                                rs[0]["samples"]) for lv in levels) + " |")
    md += ["", "## The E2E guard: final incumbent re-run statically, guard on vs off", "",
           "| start | seed | p95 E2E on (s) | p95 E2E off (s) | p95 TTFT / best on | "
           "p95 TTFT / best off | rejected for E2E (on) | final weights off |",
           "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in guarded:
        o = free.get((tuple(r["start"]), r["seed"]))
        if o is None:
            continue
        fo = o["final"]
        md.append(
            f"| {r['start'][0]:g}, {r['start'][1]:g} | {r['seed']} | "
            f"{_x(r['final']['static_e2e_p95_ms'], 1, 1e3)} | "
            f"{_x(fo['static_e2e_p95_ms'], 1, 1e3)} "
            f"| {_x(r['final']['ratio'], 3)} | {_x(fo['ratio'], 3)} | "
            f"{r['reasons'].get('e2e_worse', 0)} | ({fo['rtt']:.3g}, {fo['queue']:.3g}) |")
    total = doc.get("null_total")
    if total:
        md += ["", "## False accepts (A/A: every candidate is the incumbent itself)", "",
               f"Weights held at ({NULL_START[0]:g}, {NULL_START[1]:g}); every acceptance is a "
               f"false one. Configured `fpr` {doc['optimizer']['fpr']:g}.", "",
               "| seed | evaluations | accepted | rejected for E2E "
               "| median (p95_c - p95_i) / p95_i |",
               "|---:|---:|---:|---:|---:|"]
        for r in doc["null_runs"]:
            gap = "n/a" if r["median_gap"] is None else f"{r['median_gap']:+.3f}"
            md.append(f"| {r['seed']} | {r['evaluations']} | {r['accepted']} | "
                      f"{r['rejected_for_e2e']} | {gap} |")
        rate = total["rate"]
        md += ["", f"Total: {total['accepted']} of {total['evaluations']} accepted = "
               + ("n/a" if rate is None else f"{rate:.1%}") + " (95 % Wilson interval "
               f"{total['ci95'][0]:.1%} to {total['ci95'][1]:.1%})."]
    md += ["", "![weights and objective against samples](tune_convergence.png)", "",
           "![grid](tune_grid.png)", ""]
    return "\n".join(md)


def write_outputs(
    out: Path, args: argparse.Namespace, spec: FleetSpec, requests: int, capacity: float,
    scale: float, config: OptimizerConfig, points: Sequence[float], seeds: Sequence[int],
    static: dict[str, dict[str, float]], best: GridBest, runs: list[dict[str, Any]],
    nulls: list[dict[str, Any]], digest: str,
) -> dict[str, Any]:
    """results.json, results.md, tune_convergence.png and tune_grid.png in ``out``."""
    mean = {f"{a!r}|{b!r}": float(np.mean([static[static_key(a, b, {}, s)]["ttft_p95_ms"]
                                            for s in seeds])) for a in points for b in points}
    mean_e2e = {f"{a!r}|{b!r}": float(np.mean([static[static_key(a, b, {}, s)]["e2e_p95_ms"]
                                                for s in seeds])) for a in points for b in points}
    doc: dict[str, Any] = {
        "command": reproduce_command(args),
        "trace": args.trace,
        "fleet": str(args.fleet),
        "requests": requests,
        "load": args.load,
        "capacity_rps": capacity,
        "rate_rps": args.load * capacity,
        "time_scale": scale,
        "model_digest": digest,
        "seeds": list(seeds),
        "tick_s": args.tick_s,
        "publish_delay_s": args.publish_delay_s,
        "tolerance": args.tolerance,
        "optimizer": asdict(config),
        "optimizer_defaults": asdict(OptimizerConfig()),
        "grid_points": list(points),
        "grid": {key: {"rtt": a, "queue": b, "seed": s, **static[static_key(a, b, {}, s)]}
                 for a in points for b in points for s in seeds
                 for key in [f"{a!r}|{b!r}|{s}"]},
        "grid_mean_p95_ms": mean,
        "grid_mean_e2e_p95_ms": mean_e2e,
        "grid_best": asdict(best),
        "runs": runs,
        "null_runs": nulls,
        "null_total": null_total(nulls),
    }
    (out / "results.json").write_text(json.dumps(jsonable(doc), indent=1) + "\n")
    return render(out, json.loads((out / "results.json").read_text()))


def render(out: Path, doc: dict[str, Any]) -> dict[str, Any]:
    """results.md and the figures from results.json's content (also for --report-only)."""
    doc["summary_md"] = summary_markdown(doc)
    (out / "results.md").write_text(doc["summary_md"])
    plot_convergence(doc["runs"], doc["grid_best"], doc["tolerance"], doc["optimizer"]["bounds"],
                     out / "tune_convergence.png")
    plot_grid(doc, out / "tune_grid.png")
    return doc
