"""Fleet capacity for a (trace, fleet): the load unit of `gorgo bench sim`.

Definition. The trace's arrival times are multiplied by a factor ``s`` (its mix of prompts,
outputs and prefix reuse is untouched); the mean arrival rate is then ``(n - 1) / (s * span)``.
The capacity is the highest mean rate, in requests/s, at which round-robin keeps up: the
blind baseline defines the unit so that it does not depend on the policies being compared.

Stability criterion. A queue that keeps up only holds the work of the latest bursts; one that
does not grows for as long as arrivals continue, and what is left when they stop is the growth.
So, with seed 0, the run at rate ``r`` is *stable* when

1. no request is rejected (an engine refuses requests once ``max_queue`` of them wait), and
2. its *drain*, the time from the last arrival at the router to the last first token (when the
   last prompt left the engines' waiting queues and prefill), exceeds the drain of a reference
   run at 1/20 of the analytic estimate below by at most ``DRAIN_FRACTION`` (5 %) of the
   arrival span. The reference contains what any load pays to drain: the link delay and the
   prefill of the last requests, which the trace often delivers together (Mooncake timestamps
   come in ~3 s steps, up to 28 requests at once). An overload ``rho > 1`` sustained over the
   run leaves about ``(rho - 1) * span`` of excess drain, so the criterion accepts a fleet that
   is overloaded at most ~5 % on average and absorbs its bursts before the trace ends.

Search. The starting point is the analytic estimate: the fleet's summed prefill rate divided by
the mean prompt (no cache hits, no decode cost). Rates are stepped by x1.5 until one stable and
one unstable rate bracket the capacity, then the bracket is narrowed in log space until
``unstable / stable <= 1 + tol``; the capacity is the highest stable rate. With ``jobs`` workers
each round runs ``jobs`` rates at once (bisection when 1). Stability is not exactly monotone in
the rate (a different interleaving of bursts), so the result is a crossing point to within
``tol`` and the seed-0 noise, not a sharp threshold.

Cache. A search costs some ten full runs, so its result is kept in a JSON file keyed by trace,
fleet (name and a digest of its contents), slice length, criterion version and a digest of the
router and simulator code.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from functools import cache
from pathlib import Path

import numpy as np

from gorgo.core.fleet import FleetSpec
from gorgo.sim.profiles import get_profile
from gorgo.sim.workload import Workload, simulate

CRITERION_VERSION = 1
DRAIN_FRACTION = 0.05
REFERENCE_SLOWDOWN = 20.0
STEP = 1.5
BASELINE = "round-robin"
SEED = 0
MAX_ROUNDS = 40
# Simulator modules whose code decides a run's outcome (with all of gorgo/core): the capacity
# probes' and the tune bench's static runs' (`source_digest`). `kv_publish` decides
# a precise fleet's cache hits, `link` the delays: an edit to either reused stale results.
SIM_MODULES = ("offline", "engine", "kv_cache", "kv_publish", "link", "profiles", "traces",
               "workload", "capacity", "routers")


@dataclass(frozen=True)
class Probe:
    """One round-robin run at a mean arrival rate, and what the criterion reads from it."""

    rate_rps: float
    scale: float
    span_s: float  # arrival span after scaling
    drain_s: float  # last first token (engine clock) minus last arrival at the router
    rejected: int
    ttft_p50_s: float
    wall_s: float


@dataclass(frozen=True)
class Capacity:
    rate_rps: float  # highest stable mean arrival rate found
    unstable_rps: float  # lowest unstable one
    estimate_rps: float
    key: str
    requests: int
    reference: Probe | None = None  # None when the capacity was given, not searched
    probes: tuple[Probe, ...] = field(default=())
    criterion: str = (
        f"round-robin, seed {SEED}: no rejection and drain - reference drain <= "
        f"{DRAIN_FRACTION} x arrival span (v{CRITERION_VERSION})"
    )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Capacity:
        d = dict(d)
        d["reference"] = Probe(**d["reference"]) if d.get("reference") else None
        d["probes"] = tuple(Probe(**p) for p in d.get("probes", ()))
        return cls(**d)


def analytic_estimate(spec: FleetSpec, workload: Workload) -> float:
    """Requests/s the fleet could prefill with no cache hit and no decode: an optimistic start."""
    tokens_per_s = 0.0
    for r in spec.replicas:
        if r.sim is None:
            raise ValueError(f"replica {r.name}: capacity needs simulated engines")
        tokens_per_s += 1000.0 / get_profile(r.sim.profile).c_prefill_ms_per_token * r.sim.speed
    return tokens_per_s / max(workload.mean_prompt_tokens, 1.0)


def probe(spec: FleetSpec, workload: Workload, rate_rps: float) -> Probe:
    """Run round-robin at ``rate_rps`` (seed 0) and measure its drain."""
    scale = workload.scale_for_rate(rate_rps)
    t0 = time.perf_counter()
    res = simulate(spec, BASELINE, workload, scale, SEED)
    wall = time.perf_counter() - t0
    last_arrival = float(workload.arrivals[-1]) * scale
    served = res.served()
    last_first = max((r.first_at for r in served), default=math.nan)
    ttft = [r.ttft for r in served]
    return Probe(
        rate_rps=rate_rps,
        scale=scale,
        span_s=workload.span_s * scale,
        drain_s=float(last_first - last_arrival),
        rejected=len(res.records) - len(served),
        ttft_p50_s=float(np.median(ttft)) if ttft else math.nan,
        wall_s=wall,
    )


def is_stable(p: Probe, reference: Probe) -> bool:
    """The criterion of the module docstring."""
    if p.rejected or not math.isfinite(p.drain_s):
        return False
    return p.drain_s - reference.drain_s <= DRAIN_FRACTION * p.span_s


RunMany = Callable[[Sequence[float]], list[Probe]]


def find_capacity(
    spec: FleetSpec,
    workload: Workload,
    *,
    key: str = "",
    tol: float = 0.02,
    jobs: int = 1,
    run_many: RunMany | None = None,
    log: Callable[[str], None] | None = None,
) -> Capacity:
    """Search the capacity (see the module docstring); ``run_many`` probes rates in parallel."""
    if run_many is None:
        def run_many(rates: Sequence[float]) -> list[Probe]:
            return [probe(spec, workload, r) for r in rates]
    estimate = analytic_estimate(spec, workload)
    (reference,) = run_many([estimate / REFERENCE_SLOWDOWN])
    if not is_stable(reference, reference):
        raise RuntimeError(
            f"{key}: round-robin is unstable even at {reference.rate_rps:.3g} req/s "
            f"({reference.rejected} rejected): the fleet cannot serve this trace")
    m = max(1, jobs)
    probes: list[Probe] = []
    lo: float | None = None
    hi: float | None = None
    for _ in range(MAX_ROUNDS):
        if lo is not None and hi is not None and hi / lo <= 1.0 + tol:
            break
        if lo is None and hi is None:
            rates = [estimate * STEP ** (j - (m - 1) / 2) for j in range(m)]
        elif hi is None:
            rates = [lo * STEP ** (j + 1) for j in range(m)]
        elif lo is None:
            rates = [hi / STEP ** (j + 1) for j in range(m)]
        else:
            ratio = math.log(hi / lo)
            rates = [lo * math.exp(ratio * (j + 1) / (m + 1)) for j in range(m)]
        new = run_many(rates)
        probes.extend(new)
        for p in new:
            if log is not None:
                verdict = "stable" if is_stable(p, reference) else "unstable"
                log(f"capacity: {p.rate_rps:.3f} req/s drain {p.drain_s:.1f} s "
                    f"rejected {p.rejected} -> {verdict}")
        lo, hi = _bracket(probes, reference)
    else:
        raise RuntimeError(f"{key}: capacity search did not converge in {MAX_ROUNDS} rounds")
    assert lo is not None and hi is not None
    return Capacity(rate_rps=lo, unstable_rps=hi, estimate_rps=estimate, key=key,
                    requests=workload.n, reference=reference, probes=tuple(probes))


def _bracket(probes: list[Probe], reference: Probe) -> tuple[float | None, float | None]:
    """(highest stable rate below the lowest unstable one, lowest unstable rate)."""
    unstable = [p.rate_rps for p in probes if not is_stable(p, reference)]
    hi = min(unstable) if unstable else None
    stable = [p.rate_rps for p in probes
              if is_stable(p, reference) and (hi is None or p.rate_rps < hi)]
    return (max(stable) if stable else None), hi


def fleet_digest(spec: FleetSpec) -> str:
    """A short digest of everything in the fleet that may change its capacity: all of it but
    its name and the policy and objective the probe replaces (shedding, weights and penalties
    once shared a key with the fleet without them, though its probe refused requests)."""
    text = repr({f.name: getattr(spec, f.name) for f in fields(spec)
                 if f.name not in ("name", "policy", "objective")})
    return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


def source_digest(extra: Sequence[str] = (), size: int = 6) -> str:
    """A short digest of the source that decides a simulated run: all of gorgo/core, the
    simulator's `SIM_MODULES` and the ``extra`` modules (import names, found as imported).

    The simulator is still being refined; a change to it changes the capacity and the static
    runs, and a cache entry from older code must not be reused. Each file is keyed by its path
    under the gorgo package, as named, not as found.
    """
    root = Path(__file__).resolve().parents[1]  # the gorgo package
    h = hashlib.blake2b(digest_size=size)
    for f in sorted((root / "core").rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode())
        h.update(f.read_bytes())
    for name in (*(f"gorgo.sim.{m}" for m in SIM_MODULES), *extra):
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin:
            raise ModuleNotFoundError(name)
        h.update((name.removeprefix("gorgo.").replace(".", "/") + ".py").encode())
        h.update(Path(spec.origin).read_bytes())
    return h.hexdigest()


@cache
def code_digest() -> str:
    """The capacity probes' digest: the router core and the simulator. Read once per process:
    a process runs the code it loaded, whatever is edited on disk meanwhile."""
    return source_digest()


def workload_digest(workload: Workload) -> str:
    """What a window's requests are (arrivals, prompts and their blocks, bounds, outputs), not
    what the trace is called: a trace file rewritten in place (or $GORGO_TRACES pointing
    elsewhere) kept its key, and a capacity found for other prompts scaled every load."""
    h = hashlib.blake2b(digest_size=6)
    h.update(np.asarray(workload.arrivals, dtype=float).tobytes())
    h.update(np.asarray(workload.output_tokens, dtype=np.int64).tobytes())
    for f in workload.features:
        h.update(f.prompt_tokens.to_bytes(8, "little"))
        # what the client says of its output (the router reads it; `--trace NAME:max_tokens=`)
        h.update((-1 if f.max_tokens is None else f.max_tokens).to_bytes(8, "little", signed=True))
        h.update(np.asarray(f.block_hashes, dtype=np.uint64).tobytes())
    if workload.follows is not None:  # turns that wait for their answers (open: as before)
        h.update(np.asarray([-1 if p is None else p for p in workload.follows],
                            dtype=np.int64).tobytes())
    return h.hexdigest()


def cache_key(workload: Workload, fleet_label: str, spec: FleetSpec) -> str:
    return (f"{workload.trace}|{fleet_label}:{fleet_digest(spec)}|n={workload.n}"
            f"|w:{workload_digest(workload)}|v{CRITERION_VERSION}|code:{code_digest()}")


def cached_capacity(path: Path, key: str, compute: Callable[[], Capacity]) -> Capacity:
    """The capacity stored under ``key`` in the JSON file ``path``, else computed and stored."""
    table: dict = {}
    if path.exists():
        try:
            table = json.loads(path.read_text())
        except json.JSONDecodeError:
            table = {}
    if key in table:
        return Capacity.from_dict(table[key])
    cap = compute()
    table[key] = cap.to_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
    return cap
