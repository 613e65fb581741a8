"""`gorgo bench sim`: rank every routing policy in the offline simulation, with 95 % CIs over
trace windows and seeds.

Windows. ``--windows K`` draws K disjoint slices of ``--requests`` requests each, at evenly
spaced start offsets over the trace (the `chat` generator: K generator seeds instead), so the
intervals cover the workload's variance and not only the simulation's. Each window is parsed into
request features once; every (policy, window, seed, load) run replays those same objects on a
fresh simulated fleet in a worker process (forked, so the features are shared, not copied or
pickled). Load L scales a window's arrival times so its mean rate is L times the fleet's capacity
on that window (`sim.capacity`), searched once and cached per trace window, fleet and simulator
code. Seeds change the link jitter and every policy RNG.

Policies. Any registered policy, ``oracle``, ``oracle-lookahead[@ttft|@e2e]`` (`sim.lookahead`;
slow, so never in ``all``) and ``gorgo@OBJECTIVE``: the gorgo policy on the
same fleet with its ``objective`` replaced (``gorgo`` itself minimises the fleet's own). Peers
are every policy but the gorgo variants and the bounds; each table gives every policy's p95 TTFT and
E2E p95 as a ratio to the best peer on that metric, and checks the goal for each gorgo variant.

Statistics. A failed request (rejected by a full engine queue or for its size) counts as never
getting its first token: its TTFT and E2E are +inf, so a policy cannot look fast by dropping the
slow requests, and a percentile above the served fraction is reported as unbounded. Every number
is computed per run; a cell is two-level (`nested_ci`): each window's runs are averaged over its
seeds, then mean ± t(0.975, K-1) * sd / sqrt(K) over the K window means (one window: over the
seeds). A ratio is taken run by run (same window and seed) and summarised the same way.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats as sstats

from gorgo.core.features import RequestError
from gorgo.core.fleet import FleetSpec
from gorgo.core.policies import REGISTRY
from gorgo.core.terms import OBJECTIVES
from gorgo.errors import UserError, output_dir
from gorgo.progress import StatusLine
from gorgo.sim.capacity import (
    Capacity,
    cache_key,
    cached_capacity,
    find_capacity,
    fleet_digest,
    probe,
    workload_digest,
)
from gorgo.sim.lookahead import LOOKAHEAD, LOOKAHEAD_OBJECTIVES
from gorgo.sim.offline import SimResult
from gorgo.sim.pool import fork_pool
from gorgo.sim.presets import PRESETS, resolve_fleet
from gorgo.sim.profiles import get_profile
from gorgo.sim.routers import PLACEMENTS, SAME
from gorgo.sim.stats import jsonable, percentile
from gorgo.sim.traces import TraceRequest, load_trace, parse_spec
from gorgo.sim.workload import (
    BOUND_OPTION,
    BOUNDS,
    CLOSED,
    EXACT,
    ORACLE,
    TURNS_OPTION,
    Workload,
    refuse_with_closed_turns,
    simulate,
    split_client,
    tokenization,
    workload_from_requests,
)

DEFAULT_LOADS = (0.5, 0.8, 0.95)
GORGO = "gorgo"
VARIANT = "@"  # gorgo@e2e: the gorgo policy with the fleet's objective replaced
# The goal per metric: gorgo at most this times the best peer's (the paired ratio's mean), the
# ratio's interval wholly below 1. Against a bound (oracle, oracle-lookahead) the gap may be at
# most BOUND_GAP.
GOALS: dict[str, float] = {"ttft_p95_ms": 0.85, "e2e_p95_ms": 1.0}
BOUND_GAP = 1.15
# Metrics per run: key -> (table header, unit). The goal metrics come first, each followed by its
# ratio to the best peer; the rest follow in this order.
TABLE_METRICS: dict[str, tuple[str, str]] = {
    "ttft_p95_ms": ("TTFT p95", "ms"),
    "e2e_p95_ms": ("E2E p95", "ms"),
    "ttft_p50_ms": ("TTFT p50", "ms"),
    "ttft_p99_ms": ("TTFT p99", "ms"),
    "itl_p50_ms": ("ITL p50", "ms"),
    "cache_hit": ("cache hit", "%"),
    "failed": ("failed", "%"),
}
CI_NOTE = ("mean ± 95 % CI half width, two-level: runs averaged per trace window, Student t "
           "over the window means (one window: over the seeds); ratios to the best peer taken "
           "run by run (same window and seed), summarised the same way")

TTFT_FILE = "ttft_ms.npz"

# Set in the parent before the pool forks; read by the workers.
_CTX: dict[str, Any] = {}


# --------------------------------------------------------------------------- per-run metrics


def pct(values: np.ndarray, q: float) -> float:
    """Percentile with +inf for failed requests; ``sim.stats`` defines it when none failed."""
    if values.size == 0:
        return math.nan
    if np.isfinite(values).all():
        return float(percentile(values, q))
    # numpy's linear percentile, a failure unbounded: at a whole rank, that request's; else
    # unbounded once the upper neighbour failed (interpolating toward a finite stand-in reported
    # exactly 5 % failed as a p95 of 5e298 ms; toward inf with weight 0 gave NaN).
    ordered = np.sort(values)
    h = q / 100.0 * (ordered.size - 1)
    lo, hi = math.floor(h), math.ceil(h)
    if lo == hi or not np.isfinite(ordered[hi]):
        return float(ordered[hi])
    return float(ordered[lo] + (h - lo) * (ordered[hi] - ordered[lo]))


def run_metrics(res: SimResult, spec: FleetSpec) -> tuple[dict[str, float], np.ndarray]:
    """The per-run numbers of the table (plus diagnostics) and the TTFT of every request (ms)."""
    recs = res.records
    n = len(recs)
    ok = np.array([r.status == 200 for r in recs], dtype=bool)
    ttft = np.array([r.ttft * 1000.0 if r.status == 200 else math.inf for r in recs])
    e2e = np.array([r.e2e * 1000.0 if r.status == 200 else math.inf for r in recs])
    # As the client feels them: plus its way to the router and back (`sim.routers`).
    leg = np.array([r.client_ms for r in recs])
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
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p90_ms": pct(ttft, 90),
        "ttft_p95_ms": pct(ttft, 95),
        "ttft_p99_ms": pct(ttft, 99),
        "e2e_p50_ms": pct(e2e, 50),
        "e2e_p95_ms": pct(e2e, 95),
        "client_ttft_p95_ms": pct(ttft + leg, 95),
        "client_e2e_p95_ms": pct(e2e + leg, 95),
        "itl_p50_ms": pct(itl, 50),
        "itl_p95_ms": pct(itl, 95),
        "cache_hit": 100.0 * cached / prompt if prompt else 0.0,
        "wait_p50_ms": pct(wait, 50),
        "wait_p95_ms": pct(wait, 95),
    }
    region_of = [res.regions[res.replica_region[r.replica]] if r.replica >= 0 else None
                 for r in recs]
    for reg in res.regions:
        m[f"share_{reg}"] = 100.0 * sum(x == reg for x in region_of) / n if n else 0.0
        sel = np.array([t for t, x in zip(ttft, region_of, strict=True) if x == reg])
        if sel.size:
            m[f"ttft_p95_ms_{reg}"] = pct(sel, 95)
            m[f"e2e_p95_ms_{reg}"] = pct(
                np.array([t for t, x in zip(e2e, region_of, strict=True) if x == reg]), 95)
        there = np.array([r.itl * 1000.0 for r, x in zip(recs, region_of, strict=True)
                          if x == reg and r.status == 200 and math.isfinite(r.itl)])
        if there.size:
            m[f"itl_p50_ms_{reg}"] = pct(there, 50)
    for i, rep in enumerate(spec.replicas):
        m[f"share_replica_{rep.name}"] = (
            100.0 * sum(r.replica == i for r in recs) / n if n else 0.0)
    return m, ttft


# ------------------------------------------------------------------------------ statistics


@dataclass(frozen=True)
class Stat:
    """A mean with its 95 % confidence interval (Student t)."""

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
    if np.isposinf(arr).all():  # unbounded in every run: unbounded beyond any noise
        return Stat(math.inf, math.nan, n, 0.0)
    if not np.isfinite(arr).all():
        return Stat(math.inf, math.nan, n, math.inf)
    mean = float(arr.mean())
    if n < 2:
        return Stat(mean, math.nan, n, math.inf)
    sd = float(arr.std(ddof=1))
    return Stat(mean, sd, n, float(sstats.t.ppf(0.975, n - 1)) * sd / math.sqrt(n))


Key = tuple[int, int]  # (trace window, seed) of one run
Values = dict[Key, float]  # one metric of one policy, run by run
NO_STAT = Stat(math.nan, math.nan, 0, math.nan)


def nested_ci(values: Mapping[Key, float]) -> Stat:
    """Mean and 95 % CI over windows and seeds: each window's runs are averaged first, then
    Student t over the window means, so a window counts once however many seeds it has (its
    seeds share the trace slice; they are not independent draws of the workload)."""
    by_window: dict[int, list[float]] = {}
    for (w, _), v in sorted(values.items()):
        if not math.isnan(v):
            by_window.setdefault(w, []).append(v)
    if len(by_window) <= 1:
        return ci95(next(iter(by_window.values()), []))
    return ci95([float(np.mean(v)) for v in by_window.values()])


def paired_ratio(a: Mapping[Key, float], b: Mapping[Key, float]) -> Stat:
    """``a / b`` run by run (same window and seed: the same slice and link jitter), as nested_ci;
    pairing removes the variance the two policies share."""
    return nested_ci({k: a[k] / b[k] if b[k] else math.nan for k in a.keys() & b.keys()})


def is_gorgo(policy: str) -> bool:
    return policy == GORGO or policy.startswith(GORGO + VARIANT)


def is_peer(policy: str) -> bool:
    """A policy gorgo is measured against: neither a gorgo variant nor a bound."""
    return not is_gorgo(policy) and not is_bound(policy)


def is_bound(policy: str) -> bool:
    """A simulation-only bound: oracle, oracle-lookahead or one of its objective variants."""
    return policy.partition(VARIANT)[0] in BOUNDS


@dataclass(frozen=True)
class Comparison:
    """One policy against another (the best peer, or a bound) on one metric."""

    policy: str
    metric: str
    other: str
    mine: Stat
    theirs: Stat
    ratio: Stat  # paired, run by run
    goal: float  # the largest ratio that meets the goal

    @property
    def disjoint(self) -> bool:
        """The paired ratio's interval excludes 1: the two differ beyond the runs' noise."""
        return self.ratio.hi < 1.0 or self.ratio.lo > 1.0

    @property
    def apart(self) -> bool:
        """The two policies' own intervals do not overlap (unpaired: the windows' spread of
        absolute levels, which every policy shares, counts against the difference)."""
        return self.mine.hi < self.theirs.lo or self.theirs.hi < self.mine.lo

    @property
    def met(self) -> bool:
        """Ratio within the goal; against a peer also its interval wholly below 1 (against the
        bound, the gap alone)."""
        if not self.ratio.mean <= self.goal:
            return False
        return is_bound(self.other) or self.ratio.hi < 1.0

    def text(self) -> str:
        head, unit = TABLE_METRICS[self.metric]
        return (f"{head} {fmt_ratio(self.ratio)} x {self.other}'s ({fmt_stat(self.mine, unit)} vs "
                f"{fmt_stat(self.theirs, unit)} {unit}; paired interval "
                f"{'excludes' if self.disjoint else 'includes'} 1, own intervals "
                f"{'disjoint' if self.apart else 'overlap'}): "
                f"{'met' if self.met else 'NOT met'}")

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "metric": self.metric, "other": self.other,
                "mine": self.mine.to_dict(), "theirs": self.theirs.to_dict(),
                "ratio": self.ratio.to_dict(), "goal": self.goal,
                "disjoint": self.disjoint, "apart": self.apart, "met": self.met}


@dataclass(frozen=True)
class Table:
    """The runs of one load: every policy's per-run values and their intervals."""

    values: dict[str, dict[str, Values]]  # policy -> metric -> run -> value
    stats: dict[str, dict[str, Stat]]  # the nested_ci of each

    @classmethod
    def of(cls, values: dict[str, dict[str, Values]]) -> Table:
        return cls(values, {p: {k: nested_ci(v) for k, v in ms.items()}
                            for p, ms in values.items()})

    def stat(self, policy: str, metric: str) -> Stat:
        return self.stats.get(policy, {}).get(metric, NO_STAT)

    def best_peer(self, metric: str) -> str | None:
        """The peer with the lowest finite mean of ``metric``."""
        peers = [p for p in self.stats if is_peer(p) and math.isfinite(self.stat(p, metric).mean)]
        return min(peers, key=lambda p: self.stat(p, metric).mean, default=None)

    def compare(self, policy: str, metric: str, other: str | None = None) -> Comparison | None:
        """``policy`` against ``other`` (default: the best peer on ``metric``)."""
        other = other or self.best_peer(metric)
        if other is None or policy not in self.values or other not in self.values:
            return None
        ratio = paired_ratio(self.values[policy].get(metric, {}),
                             self.values[other].get(metric, {}))
        goal = BOUND_GAP if is_bound(other) else GOALS[metric]
        return Comparison(policy, metric, other, self.stat(policy, metric),
                          self.stat(other, metric), ratio, goal)


