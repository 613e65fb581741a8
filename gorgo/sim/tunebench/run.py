"""The runs of `gorgo bench tune`: a tuned run (the optimiser in the simulation's loop), static
runs (fixed weights), the worker processes that run them, and the cache of static runs.

A tuned run is the live loop on a virtual clock (see the package docstring); a static run is the
slice simulated under fixed weights and prefill rates, scored as `gorgo bench sim` scores a run.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gorgo.core.decision import Decision
from gorgo.core.fleet import FleetSpec
from gorgo.core.terms import TERMS
from gorgo.core.weights import Weights
from gorgo.sim.capacity import source_digest
from gorgo.sim.offline import RequestRecord, SimResult, Simulation
from gorgo.sim.stats import jsonable
from gorgo.sim.tunebench.points import Point, default_point
from gorgo.sim.tunebench.stats import LIVE_EVERY, LIVE_MAX, LIVE_WINDOW, SLO_MISS, rolling_p95
from gorgo.sim.workload import Workload
from tuner.calibration import CalibrationConfig
from tuner.join import END, FIRST, Join
from tuner.optimizer import OptimizerConfig, Proposal, Tuner
from tuner.samples import Sample

POLICY = "gorgo"
NULL_START: Point = default_point()  # the fleet default: the A/A runs hold it throughout
NO_TTFT_STATUS = 503


# ------------------------------------------------------------------------------ one tuned run


@dataclass(frozen=True)
class TuneSettings:
    """One tuned run: optimiser settings, start, seed, and how the loop around it behaves."""

    config: OptimizerConfig
    start: Point  # weight key -> factor
    seed: int
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    tick_s: float = 0.5  # how often the tuner asks for new weights (simulated seconds)
    publish_delay_s: float = 0.0  # from the tuner's decision to the router applying it
    null: bool = False  # A/A: every candidate is the incumbent, so every acceptance is false
    # Each request's TTFT reaches the tuner at its first token (as the TTFT log's periodic entry
    # does live) and its E2E at its end, through the live `Join`; False: only at its end.
    early: bool = True


class NullTuner(Tuner):
    """Proposes the incumbent itself as the candidate: measures the false-accept rate of the
    whole loop (windows, lag, bursts), not just of `compare` on independent samples."""

    def _sample_candidate(self) -> Point:
        return dict(self.incumbent)


def null_config(config: OptimizerConfig) -> OptimizerConfig:
    """Never converges, so an A/A run evaluates for as long as the slice lasts."""
    return replace(config, min_sigma=1e-300, max_failures=10**9, model_step=False)


@dataclass
class TuneTrace:
    """What one tuned run did, indexed by samples observed so far."""

    samples: int = 0
    errors: int = 0
    # (arrival, when the tuner got it, weights version that routed it, TTFT ms) of every sample
    # (a decision's first: early at its first token, else at its end), in order
    sample_log: list[tuple[float, float, int, float]] = field(default_factory=list)
    # (samples, simulated time, version, weights {key: factor}, arm) for every proposal applied
    published: list[tuple[int, float, int, Point, str]] = field(default_factory=list)
    # (samples, weights {key: factor}, prefill rates) whenever the incumbent or its rates changed
    incumbents: list[tuple[int, Point, dict[str, float]]] = field(default_factory=list)
    # the optimiser's history, each entry stamped with the samples seen when it was written
    history: list[dict[str, Any]] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)


# Simulated seconds as Unix times: a sample starting at 0 read as "start unknown" (the tuner keeps
# 0 for that), so the 10 Mooncake requests at t = 0 lost their place in their window's order.
SIM_EPOCH_S = 1_000_000_000.0


def sample_of(rec: RequestRecord, d: Decision, spec: FleetSpec, now: float,
              early: bool = False) -> Sample:
    """The span a completed request would have exported, as the tuner parses it; ``early``: the
    TTFT log's entry at its first token instead (a 200 with its TTFT, E2E not known yet)."""
    rep = spec.replicas[d.replica]
    ok = (early or rec.status == 200) and math.isfinite(rec.ttft)
    elapsed_ms = (now - rec.arrival) * 1000.0
    if early:
        e2e_ms = math.nan
    else:
        e2e_ms = rec.e2e * 1000.0 if ok and math.isfinite(rec.e2e) else elapsed_ms
    return Sample(
        ttft_ms=rec.ttft * 1000.0 if ok else elapsed_ms,
        e2e_ms=e2e_ms,
        status=200 if early else rec.status if rec.status else NO_TTFT_STATUS,
        replica=rep.name,
        region=rep.region,
        policy=d.policy,
        weights_version=d.weights_version,
        predicted_ttft_ms=_nonneg(d.predicted_ms),
        terms={t.name: _nonneg(d.terms.get(t.name, math.nan)) for t in TERMS},
        uncached_tokens=d.uncached_tokens,
        prompt_tokens=d.prompt_tokens,
        decision_id=d.id,
        end_unix_s=SIM_EPOCH_S + now,
        start_unix_s=SIM_EPOCH_S + rec.arrival,
        retried=rec.replica != d.replica,  # Envoy retried it elsewhere (`sim.offline._retry_to`)
    )


