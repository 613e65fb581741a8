"""`gorgo bench sim`: rank every routing policy in the offline simulation, with 95 % CIs over seeds.

One trace slice is parsed into request features once; every (policy, seed, load) run replays those
same objects on a fresh simulated fleet in a worker process (forked, so the features are shared,
not copied or pickled). Load L scales the trace's arrival times so its mean rate is L times the
fleet's capacity (`sim.capacity`), searched once and cached per trace, fleet, slice and
simulator code.

Statistics. A failed request (rejected by a full engine queue or for its size) counts as never
getting its first token: its TTFT and E2E are +inf, so a policy cannot look fast by dropping the
slow requests, and a percentile above the served fraction is reported as unbounded. Every number
is computed per run; across seeds the table shows mean ± t(0.975, n-1) * sd / sqrt(n).
Seeds change the link jitter and every policy RNG; they do not change the trace.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats as sstats

from gorgo.core.fleet import FleetSpec
from gorgo.core.policies import REGISTRY
from gorgo.errors import UserError
from gorgo.progress import StatusLine
from gorgo.sim.capacity import Capacity, cache_key, cached_capacity, find_capacity, probe
from gorgo.sim.offline import SimResult
from gorgo.sim.presets import PRESETS, resolve_fleet
from gorgo.sim.profiles import get_profile
from gorgo.sim.stats import jsonable, percentile
from gorgo.sim.traces import load_trace
from gorgo.sim.workload import (
    ORACLE,
    Workload,
    simulate,
    tokenization,
    workload_from_requests,
)

DEFAULT_LOADS = (0.5, 0.8, 0.95)
GOAL_LOAD = 0.8
GORGO = "gorgo"
# Metrics per run: key -> (table header, unit); the table shows them in this order.
TABLE_METRICS: dict[str, tuple[str, str]] = {
    "ttft_p50_ms": ("TTFT p50", "ms"),
    "ttft_p95_ms": ("TTFT p95", "ms"),
    "ttft_p99_ms": ("TTFT p99", "ms"),
    "e2e_p95_ms": ("E2E p95", "ms"),
    "itl_p50_ms": ("ITL p50", "ms"),
    "cache_hit": ("cache hit", "%"),
    "failed": ("failed", "%"),
}

TTFT_FILE = "ttft_ms.npz"

# Set in the parent before the pool forks; read by the workers.
_CTX: dict[str, Any] = {}


# --------------------------------------------------------------------------- per-run metrics


def _pct(values: np.ndarray, q: float) -> float:
    """Percentile with +inf for failed requests; ``sim.stats`` defines it when none failed."""
    if values.size == 0:
        return math.nan
    if np.isfinite(values).all():
        return float(percentile(values, q))
    finite = np.where(np.isfinite(values), values, 1e300)
    p = float(np.percentile(finite, q))
    return math.inf if p >= 1e299 else p


def run_metrics(res: SimResult, spec: FleetSpec) -> tuple[dict[str, float], np.ndarray]:
    """The per-run numbers of the table (plus diagnostics) and the TTFT of every request (ms)."""
    recs = res.records
    n = len(recs)
    ok = np.array([r.status == 200 for r in recs], dtype=bool)
    ttft = np.array([r.ttft * 1000.0 if r.status == 200 else math.inf for r in recs])
    e2e = np.array([r.e2e * 1000.0 if r.status == 200 else math.inf for r in recs])
    served = [r for r in recs if r.status == 200]
    itl = np.array([r.itl * 1000.0 for r in served if math.isfinite(r.itl)])
    prompt = sum(r.prompt_tokens for r in served)
    cached = sum(r.cached_tokens for r in served)
    # Queueing estimate: TTFT minus the link's mean RTT and the uncached prefill at full speed.
    rtt = {reg.name: reg.rtt_ms for reg in spec.regions}
    ms_tok = [get_profile(r.sim.profile).c_prefill_ms_per_token / r.sim.speed
              if r.sim else 0.0 for r in spec.replicas]
    wait = np.array([
        max(0.0, r.ttft * 1000.0 - rtt[spec.replicas[r.replica].region]
            - (r.prompt_tokens - r.cached_tokens) * ms_tok[r.replica])
        for r in served])
    m: dict[str, float] = {
        "requests": float(n),
        "failed": 100.0 * float((~ok).sum()) / n if n else 0.0,
        "shed": float(res.extra.get("shed", 0)),
        "ttft_mean_ms": float(ttft.mean()) if n else math.nan,
        "ttft_p50_ms": _pct(ttft, 50),
        "ttft_p90_ms": _pct(ttft, 90),
        "ttft_p95_ms": _pct(ttft, 95),
        "ttft_p99_ms": _pct(ttft, 99),
        "e2e_p50_ms": _pct(e2e, 50),
        "e2e_p95_ms": _pct(e2e, 95),
        "itl_p50_ms": _pct(itl, 50),
        "itl_p95_ms": _pct(itl, 95),
        "cache_hit": 100.0 * cached / prompt if prompt else 0.0,
        "wait_p50_ms": _pct(wait, 50),
        "wait_p95_ms": _pct(wait, 95),
    }
    region_of = [res.regions[res.replica_region[r.replica]] if r.replica >= 0 else None
                 for r in recs]
    for reg in res.regions:
        m[f"share_{reg}"] = 100.0 * sum(x == reg for x in region_of) / n if n else 0.0
        sel = np.array([t for t, x in zip(ttft, region_of, strict=True) if x == reg])
        if sel.size:
            m[f"ttft_p95_ms_{reg}"] = _pct(sel, 95)
            m[f"e2e_p95_ms_{reg}"] = _pct(
                np.array([t for t, x in zip(e2e, region_of, strict=True) if x == reg]), 95)
        there = np.array([r.itl * 1000.0 for r, x in zip(recs, region_of, strict=True)
                          if x == reg and r.status == 200 and math.isfinite(r.itl)])
        if there.size:
            m[f"itl_p50_ms_{reg}"] = _pct(there, 50)
    for i, rep in enumerate(spec.replicas):
        m[f"share_replica_{rep.name}"] = (
            100.0 * sum(r.replica == i for r in recs) / n if n else 0.0)
    return m, ttft


# ------------------------------------------------------------------------------ statistics


@dataclass(frozen=True)
class Stat:
    """Mean over seeds with its 95 % confidence interval (Student t)."""

    mean: float
    sd: float
    n: int
    ci95: float  # half width; inf when n < 2 or a value is unbounded

    @property
    def lo(self) -> float:
        return self.mean - self.ci95

    @property
    def hi(self) -> float:
        return self.mean + self.ci95

    def to_dict(self) -> dict[str, float | int | None]:
        return {k: _json_num(v) for k, v in (("mean", self.mean), ("sd", self.sd), ("n", self.n),
                                              ("ci95", self.ci95), ("lo", self.lo),
                                              ("hi", self.hi))}


def ci95(values: Sequence[float]) -> Stat:
    arr = np.asarray([v for v in values if not math.isnan(v)], dtype=float)
    n = int(arr.size)
    if n == 0:
        return Stat(math.nan, math.nan, 0, math.nan)
    if not np.isfinite(arr).all():
        return Stat(math.inf, math.nan, n, math.inf)
    mean = float(arr.mean())
    if n < 2:
        return Stat(mean, math.nan, n, math.inf)
    sd = float(arr.std(ddof=1))
    return Stat(mean, sd, n, float(sstats.t.ppf(0.975, n - 1)) * sd / math.sqrt(n))


def aggregate(runs: Iterable[dict]) -> dict[str, dict[str, dict[str, Stat]]]:
    """{load: {policy: {metric: Stat}}} over the seeds of each (load, policy)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        groups.setdefault((_load_key(r["load"]), r["policy"]), []).append(r["metrics"])
    out: dict[str, dict[str, dict[str, Stat]]] = {}
    for (load, policy), ms in groups.items():
        keys = sorted(set().union(*ms))
        out.setdefault(load, {})[policy] = {
            k: ci95([m.get(k, math.nan) for m in ms]) for k in keys}
    return out