def tables(runs: Iterable[dict]) -> dict[str, Table]:
    """{load: Table} of the runs."""
    values: dict[str, dict[str, dict[str, Values]]] = {}
    for r in runs:
        per = values.setdefault(_load_key(r["load"]), {}).setdefault(r["policy"], {})
        key = (int(r.get("window", 0)), int(r["seed"]))
        for k, v in r["metrics"].items():
            per.setdefault(k, {})[key] = v
    return {load: Table.of(pols) for load, pols in values.items()}


def _load_key(load: float) -> str:
    return f"{load:g}"


def _json_num(v: float | int) -> float | int | None:
    if isinstance(v, int):
        return v
    return v if math.isfinite(v) else None


# ---------------------------------------------------------------------------- goal check


def goal_check(t: Table) -> dict[str, list[Comparison]]:
    """Every gorgo variant against the best peer on each goal metric (the best by that metric,
    whichever peer it is), and against each bound that ran."""
    out: dict[str, list[Comparison]] = {}
    bounds = [p for p in t.stats if is_bound(p)]
    for p in (p for p in t.stats if is_gorgo(p)):
        others: list[str | None] = [None, *bounds]
        out[p] = [c for o in others for k in GOALS if (c := t.compare(p, k, o)) is not None]
    return out


def goal_text(load: str, t: Table) -> str:
    checks = goal_check(t)
    if not checks:
        return f"Goal at load {load}: no gorgo variant ran.\n"
    ttft, e2e = GOALS["ttft_p95_ms"], GOALS["e2e_p95_ms"]
    lines = [f"Goal at load {load}: p95 TTFT <= {ttft:g}x the best peer's and E2E p95 <= "
             f"{e2e:g}x the best peer's by E2E, each with its paired interval wholly below 1 "
             f"(gorgo's runs below the peer's beyond the noise); against a bound, a gap <= "
             f"{BOUND_GAP:g}x on both.", ""]
    for p, cs in checks.items():
        lines.append(f"- {p}: " + "; ".join(c.text() for c in cs))
    return "\n".join(lines) + "\n"