def _nonneg(x: float) -> float:
    return x if math.isfinite(x) and x >= 0 else 0.0


def fleet_for_seed(spec: FleetSpec, seed: int) -> FleetSpec:
    """As `sim.workload.simulate` names it, so tuned and static runs share every random draw."""
    return replace(spec, name=f"{spec.name}/seed{seed}")


def with_weights(spec: FleetSpec, weights: Mapping[str, float],
                 rates: Mapping[str, float] | None = None) -> FleetSpec:
    """The fleet with static weights (weight key -> factor; a key not given takes its default)
    and, where given, prefill-rate hints replaced."""
    rates = rates or {}
    reps = tuple(replace(r, prefill_rate=rates.get(r.name, r.prefill_rate)) for r in spec.replicas)
    return replace(spec, weights=Weights(weights, 0), replicas=reps)


def tuned_run(
    spec: FleetSpec, workload: Workload, scale: float, settings: TuneSettings
) -> tuple[SimResult, TuneTrace]:
    """Run the slice with the optimiser in the loop; see the package docstring."""
    cfg = settings.config
    cls = NullTuner if settings.null else Tuner
    tuner = cls(cfg, initial=settings.start, seed=settings.seed, calibration=settings.calibration,
                hints={r.name: r.prefill_rate for r in spec.replicas})
    spec = fleet_for_seed(with_weights(spec, tuner.incumbent), settings.seed)
    trace = TuneTrace()
    # Live, a decision is forgotten a request timeout after its first record (Envoy has ended it).
    join = Join(spec.timeouts.request_s, clock=lambda: sim.now)

    def admit(rec: RequestRecord, d: Decision, early: bool) -> None:
        if d.policy != cfg.policy:
            return
        s = sample_of(rec, d, spec, sim.now, early)
        kind = join.admit(s)
        if kind == END:
            tuner.observe_end(s)
        if kind != FIRST:
            return
        trace.samples += 1
        trace.errors += not s.ok
        trace.sample_log.append((rec.arrival, sim.now, s.weights_version,
                                 s.ttft_ms if s.ok else math.inf))
        tuner.observe(s)
        if settings.tick_s <= 0:
            ask()

    def on_first_token(rec: RequestRecord, d: Decision) -> None:
        admit(rec, d, early=True)

    def on_complete(rec: RequestRecord, d: Decision) -> None:
        admit(rec, d, early=False)

    def ask() -> None:
        for v in tuner.counting():  # what `gorgo tuner` reads from GET /admin/weights
            tuner.routed(v, sim.router.routed.get(v, {}).get(cfg.policy, 0))
        before = len(tuner.history)
        p = tuner.next_weights(sim.now)
        for entry in tuner.history[before:]:
            trace.history.append({**entry, "samples": trace.samples})
        inc = trace.incumbents[-1] if trace.incumbents else None
        if inc is None or (inc[1], inc[2]) != (tuner.incumbent, tuner.rates):
            trace.incumbents.append((trace.samples, dict(tuner.incumbent), dict(tuner.rates)))
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
        trace.published.append((trace.samples, sim.now, p.weights.version, p.point, p.arm))

    def tick() -> None:
        ask()
        sim.call_at(sim.now + settings.tick_s, tick)

    sim = Simulation(spec, POLICY, seed=settings.seed, on_complete=on_complete,
                     on_first_token=on_first_token if settings.early else None)
    ask()  # the first window opens before the first request
    if settings.tick_s > 0:
        sim.call_at(settings.tick_s, tick)
    res = sim.run((workload.arrivals * scale).tolist(), workload.features,
                  workload.output_tokens, follows=workload.follows)
    trace.status = tuner.status()
    return res, trace