def _load_key(load: float) -> str:
    return f"{load:g}"


def _json_num(v: float | int) -> float | int | None:
    if isinstance(v, int):
        return v
    return v if math.isfinite(v) else None


# ---------------------------------------------------------------------------- goal check


def goal_check(agg: dict[str, dict[str, dict[str, Stat]]], load: str) -> dict[str, Any] | None:
    """The acceptance goal at one load: gorgo against the best baseline and against oracle.

    Baselines are every policy but gorgo and oracle; "best" is the lowest mean of the metric at
    hand, so the E2E comparison is against the best E2E whichever policy has it.
    """
    pols = agg.get(load, {})
    if GORGO not in pols:
        return None
    base = {p: v for p, v in pols.items() if p not in (GORGO, ORACLE)}
    g = pols[GORGO]
    out: dict[str, Any] = {"load": load}
    if base:
        bt = min(base, key=lambda p: base[p]["ttft_p95_ms"].mean)
        be = min(base, key=lambda p: base[p]["e2e_p95_ms"].mean)
        gt, bt_s = g["ttft_p95_ms"], base[bt]["ttft_p95_ms"]
        ge, be_s = g["e2e_p95_ms"], base[be]["e2e_p95_ms"]
        out["best_ttft_baseline"] = bt
        out["ttft_p95_reduction"] = _json_num(1.0 - gt.mean / bt_s.mean)
        out["ttft_p95_cis_disjoint"] = bool(gt.hi < bt_s.lo)
        out["ttft_p95_goal_met"] = bool(
            gt.mean <= 0.8 * bt_s.mean and out["ttft_p95_cis_disjoint"])
        out["best_e2e_baseline"] = be
        out["e2e_p95_ratio"] = _json_num(ge.mean / be_s.mean)
        out["e2e_p95_goal_met"] = bool(ge.mean <= 1.05 * be_s.mean)
    if ORACLE in pols:
        o = pols[ORACLE]["ttft_p95_ms"]
        out["ttft_p95_vs_oracle"] = _json_num(g["ttft_p95_ms"].mean / o.mean)
        out["oracle_goal_met"] = bool(g["ttft_p95_ms"].mean <= 1.15 * o.mean)
    return out