def losses(t: Table) -> list[str]:
    """In words, every goal metric on which a gorgo variant is worse than the best peer."""
    out = []
    for cs in goal_check(t).values():
        for c in cs:
            # worse by the paired ratio the table and the goal read (the plain means can
            # disagree with it either way)
            worse = c.ratio.mean > 1.0 if c.ratio.n else c.mine.mean > c.theirs.mean
            if is_bound(c.other) or not worse:
                continue
            head, unit = TABLE_METRICS[c.metric]
            out.append(
                f"{c.policy} loses on {head} to {c.other}: {fmt_stat(c.mine, unit)} against "
                f"{fmt_stat(c.theirs, unit)} {unit} ({fmt_ratio(c.ratio)} x; "
                + ("beyond the noise)" if c.disjoint else
                   "one run each, so it may be noise)" if c.ratio.n < 2 else
                   "its interval includes 1, so it may be noise)"))
    return out


# ---------------------------------------------------------------------------------- report


def fmt_stat(s: Stat, unit: str) -> str:
    if s.n == 0 or math.isnan(s.mean):
        return "n/a"
    if math.isinf(s.mean):
        return "∞"
    digits = 0 if abs(s.mean) >= 100 else 1
    if unit == "%":
        digits = 1
    ci = "" if math.isinf(s.ci95) or math.isnan(s.ci95) else f" ± {s.ci95:.{digits}f}"
    return f"{s.mean:.{digits}f}{ci}"