# ---------------------------------------------------------------------------- worker processes

# Set in the parent before the pool forks; read by the workers (shared, not pickled).
_CTX: dict[str, Any] = {}


def static_metrics(
    weights: Mapping[str, float], rates: Mapping[str, float], seed: int
) -> dict[str, float]:
    """p95 TTFT and E2E (and the rest of `sim.bench.run_metrics`) of static weights on the slice."""
    from gorgo.sim.bench import run_metrics
    from gorgo.sim.workload import simulate

    spec: FleetSpec = _CTX["spec"]
    fleet = with_weights(spec, weights, rates)
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
    slo_ms = _CTX.get("slo_ttft_ms", 0.0)
    if slo_ms > 0:  # the slo objective's score: a failed request misses its target too
        out[SLO_MISS] = sum(r.status != 200 or r.ttft * 1000.0 > slo_ms
                            for r in res.records) / max(1, len(res.records))
    out["wall_s"] = time.perf_counter() - t0
    return out


# A static job: (cache key, weights, prefill rates as sorted pairs, seed).
StaticJob = tuple[str, Point, tuple[tuple[str, float], ...], int]


def static_job(job: StaticJob) -> tuple[str, dict[str, float]]:
    key, weights, rates, seed = job
    return key, static_metrics(weights, dict(rates), seed)


def tune_job(job: tuple[str, TuneSettings]) -> Any:
    from gorgo.sim.bench import run_metrics

    label, settings = job
    t0 = time.perf_counter()
    res, trace = tuned_run(_CTX["spec"], _CTX["workload"], _CTX["scale"], settings)
    m, _ = run_metrics(res, _CTX["spec"])
    return label, settings, trace, {k: m[k] for k in ("ttft_p95_ms", "e2e_p95_ms", "failed")}, (
        time.perf_counter() - t0)


def probe_job(rate: float) -> Any:
    from gorgo.sim.capacity import probe

    return probe(_CTX["spec"], _CTX["capacity_workload"], rate)


# --------------------------------------------------------------------------- static-run cache


# Modules whose source decides what a static run measures, besides the capacity search's
# (`source_digest`): the code that scores a run (a change to `run_metrics` reused grids scored
# the old way).
SCORING_MODULES = ("gorgo.sim.bench", "gorgo.sim.tunebench.run", "gorgo.sim.tunebench.stats")


def model_digest() -> str:
    """Digest of the router and simulation source: cached static runs are reused only by the
    same code, so a change to the engine model or a policy never mixes old and new results."""
    return source_digest(SCORING_MODULES, size=8)


def load_cache(path: Path, slice_key: str) -> dict[str, dict[str, float]]:
    """Static runs of this very slice (trace, fleet, requests, time scale), else nothing."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return dict(doc.get(slice_key, {})) if isinstance(doc, dict) else {}


def save_cache(path: Path, slice_key: str, static: dict[str, dict[str, float]]) -> None:
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