# ---------------------------------------------------------------------------------- report


def _fmt(s: Stat, unit: str) -> str:
    if s.n == 0 or math.isnan(s.mean):
        return "n/a"
    if math.isinf(s.mean):
        return "∞"
    digits = 0 if abs(s.mean) >= 100 else 1
    if unit == "%":
        digits = 1
    ci = "" if math.isinf(s.ci95) or math.isnan(s.ci95) else f" ± {s.ci95:.{digits}f}"
    return f"{s.mean:.{digits}f}{ci}"


def ranked(pols: dict[str, dict[str, Stat]]) -> list[str]:
    """Policies by mean p95 TTFT, then p50 (unbounded last)."""
    return sorted(pols, key=lambda p: (pols[p]["ttft_p95_ms"].mean, pols[p]["ttft_p50_ms"].mean))


def markdown_tables(agg: dict[str, dict[str, dict[str, Stat]]], regions: list[str]) -> str:
    """One table per load, policies ranked by p95 TTFT; cells are mean ± 95 % CI half width."""
    lines: list[str] = []
    for load in sorted(agg, key=float):
        pols = agg[load]
        heads = [f"{h} ({u})" for h, u in TABLE_METRICS.values()]
        heads += [f"{r} (%)" for r in regions]
        lines += [f"### Load {load}", "",
                  "| # | policy | " + " | ".join(heads) + " |",
                  "|---:|---|" + "---:|" * len(heads)]
        for rank, p in enumerate(ranked(pols), 1):
            cells = [_fmt(pols[p][k], u) for k, (_, u) in TABLE_METRICS.items()]
            cells += [_fmt(pols[p].get(f"share_{r}", ci95([])), "%") for r in regions]
            lines.append(f"| {rank} | {p} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def goal_text(goal: dict[str, Any] | None) -> str:
    if goal is None:
        return "Goal check: gorgo was not run.\n"

    def pct(v: float | None) -> str:
        return "n/a" if v is None else f"{100 * v:.1f} %"

    lines = [f"Goal check at load {goal['load']}:", ""]
    if "best_ttft_baseline" in goal:
        lines.append(
            f"- p95 TTFT {pct(goal['ttft_p95_reduction'])} below the best baseline "
            f"({goal['best_ttft_baseline']}); 95 % CIs "
            f"{'disjoint' if goal['ttft_p95_cis_disjoint'] else 'overlap'} "
            f"(goal: >= 20 % with disjoint CIs): "
            f"{'met' if goal['ttft_p95_goal_met'] else 'NOT met'}")
        ratio = goal["e2e_p95_ratio"]
        lines.append(
            f"- E2E p95 {'n/a' if ratio is None else f'{ratio:.3f}'} x the best baseline's "
            f"({goal['best_e2e_baseline']}) (goal: <= 1.05): "
            f"{'met' if goal['e2e_p95_goal_met'] else 'NOT met'}")
    if "ttft_p95_vs_oracle" in goal:
        ratio = goal["ttft_p95_vs_oracle"]
        lines.append(
            f"- p95 TTFT {'n/a' if ratio is None else f'{ratio:.3f}'} x oracle's "
            f"(goal: <= 1.15): {'met' if goal['oracle_goal_met'] else 'NOT met'}")
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------------------------- workers


def _run_job(job: tuple[str, int, float, float]) -> dict[str, Any]:
    policy, seed, load, scale = job
    spec: FleetSpec = _CTX["spec"]
    workload: Workload = _CTX["workload"]
    t0 = time.perf_counter()
    res = simulate(spec, policy, workload, scale, seed)
    wall = time.perf_counter() - t0
    metrics, ttft = run_metrics(res, spec)
    return {
        "policy": policy, "seed": seed, "load": load, "time_scale": scale,
        "wall_s": wall, "events": res.events, "sim_time_s": res.sim_time_s,
        "leaked_inflight": res.leaked_inflight, "metrics": metrics,
        "ttft_ms": ttft.astype(np.float32),
    }


def _probe_job(rate: float) -> Any:
    return probe(_CTX["spec"], _CTX["capacity_workload"], rate)


class Progress:
    """A progress bar on stderr (a gorgo.progress.StatusLine: plain periodic lines off a tty)."""

    def __init__(self, total: int, label: str) -> None:
        self.total = total
        self.label = label
        self.done = 0
        self.t0 = time.monotonic()
        self.status = StatusLine(sys.stderr)

    def step(self, note: str = "") -> None:
        self.done += 1
        el = time.monotonic() - self.t0
        eta = el / self.done * (self.total - self.done)
        width = 30
        fill = int(width * self.done / max(self.total, 1))
        bar = "#" * fill + "." * (width - fill)
        line = (f"{self.label} [{bar}] {self.done}/{self.total} {_clock(el)} elapsed, "
                f"eta {_clock(eta)} {note}")
        (self.status.done if self.done >= self.total else self.status.update)(line)


def _clock(s: float) -> str:
    s = int(s)
    return f"{s // 60}:{s % 60:02d}"


# ------------------------------------------------------------------------------------ CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", default="mooncake", metavar="SPEC",
                        help="trace spec as for `gorgo replay` (default: mooncake)")
    parser.add_argument("--fleet", default="paper",
                        help=f"preset ({', '.join(PRESETS)}) or fleet YAML path (default: paper)")
    parser.add_argument("--policies", default="all",
                        help="all | comma-separated names (registry policies and oracle)")
    parser.add_argument("--seeds", type=int, default=5, metavar="N",
                        help="seeds 1..N per (policy, load) (default: 5)")
    parser.add_argument("--load", default=",".join(map(str, DEFAULT_LOADS)),
                        help="comma-separated multiples of the fleet capacity (default: "
                        "0.5,0.8,0.95)")
    parser.add_argument("--requests", type=int, default=None, metavar="N",
                        help="first N requests of the trace (default: all)")
    parser.add_argument("--capacity-requests", type=int, default=None, metavar="N",
                        help="slice the capacity search runs on (default: --requests)")
    parser.add_argument("--capacity", type=float, default=None, metavar="RPS",
                        help="use this capacity (req/s) instead of searching")
    parser.add_argument("--capacity-cache", type=Path, default=None, metavar="FILE",
                        help="JSON cache of searched capacities (default: capacity.json next to "
                        "--out)")
    parser.add_argument("--out", type=Path, default=Path("results/bench-sim"), metavar="DIR",
                        help="where results.md, results.json, the plots and ttft_ms.npz go "
                        "(default: results/bench-sim)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, metavar="J",
                        help="worker processes (default: CPU count)")
    parser.add_argument("--write-docs", type=Path, default=None, metavar="FILE.md",
                        help="also put the table and plots into FILE.md (between markers named "
                        "after --out) and its img/ folder")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite results.md and the plots from --out's results.json and "
                        "ttft_ms.npz without simulating")