def fmt_ratio(s: Stat) -> str:
    if s.n == 0 or math.isnan(s.mean):
        return "n/a"
    if math.isinf(s.mean):
        return "∞"
    ci = "" if not math.isfinite(s.ci95) else f" ± {s.ci95:.2f}"
    return f"{s.mean:.2f}{ci}"


def ranked(t: Table) -> list[str]:
    """Policies by mean p95 TTFT, then p50 (unbounded last)."""
    return sorted(t.stats, key=lambda p: (t.stat(p, "ttft_p95_ms").mean,
                                          t.stat(p, "ttft_p50_ms").mean))


def load_table(t: Table, regions: Sequence[str],
               metrics: Mapping[str, tuple[str, str]] = TABLE_METRICS) -> list[str]:
    """Markdown rows, policies ranked by p95 TTFT; each goal metric is followed by its ratio to
    the best peer on it, and the region columns give each region's share of the requests."""
    best = {k: t.best_peer(k) for k in GOALS}
    heads: list[str] = []
    for k, (h, u) in metrics.items():
        heads.append(f"{h} ({u})")
        if k in GOALS:
            heads.append(f"/ best peer ({best[k] or 'none'})")
    heads += [f"{r} (%)" for r in regions]
    lines = ["| # | policy | " + " | ".join(heads) + " |", "|---:|---|" + "---:|" * len(heads)]
    for rank, p in enumerate(ranked(t), 1):
        cells: list[str] = []
        for k, (_, u) in metrics.items():
            cells.append(fmt_stat(t.stat(p, k), u))
            if k in GOALS:
                c = t.compare(p, k)
                cells.append("n/a" if c is None else fmt_ratio(c.ratio))
        cells += [fmt_stat(t.stat(p, f"share_{r}"), "%") for r in regions]
        lines.append(f"| {rank} | {p} | " + " | ".join(cells) + " |")
    return lines


def markdown_tables(by_load: dict[str, Table], regions: list[str]) -> str:
    """One table and goal line per load."""
    lines: list[str] = []
    for load in sorted(by_load, key=float):
        lines += [f"### Load {load}", "", *load_table(by_load[load], regions), "",
                  goal_text(load, by_load[load])]
    return "\n".join(lines)


# -------------------------------------------------------------------------------- workers


def policy_setup(name: str, spec: FleetSpec) -> tuple[str, FleetSpec]:
    """The registry policy and fleet a bench policy name runs: ``gorgo@e2e`` is gorgo on
    ``spec`` with its objective replaced, any other name the policy itself on ``spec``."""
    base, _, objective = name.partition(VARIANT)
    return (base, replace(spec, objective=objective)) if objective else (name, spec)


def _run_job(job: tuple[str, int, int, float, float]) -> dict[str, Any]:
    name, window, seed, load, scale = job
    policy, spec = policy_setup(name, _CTX["spec"])
    workload: Workload = _CTX["workloads"][window]
    t0 = time.perf_counter()
    res = simulate(spec, policy, workload, scale, seed, *_CTX["routers"])
    wall = time.perf_counter() - t0
    metrics, ttft = run_metrics(res, spec)
    return {
        "policy": name, "window": window, "seed": seed, "load": load, "time_scale": scale,
        "routers": _CTX["routers"][0], "placement": _CTX["routers"][1],
        "wall_s": wall, "events": res.events, "sim_time_s": res.sim_time_s,
        "leaked_inflight": res.leaked_inflight, "metrics": metrics,
        "ttft_ms": ttft.astype(np.float32),
    }