def parse_policies(arg: str) -> list[str]:
    known = [*REGISTRY, ORACLE]
    if arg.strip() == "all":
        return known
    names = [p.strip() for p in arg.split(",") if p.strip()]
    bad = [p for p in names if p not in known]
    if bad or not names:
        raise ValueError(f"unknown policy {', '.join(bad) or arg!r} (known: {', '.join(known)})")
    return list(dict.fromkeys(names))


def parse_loads(arg: str) -> list[float]:
    try:
        loads = [float(x) for x in arg.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--load: expected numbers, got {arg!r}") from None
    if not loads or any(not x > 0 for x in loads):
        raise ValueError("--load: need one or more positive multiples of capacity")
    return sorted(set(loads))


def main(args: argparse.Namespace) -> int:
    try:
        policies = parse_policies(args.policies)
        loads = parse_loads(args.load)
        spec = resolve_fleet(args.fleet)
        if args.seeds < 1 or args.jobs < 1:
            raise ValueError("--seeds and --jobs must be >= 1")
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if args.report_only:
        return report_only(args, spec)
    log = _logger()
    machine: dict[str, Any] = {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg()[0]}
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    workload = load_workload("bench sim", args.trace, spec, args.requests, log)
    cap_n = min(args.capacity_requests or workload.n, workload.n)
    _CTX.update(spec=spec, workload=workload, capacity_workload=workload.head(cap_n))
    log(f"bench sim: {workload.n} requests, mean {workload.mean_rate_rps:.3f} req/s at scale 1, "
        f"features in {time.monotonic() - t_start:.1f} s")
    ctx = mp.get_context("fork")
    with ctx.Pool(args.jobs) as pool:
        capacity = _capacity(args, spec, workload.head(cap_n), pool, log)
        log(f"bench sim: capacity {capacity.rate_rps:.3f} req/s ({capacity.key})")
        jobs = [(p, seed, load, workload.scale_for_rate(load * capacity.rate_rps))
                for load in sorted(loads, reverse=True) for p in policies
                for seed in range(1, args.seeds + 1)]
        runs = []
        bar = Progress(len(jobs), "bench sim")
        for r in pool.imap_unordered(_run_job, jobs):
            runs.append(r)
            bar.step(f"{r['policy']} seed {r['seed']} load {r['load']:g}: "
                     f"{r['wall_s']:.1f} s")
    machine["loadavg_end"] = os.getloadavg()[0]
    write_outputs(out, args, spec, workload, capacity, policies, loads, runs, machine)
    log(f"bench sim: {len(runs)} runs in {time.monotonic() - t_start:.0f} s; wrote "
        f"{out / 'results.md'}, results.json and plots")
    return 0


def load_workload(cmd: str, trace: str, spec: FleetSpec, requests: int | None,
                  log: Callable[[str], None]) -> Workload:
    """The trace's request features for ``spec``; UserError ``cannot load ...`` if the trace
    cannot be used (a bench exits 2 on it rather than with a traceback)."""
    try:
        reqs = load_trace(trace)[:requests]  # first: a bad trace fails before any progress line
        log(f"{cmd}: building request features for {trace} ({len(reqs)} requests) ...")
        workload = workload_from_requests(trace, reqs, tokenization(spec))
        _ = workload.mean_rate_rps
    except (ValueError, OSError) as exc:
        raise UserError(f"cannot load {trace!r}: {exc}") from None
    return workload


def _capacity(args: argparse.Namespace, spec: FleetSpec, workload: Workload, pool: Any,
              log: Callable[[str], None]) -> Capacity:
    label = args.fleet if args.fleet in PRESETS else Path(args.fleet).name
    key = cache_key(args.trace, label, spec, workload.n)
    if args.capacity is not None:
        return Capacity(rate_rps=args.capacity, unstable_rps=math.nan, estimate_rps=math.nan,
                        key=f"{key}|given", requests=workload.n)
    cache = args.capacity_cache or args.out.parent / "capacity.json"

    def compute() -> Capacity:
        log(f"bench sim: searching capacity for {key} ...")
        return find_capacity(spec, workload, key=key, jobs=args.jobs,
                             run_many=lambda rates: pool.map(_probe_job, rates), log=log)

    return cached_capacity(cache, key, compute)


def _logger() -> Callable[[str], None]:
    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)
    return log