def _probe_job(job: tuple[int, float]) -> Any:
    window, rate = job
    return probe(_CTX["spec"], _CTX["capacity_workloads"][window], rate)


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
                        help="trace spec as for `gorgo replay`, its client's options "
                        "NAME:[...,]max_tokens=exact|none|N (what each client sends as its "
                        "bound) and turns=open|closed (closed: a turn waits for the answer it "
                        "continues) included (docs/simulator.md) (default: mooncake)")
    parser.add_argument("--fleet", default="paper",
                        help=f"preset ({', '.join(PRESETS)}) or fleet YAML path (default: paper)")
    parser.add_argument("--policies", default="all",
                        help="all | comma-separated names: registry policies, oracle, "
                        f"{LOOKAHEAD}[{VARIANT}ttft|{VARIANT}e2e] (not in all: slow), and "
                        f"gorgo{VARIANT}OBJECTIVE ({', '.join(OBJECTIVES)}: gorgo with the "
                        "fleet's objective replaced); all = the registry, gorgo under every "
                        "other objective, and oracle")
    parser.add_argument("--seeds", type=int, default=5, metavar="N",
                        help="seeds 1..N per (policy, window, load) (default: 5)")
    parser.add_argument("--windows", type=int, default=1, metavar="K",
                        help="K disjoint slices of --requests requests, evenly spread over the "
                        "trace (chat: K generator seeds from the spec's seed on) (default: 1, "
                        "the first --requests requests)")
    parser.add_argument("--load", default=",".join(map(str, DEFAULT_LOADS)),
                        help="comma-separated multiples of the fleet capacity (default: "
                        "0.5,0.8,0.95)")
    parser.add_argument("--requests", type=int, default=None, metavar="N",
                        help="requests per window (default: all of the trace)")
    parser.add_argument("--capacity-requests", type=int, default=None, metavar="N",
                        help="head of each window the capacity search runs on (default: "
                        "--requests)")
    parser.add_argument("--capacity", type=float, default=None, metavar="RPS",
                        help="use this capacity (req/s) for every window instead of searching")
    parser.add_argument("--capacity-cache", type=Path, default=None, metavar="FILE",
                        help="JSON cache of searched capacities (default: capacity.json next to "
                        "--out)")
    parser.add_argument("--out", type=Path, default=Path("results/bench-sim"), metavar="DIR",
                        help="where results.md, results.json, the plots and ttft_ms.npz go "
                        "(default: results/bench-sim)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, metavar="J",
                        help="worker processes (default: CPU count)")
    parser.add_argument("--routers", type=int, default=1, metavar="K",
                        help="K independent routers, each with its own state and share of the "
                        "arrivals, in front of the same engines (default: 1; see sim.routers)")
    parser.add_argument("--router-placement", choices=PLACEMENTS, default=SAME,
                        help="same: every router in the fleet's proxy region; spread: routers "
                        "round-robin over the regions, each request at a router in its client's "
                        "region (default: same)")
    parser.add_argument("--write-docs", type=Path, default=None, metavar="FILE.md",
                        help="also put the table and plots into FILE.md (between markers named "
                        "after --out) and its img/ folder")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite results.md and the plots from --out's results.json and "
                        "ttft_ms.npz without simulating")
    parser.add_argument("--rerun", default=None, metavar="POLICIES",
                        help="simulate only these of --policies (comma-separated) and keep the "
                        "other policies' runs and each window's capacity from --out's "
                        "results.json (same trace, windows, loads and seeds): for a change "
                        "that touches only these policies' code")


def parse_policies(arg: str, objective: str) -> list[str]:
    """Bench policy names; ``all`` adds gorgo under every objective but the fleet's own
    (``objective``), which plain ``gorgo`` already runs."""
    variants = [f"{GORGO}{VARIANT}{o}" for o in OBJECTIVES]
    if arg.strip() == "all":
        return [*REGISTRY, *(v for v in variants if v != f"{GORGO}{VARIANT}{objective}"),
                ORACLE]
    # The lookahead bound is too slow for `all`; name it (or a variant of it) to run it.
    lookahead = [LOOKAHEAD, *(f"{LOOKAHEAD}{VARIANT}{o}" for o in LOOKAHEAD_OBJECTIVES)]
    known = [*REGISTRY, *variants, ORACLE, *lookahead]
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
        spec = resolve_fleet(args.fleet)
        policies = parse_policies(args.policies, spec.objective)
        loads = parse_loads(args.load)
        if args.seeds < 1 or args.jobs < 1 or args.windows < 1 or args.routers < 1:
            raise ValueError("--seeds, --windows, --jobs and --routers must be >= 1")
        if args.routers > 1 and args.policies.strip() == "all":
            policies.remove(ORACLE)
        if args.routers > 1 and any(is_bound(p) for p in policies):
            raise ValueError(f"--routers {args.routers}: {ORACLE} and {LOOKAHEAD} are bounds "
                             "with the whole fleet's view, one router only; leave them out of "
                             "--policies")
        if split_client(args.trace)[2]:
            for p in policies:
                refuse_with_closed_turns(p)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if args.report_only:
        return report_only(args, spec)
    rerun = _rerun_policies(args, policies)
    log = _logger()
    machine: dict[str, Any] = {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg()[0]}
    out = output_dir(args.out)
    t_start = time.monotonic()
    workloads = load_windows("bench sim", args.trace, spec, args.requests, args.windows, log)
    heads = [w.head(min(args.capacity_requests or w.n, w.n)) for w in workloads]
    _CTX.update(spec=spec, workloads=workloads, capacity_workloads=heads,
                routers=(args.routers, args.router_placement))
    log(f"bench sim: {len(workloads)} window(s) of {workloads[0].n} requests, features in "
        f"{time.monotonic() - t_start:.1f} s")
    kept: list[dict[str, Any]] = []
    if rerun is not None:
        windows, kept = _kept_runs(args, workloads, policies, rerun, loads)
        log(f"bench sim: re-simulating {', '.join(rerun)}; {len(kept)} runs of the other "
            f"policies and the windows' capacities kept from {args.out / 'results.json'}")
    with fork_pool(args.jobs) as pool:
        if rerun is None:
            windows = []
            for k, w in enumerate(workloads):
                cap = _capacity(args, spec, k, heads[k], pool, log)
                log(f"bench sim: {w.trace}: {w.mean_rate_rps:.3f} req/s at scale 1, capacity "
                    f"{cap.rate_rps:.3f} req/s ({cap.key})")
                windows.append(WindowInfo(w.trace, w.n, w.mean_rate_rps, cap))
        jobs = [(p, k, seed, load, w.scale_for_rate(load * windows[k].capacity.rate_rps))
                for load in sorted(loads, reverse=True) for p in (rerun or policies)
                for k, w in enumerate(workloads) for seed in range(1, args.seeds + 1)]
        runs = list(kept)
        bar = Progress(len(jobs), "bench sim")
        for r in pool.imap_unordered(_run_job, jobs):
            runs.append(r)
            bar.step(f"{r['policy']} window {r['window']} seed {r['seed']} load "
                     f"{r['load']:g}: {r['wall_s']:.1f} s")
    machine["loadavg_end"] = os.getloadavg()[0]
    if rerun is not None:
        machine["kept_runs"] = len(kept)
    write_outputs(out, args, spec, windows, policies, loads, runs, machine)
    log(f"bench sim: {len(runs) - len(kept)} runs in {time.monotonic() - t_start:.0f} s; wrote "
        f"{out / 'results.md'}, results.json and plots")
    return 0


def trace_windows(trace: str, requests: int | None, windows: int
                  ) -> list[tuple[str, list[TraceRequest]]]:
    """(label, requests) of ``windows`` disjoint slices of ``requests`` requests each (default:
    the whole trace), at evenly spaced starts from the first request to the last full slice.
    The chat generator has no fixed timeline to slice: window k is its trace with seed S + k
    (S the spec's seed), cut to ``requests``."""
    name, opts = parse_spec(trace)
    if name == "chat":
        out = []
        for k in range(windows):
            seeded = {**opts, "seed": opts.get("seed", 0) + k}
            spec = "chat:" + ",".join(f"{key}={v}" for key, v in seeded.items())
            reqs = load_trace(spec)
            if requests is not None and requests > len(reqs):  # windows of unequal sizes
                raise ValueError(f"{spec} makes {len(reqs)} requests, fewer than {requests}: "
                                 "raise its users or lower --requests")
            reqs = reqs[:requests]
            out.append((f"{spec}[0:{len(reqs)}]", reqs))
        return out
    reqs = load_trace(trace)
    if requests is not None and requests > len(reqs):  # it was cut down silently
        raise ValueError(f"{requests} requests asked, the trace has {len(reqs)}")
    n = len(reqs) if requests is None else requests
    if windows * n > len(reqs):
        raise ValueError(f"{windows} disjoint windows of {n} requests need {windows * n}, the "
                         f"trace has {len(reqs)}")
    starts = ([round(k * (len(reqs) - n) / (windows - 1)) for k in range(windows)]
              if windows > 1 else [0])
    return [(f"{trace}[{s}:{s + n}]", reqs[s:s + n]) for s in starts]


def load_windows(cmd: str, trace: str, spec: FleetSpec, requests: int | None, windows: int,
                 log: Callable[[str], None], pick: int | None = None) -> list[Workload]:
    """The request features for ``spec`` of each window (`trace_windows`), or of window ``pick``
    alone; UserError ``cannot load ...`` if the trace cannot be used (a bench exits 2 on it
    rather than with a traceback)."""
    try:
        base, bound, closed = split_client(trace)
        slices = trace_windows(base, requests, windows)  # a bad trace fails before any progress
        if pick is not None:
            slices = slices[pick:pick + 1]
        out = []
        for label, reqs in slices:
            if bound != EXACT:
                label += f" {BOUND_OPTION}={'none' if bound is None else bound}"
            if closed:
                label += f" {TURNS_OPTION}={CLOSED}"
            log(f"{cmd}: building request features for {label} ({len(reqs)} requests) ...")
            workload = workload_from_requests(label, reqs, tokenization(spec), bound, closed)
            _ = workload.mean_rate_rps
            out.append(workload)
    except (ValueError, OSError, RequestError) as exc:  # RequestError: a prompt no router reads
        raise UserError(f"cannot load {trace!r}: {exc}") from None
    return out


def load_workload(cmd: str, trace: str, spec: FleetSpec, requests: int | None,
                  log: Callable[[str], None]) -> Workload:
    """The first ``requests`` requests of the trace: `load_windows` with one window."""
    return load_windows(cmd, trace, spec, requests, 1, log)[0]


def _capacity(args: argparse.Namespace, spec: FleetSpec, window: int, workload: Workload,
              pool: Any, log: Callable[[str], None]) -> Capacity:
    """The capacity on one window's head (``workload``), from the cache or searched."""
    label = args.fleet if args.fleet in PRESETS else Path(args.fleet).name
    key = cache_key(workload, label, spec)
    if args.capacity is not None:
        return Capacity(rate_rps=args.capacity, unstable_rps=math.nan, estimate_rps=math.nan,
                        key=f"{key}|given", requests=workload.n)
    cache = args.capacity_cache or args.out.parent / "capacity.json"

    def compute() -> Capacity:
        log(f"bench sim: searching capacity for {key} ...")
        return find_capacity(spec, workload, key=key, jobs=args.jobs,
                             run_many=lambda rates: pool.map(_probe_job,
                                                             [(window, r) for r in rates]),
                             log=log)

    return cached_capacity(cache, key, compute)


def _logger() -> Callable[[str], None]:
    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)
    return log