# --------------------------------------------------------------------------------- outputs


@dataclass(frozen=True)
class WorkloadInfo:
    """What the report needs of a workload, as stored in results.json."""

    n: int
    mean_rate_rps: float


def _run_key(r: dict[str, Any]) -> str:
    return f"{r['policy']}|{r['seed']}|{r['load']:g}"


def report_only(args: argparse.Namespace, spec: FleetSpec) -> int:
    """Rewrite results.md and the plots from a finished bench's results.json and ttft_ms.npz."""
    try:
        doc = json.loads((args.out / "results.json").read_text())
        with np.load(args.out / TTFT_FILE) as npz:
            ttft = {k: npz[k] for k in npz.files}
    except (OSError, ValueError) as exc:
        raise UserError(f"--report-only needs a finished bench's results in {args.out}: "
                        f"{exc}") from None
    runs = []
    for r in doc["runs"]:
        # null is a non-finite number: +inf for latencies (failed requests), else NaN.
        r["metrics"] = {k: (math.inf if k.startswith(("ttft_", "e2e_")) else math.nan)
                        if v is None else v for k, v in r["metrics"].items()}
        r["ttft_ms"] = ttft[_run_key(r)]
        runs.append(r)
    info = WorkloadInfo(doc["requests"], doc["trace_rate_rps"])
    cap = Capacity.from_dict(doc["capacity"])
    write_outputs(args.out, args, spec, info, cap, doc["policies"], doc["loads"], runs,
                  doc.get("machine"))
    return 0