# --------------------------------------------------------------------------------- outputs


@dataclass(frozen=True)
class WindowInfo:
    """What the report needs of one trace window, as stored in results.json."""

    label: str
    n: int
    mean_rate_rps: float  # at the trace's own time scale
    capacity: Capacity

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "requests": self.n, "trace_rate_rps": self.mean_rate_rps,
                "capacity": self.capacity.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WindowInfo:
        return cls(d["label"], d["requests"], d["trace_rate_rps"],
                   Capacity.from_dict(d["capacity"]))


def _run_key(r: dict[str, Any]) -> str:
    return f"{r['policy']}|{r['window']}|{r['seed']}|{r['load']:g}"


def finished_bench(out: Path, flag: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A finished bench's results.json document and its runs with their TTFT samples."""
    try:
        doc = json.loads((out / "results.json").read_text())
        with np.load(out / TTFT_FILE) as npz:
            ttft = {k: npz[k] for k in npz.files}
        runs = load_runs(doc)
        for r in runs:
            r["ttft_ms"] = ttft[_run_key(r)]
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"{flag} needs a finished bench's results in {out}: {exc}") from None
    return doc, runs


def report_only(args: argparse.Namespace, spec: FleetSpec) -> int:
    """Rewrite results.md and the plots from a finished bench's results.json and ttft_ms.npz,
    under the bench's own command (its policies, loads and seeds are the document's); a command
    line naming another trace, fleet or routers is refused (it relabelled the bench for good)."""
    doc, runs = finished_bench(args.out, "--report-only")
    _same_bench(args, doc, runs, "--report-only")
    windows = [WindowInfo.from_dict(w) for w in doc["windows"]]
    write_outputs(args.out, args, spec, windows, doc["policies"], doc["loads"], runs,
                  doc.get("machine"), command=doc.get("command"))
    return 0


def _same_bench(args: argparse.Namespace, doc: dict[str, Any], runs: list[dict[str, Any]],
                flag: str) -> None:
    """Refuse a command whose trace, fleet or routers are not those of the bench in ``doc``."""
    fleet = doc.get("fleet") or {}
    if (doc.get("trace") != args.trace or fleet.get("name") != str(args.fleet)
            or fleet.get("digest") != fleet_digest(resolve_fleet(args.fleet))):
        raise UserError(f"{flag}: {args.out / 'results.json'} ran --trace {doc.get('trace')} "
                        f"--fleet {fleet.get('name')}; give that bench's own flags")
    if any((r.get("routers"), r.get("placement")) != (args.routers, args.router_placement)
           for r in runs):
        raise UserError(f"{flag}: {args.out / 'results.json'} ran other --routers or "
                        "--router-placement than this command")


def _rerun_policies(args: argparse.Namespace, policies: list[str]) -> list[str] | None:
    """--rerun's policies (None without it); each must be one of --policies."""
    if args.rerun is None:
        return None
    names = [p.strip() for p in args.rerun.split(",") if p.strip()]
    unknown = [p for p in names if p not in policies]
    if not names or unknown:
        raise UserError(f"--rerun: expected some of --policies ({', '.join(policies)}), got "
                        f"{args.rerun!r}")
    return names


def _kept_runs(args: argparse.Namespace, workloads: list[Workload], policies: list[str],
               rerun: list[str], loads: list[float]
               ) -> tuple[list[WindowInfo], list[dict[str, Any]]]:
    """The previous bench's windows and the runs of the policies not re-simulated, after
    checking it ran the same trace windows, loads, seeds and every kept policy."""
    doc, runs = finished_bench(args.out, "--rerun")
    windows = [WindowInfo.from_dict(w) for w in doc["windows"]]
    seeds = list(range(1, args.seeds + 1))
    kept = [r for r in runs if r["policy"] in policies and r["policy"] not in rerun]
    # ... every kept run with this command's routers (a hetero run once kept paper's)
    _same_bench(args, doc, kept, "--rerun")
    other = (f"--rerun: {args.out / 'results.json'} ran other windows, loads or seeds than "
             "this command")
    if not ([(w.label, w.n) for w in windows] == [(w.trace, w.n) for w in workloads]
            and sorted(doc["loads"]) == sorted(loads) and doc["seeds"] == seeds):
        raise UserError(other)
    for w, head in zip(windows, _CTX["capacity_workloads"], strict=True):
        # the same requests too (a trace file rewritten in place kept labels and sizes, and the
        # kept runs were of the old requests) ...
        if f"|w:{workload_digest(head)}|" not in w.capacity.key:
            raise UserError(other)
        # ... and the capacities this command asks for (a new --capacity was ignored)
        given = w.capacity.key.endswith("|given")
        if (given != (args.capacity is not None)
                or (given and w.capacity.rate_rps != args.capacity)
                or (not given and w.capacity.requests != head.n)):
            raise UserError(f"--rerun: {args.out / 'results.json'} ran with other capacities "
                            "(--capacity, --capacity-requests) than this command")
    want = (len(policies) - len(rerun)) * len(windows) * len(loads) * len(seeds)
    if len(kept) != want:
        raise UserError(f"--rerun: {args.out / 'results.json'} holds {len(kept)} of the "
                        f"{want} runs to keep")
    return windows, kept


def load_runs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs of a results.json document, JSON's nulls back to non-finite numbers: +inf for
    latencies (failed requests; the routers' and the clients' TTFT and E2E), else NaN."""
    runs = []
    for r in doc["runs"]:
        r = dict(r)
        r["metrics"] = {k: (math.inf if "ttft_" in k or "e2e_" in k else math.nan)
                        if v is None else v for k, v in r["metrics"].items()}
        runs.append(r)
    return runs


def reproduce_command(args: argparse.Namespace) -> str:
    """The CLI line that reproduces this bench (capacity from the same search and cache)."""
    parts = ["gorgo", "bench", "sim", "--trace", args.trace, "--fleet", str(args.fleet),
             "--policies", args.policies, "--seeds", str(args.seeds), "--load", args.load]
    if args.windows != 1:
        parts += ["--windows", str(args.windows)]
    if args.requests is not None:
        parts += ["--requests", str(args.requests)]
    if args.capacity_requests is not None:
        parts += ["--capacity-requests", str(args.capacity_requests)]
    if args.capacity is not None:
        parts += ["--capacity", str(args.capacity)]
    if args.routers != 1:
        parts += ["--routers", str(args.routers), "--router-placement", args.router_placement]
    if getattr(args, "rerun", None):
        parts += ["--rerun", args.rerun]
    parts += ["--out", str(args.out), "--jobs", str(args.jobs)]
    if args.write_docs is not None:
        parts += ["--write-docs", str(args.write_docs)]
    return " ".join(shlex.quote(p) for p in parts)


def write_outputs(
    out: Path,
    args: argparse.Namespace,
    spec: FleetSpec,
    windows: list[WindowInfo],
    policies: list[str],
    loads: list[float],
    runs: list[dict[str, Any]],
    machine: dict[str, Any] | None = None,
    command: str | None = None,
) -> dict[str, Any]:
    """results.md, results.json, the plots and ttft_ms.npz (for --report-only) in ``out``;
    ``command``: the bench's own (a report rewritten later), else this one's."""
    from gorgo.sim import plots  # matplotlib only when writing

    runs = sorted(runs, key=lambda r: (r["load"], policies.index(r["policy"]), r["window"],
                                       r["seed"]))
    by_load = tables(runs)
    regions = spec.region_names
    walls: dict[str, list[float]] = {}
    for r in runs:
        walls.setdefault(r["policy"], []).append(r["wall_s"])
    command = command or reproduce_command(args)
    doc = {
        "command": command,
        "trace": args.trace,
        "fleet": {"name": str(args.fleet), "digest": fleet_digest(spec), "replicas": [
            {"name": r.name, "region": r.region, "profile": r.sim.profile if r.sim else None,
             "speed": r.sim.speed if r.sim else None} for r in spec.replicas],
            "regions": {g.name: {"rtt_ms": g.rtt_ms, "jitter_ms": g.jitter_ms}
                        for g in spec.regions}},
        "windows": [w.to_dict() for w in windows],
        "loads": loads,
        "policies": policies,
        "seeds": sorted({r["seed"] for r in runs}),
        "runs": [{k: v for k, v in r.items() if k != "ttft_ms"} for r in runs],
        "aggregate": {load: {p: {k: s.to_dict() for k, s in ms.items()}
                             for p, ms in tab.stats.items()} for load, tab in by_load.items()},
        "ranking": {load: ranked(tab) for load, tab in by_load.items()},
        "goal": {load: {p: [c.to_dict() for c in cs] for p, cs in goal_check(tab).items()}
                 for load, tab in by_load.items()},
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
    plots.p95_vs_load({load: tab.stats for load, tab in by_load.items()}, policies,
                      out / "p95_vs_load.png")
    mach = doc["machine"]

    def body(img: str) -> list[str]:
        return [
            "```", command, "```", "",
            f"- trace: `{args.trace}`, {len(windows)} window(s); per window its rate at the "
            "trace's own time scale and the fleet's capacity on it (the load unit):",
            *(f"  - `{w.label}`: {w.n} requests, {w.mean_rate_rps:.3f} req/s; capacity "
              f"{_capacity_text(w.capacity)}" for w in windows),
            f"- fleet: `{args.fleet}` ({len(spec.replicas)} replicas in "
            f"{', '.join(regions)}; proxy in {spec.proxy_region}; objective "
            f"{spec.objective}; {_routers_text(args)})",
            "- loads (x each window's capacity): " + ", ".join(f"{x:g}" for x in loads),
            f"- seeds: {len(doc['seeds'])} per (policy, window, load); cells are {CI_NOTE}; "
            "failed requests count as infinitely slow (∞: the percentile falls among them)",
            "- policies ranked by mean p95 TTFT; peers: every policy but the gorgo variants "
            f"and the bounds ({ORACLE}, {LOOKAHEAD}); region columns: share of requests routed "
            "there", "",
            markdown_tables(by_load, regions),
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


def _capacity_text(cap: Capacity) -> str:
    if cap.reference is None:
        return f"{cap.rate_rps:.3f} req/s (given on the command line)"
    return (f"{cap.rate_rps:.3f} req/s (searched: round-robin stable up to it, unstable at "
            f"{cap.unstable_rps:.3f} req/s on the window's first {cap.requests} requests)")


def _routers_text(args: argparse.Namespace) -> str:
    if args.routers == 1:
        return "one router"
    where = ("all in the proxy region" if args.router_placement == SAME else
             "round-robin over the regions, each request at its client's region")
    return f"{args.routers} independent routers, {where}"


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