def reproduce_command(args: argparse.Namespace) -> str:
    """The CLI line that reproduces this bench (capacity from the same search and cache)."""
    parts = ["gorgo", "bench", "sim", "--trace", args.trace, "--fleet", str(args.fleet),
             "--policies", args.policies, "--seeds", str(args.seeds), "--load", args.load]
    if args.requests is not None:
        parts += ["--requests", str(args.requests)]
    if args.capacity_requests is not None:
        parts += ["--capacity-requests", str(args.capacity_requests)]
    if args.capacity is not None:
        parts += ["--capacity", str(args.capacity)]
    parts += ["--out", str(args.out), "--jobs", str(args.jobs)]
    if args.write_docs is not None:
        parts += ["--write-docs", str(args.write_docs)]
    return " ".join(shlex.quote(p) for p in parts)




def write_outputs(
    out: Path,
    args: argparse.Namespace,
    spec: FleetSpec,
    workload: Workload | WorkloadInfo,
    capacity: Capacity,
    policies: list[str],
    loads: list[float],
    runs: list[dict[str, Any]],
    machine: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """results.md, results.json, the plots and ttft_ms.npz (for --report-only) in ``out``."""
    from gorgo.sim import plots  # matplotlib only when writing

    runs = sorted(runs, key=lambda r: (r["load"], policies.index(r["policy"]), r["seed"]))
    agg = aggregate(runs)
    goal_load = _load_key(GOAL_LOAD) if GOAL_LOAD in loads else _load_key(loads[-1])
    goal = goal_check(agg, goal_load)
    regions = spec.region_names
    walls: dict[str, list[float]] = {}
    for r in runs:
        walls.setdefault(r["policy"], []).append(r["wall_s"])
    command = reproduce_command(args)
    doc = {
        "command": command,
        "trace": args.trace,
        "fleet": {"name": str(args.fleet), "replicas": [
            {"name": r.name, "region": r.region, "profile": r.sim.profile if r.sim else None,
             "speed": r.sim.speed if r.sim else None} for r in spec.replicas],
            "regions": {g.name: {"rtt_ms": g.rtt_ms, "jitter_ms": g.jitter_ms}
                        for g in spec.regions}},
        "requests": workload.n,
        "trace_rate_rps": workload.mean_rate_rps,
        "capacity": capacity.to_dict(),
        "loads": loads,
        "policies": policies,
        "seeds": sorted({r["seed"] for r in runs}),
        "runs": [{k: v for k, v in r.items() if k != "ttft_ms"} for r in runs],
        "aggregate": {load: {p: {k: s.to_dict() for k, s in ms.items()}
                             for p, ms in pols.items()} for load, pols in agg.items()},
        "ranking": {load: ranked(pols) for load, pols in agg.items()},
        "goal": goal,
        "wall_s_per_run": {p: {"mean": float(np.mean(w)), "max": float(np.max(w))}
                           for p, w in walls.items()},
        "machine": machine or {"cpus": None, "loadavg_start": math.nan, "loadavg_end": math.nan},
    }
    (out / "results.json").write_text(json.dumps(jsonable(doc), indent=1) + "\n")
    np.savez_compressed(out / TTFT_FILE, **{_run_key(r): r["ttft_ms"] for r in runs})

    samples: dict[str, dict[str, np.ndarray]] = {}
    for r in runs:
        per = samples.setdefault(_load_key(r["load"]), {})
        per[r["policy"]] = np.concatenate([per.get(r["policy"], np.empty(0)), r["ttft_ms"]])
    plots.ttft_cdf(samples, policies, out / "ttft_cdf.png")
    plots.p95_vs_load(agg, policies, out / "p95_vs_load.png")

    cap = capacity
    how = ("given on the command line" if cap.reference is None else
           f"searched: round-robin stable up to {cap.rate_rps:.3f} req/s, unstable at "
           f"{cap.unstable_rps:.3f} req/s on the first {cap.requests} requests")
    mach = doc["machine"]

    def body(img: str) -> list[str]:
        return [
            "```", command, "```", "",
            f"- trace: `{args.trace}`, {workload.n} requests, {workload.mean_rate_rps:.3f} "
            "req/s at its own time scale",
            f"- fleet: `{args.fleet}` ({len(spec.replicas)} replicas in "
            f"{', '.join(regions)}; proxy in {spec.proxy_region})",
            f"- capacity: {cap.rate_rps:.3f} req/s ({how})",
            "- loads (x capacity): " + ", ".join(
                f"{x:g} = {x * cap.rate_rps:.3f} req/s" for x in loads),
            f"- seeds: {len(doc['seeds'])} per (policy, load); cells are mean ± 95 % CI half "
            "width (Student t over seeds); failed requests count as infinitely slow (∞: the "
            "percentile falls among them)",
            "- policies ranked by mean p95 TTFT; region columns: share of requests routed "
            "there", "",
            markdown_tables(agg, regions),
            goal_text(goal),
            f"Simulation wall time per run, s (mean / max; {mach.get('cpus') or 'n/a'} CPUs, "
            f"{args.jobs} jobs, 1-min load average {_one(mach.get('loadavg_start'))} "
            f"at start, {_one(mach.get('loadavg_end'))} at end): " + ", ".join(
                f"{p} {w['mean']:.1f}/{w['max']:.1f}" for p, w in doc["wall_s_per_run"].items()),
            "", f"![TTFT CDF per load]({img}ttft_cdf.png)", "",
            f"![p95 TTFT against load]({img}p95_vs_load.png)", "",
        ]

    (out / "results.md").write_text("\n".join(["# gorgo bench sim", "", *body("")]))
    if args.write_docs is not None:
        write_docs(args.write_docs, out, body)
    return doc


def _one(v: float | None) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{v:.1f}"


DOCS_SECTION_BEFORE = "## Live cross-check"


def write_docs(doc: Path, out: Path, body: Callable[[str], list[str]]) -> None:
    """Put this run's block into ``doc`` (between markers named after ``out``) and its plots
    into ``doc``'s img/ folder; text outside the markers is kept, as others edit the file too."""
    stem = out.resolve().name
    img_dir = doc.parent / "img"
    img_dir.mkdir(parents=True, exist_ok=True)
    for png in ("ttft_cdf.png", "p95_vs_load.png"):
        shutil.copyfile(out / png, img_dir / f"{stem}-{png}")
    begin = f"<!-- bench-sim:{stem}:begin (generated by gorgo bench sim --write-docs) -->"
    end = f"<!-- bench-sim:{stem}:end -->"
    block = "\n".join([begin, *body(f"img/{stem}-"), end]) + "\n"
    text = doc.read_text() if doc.exists() else "# Results\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block.rstrip("\n") + rest.split(end, 1)[1]
    else:
        section = f"## Offline ranking: `{stem}`\n\n{block}\n"
        if DOCS_SECTION_BEFORE in text:
            head, tail = text.split(DOCS_SECTION_BEFORE, 1)
            text = head + section + DOCS_SECTION_BEFORE + tail
        else:
            text = text.rstrip("\n") + "\n\n" + section
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)

