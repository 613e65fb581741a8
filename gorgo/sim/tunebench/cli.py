"""`gorgo bench tune`: arguments, and the run that ties the package together (tuned runs, the grid
of static runs, re-runs of every incumbent, then the outputs)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from gorgo.core.fleet import FleetSpec
from gorgo.core.terms import OBJECTIVES, SLO
from gorgo.errors import output_dir
from gorgo.sim.capacity import fleet_digest, workload_digest
from gorgo.sim.pool import fork_pool
from gorgo.sim.tunebench.points import (
    KEYS,
    Point,
    default_point,
    grid,
    grid_axes,
    label,
    parse_start,
    static_key,
)
from gorgo.sim.tunebench.report import render, write_null_outputs, write_outputs
from gorgo.sim.tunebench.run import (
    _CTX,
    POLICY,
    StaticJob,
    TuneSettings,
    TuneTrace,
    load_cache,
    model_digest,
    null_config,
    probe_job,
    save_cache,
    static_job,
    tune_job,
)
from gorgo.sim.tunebench.stats import (
    LIVE_MAX,
    OBJECTIVE_METRIC,
    grid_best,
    summarize_null,
    summarize_run,
)
from gorgo.sim.workload import Workload
from tuner.optimizer import OptimizerConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from gorgo.sim.presets import PRESETS

    shape = ",".join(k.upper() for k in KEYS)
    parser.add_argument("--trace", default="mooncake", metavar="SPEC",
                        help="trace spec as for `gorgo replay`, its client's options "
                        "NAME:[...,]max_tokens=exact|none|N and turns=open|closed included "
                        "(docs/simulator.md) (default: mooncake)")
    parser.add_argument("--fleet", default="paper",
                        help=f"preset ({', '.join(PRESETS)}) or fleet YAML path (default: paper)")
    parser.add_argument("--load", type=float, default=0.8,
                        help="multiple of the fleet capacity, as `gorgo bench sim` (default: 0.8)")
    parser.add_argument("--requests", type=int, default=None, metavar="N",
                        help="first N requests of the trace (default: all)")
    parser.add_argument("--window", default=None, metavar="W/K",
                        help="trace window W (0-based) of K disjoint windows of --requests "
                        "requests, as `gorgo bench sim --windows K` draws them (the chat "
                        "generator: its seed + W); default: the first --requests requests")
    parser.add_argument("--capacity", type=float, default=None, metavar="RPS",
                        help="use this capacity (req/s) instead of searching")
    parser.add_argument("--capacity-cache", type=Path, default=None, metavar="FILE",
                        help="capacity cache shared with `gorgo bench sim` (default: "
                        "capacity.json next to --out)")
    parser.add_argument("--seeds", type=int, default=3, metavar="N",
                        help="seeds 1..N for every grid point and tuned run (default: 3)")
    parser.add_argument("--start", action="append", default=None, metavar=shape,
                        help=f"bad starting weights of a tuned run, {shape} in registry order or "
                        f"{','.join(f'{k}=X' for k in KEYS)}; repeatable (default: two opposite "
                        "corners of the bounds, the first weight low and the rest high, and the "
                        "reverse: 0.05,20 and 20,0.05)")
    parser.add_argument("--grid", type=int, default=7, metavar="K",
                        help="K values per weight, log-spaced over the optimiser's bounds, every "
                        "combination run statically (K x K for two weights; default: 7)")
    parser.add_argument("--objective", choices=OBJECTIVES, default=None,
                        help="what the tuner minimises and the grid is ranked on: p95 TTFT, p95 "
                        "E2E or the SLO's TTFT miss share (default: the fleet's objective); the "
                        "search space is its weights, the grid stays over "
                        f"{','.join(KEYS)} with the others at their defaults")
    parser.add_argument("--ends-only", action="store_true",
                        help="give the tuner each sample only when its request ends (default: "
                        "its TTFT at the first token, as the TTFT log does live, then its E2E)")
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
    parser.add_argument("--null-only", action="store_true",
                        help="run only the A/A runs (no grid, no tuned runs): their "
                        "false-accept rate over --seeds seeds, in results.md and results.json")
    parser.add_argument("--out", type=Path, default=Path("results/bench-tune"), metavar="DIR")
    parser.add_argument("--static-cache", type=Path, default=None, metavar="FILE",
                        help="JSON cache of static runs (default: static_cache.json in --out)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, metavar="J")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite results.md and the figures from --out's results.json")


def optimizer_config(opts: Sequence[str], calibrate: bool,
                     fleet: dict[str, Any] | None = None) -> OptimizerConfig:
    """Defaults, then what the tuner takes from the fleet (``fleet``: objective, slo_ttft_ms),
    then ``KEY=VALUE`` overrides, typed and validated like the tuner's YAML."""
    import yaml

    from tuner.optimizer import config_from_mapping

    raw: dict[str, Any] = dict(fleet or {})
    for item in opts:
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--opt: expected KEY=VALUE, got {item!r}")
        raw[key.strip()] = yaml.safe_load(value)
    cfg = config_from_mapping(raw, "--opt")
    # The bench keeps every history entry: it reports them all (nothing is persisted).
    return replace(cfg, calibrate=calibrate, history=10**9)


def parse_window(text: str | None) -> tuple[int, int] | None:
    """``W/K`` -> (W, K), window W of K."""
    if text is None:
        return None
    w, slash, k = text.partition("/")
    try:
        out = (int(w), int(k))
    except ValueError:
        out = (-1, 0)
    if not slash or not 0 <= out[0] < out[1]:
        raise ValueError(f"--window: expected W/K with 0 <= W < K, got {text!r}")
    return out


def default_starts(config: OptimizerConfig) -> list[Point]:
    """Two opposite corners of the search bounds: the first weight at its low bound and the
    others high (the plateau), and the reverse (the cliff)."""
    b = config.search_bounds()
    first, rest = config.keys[0], config.keys[1:]
    return [{first: b[first][0], **{k: b[k][1] for k in rest}},
            {first: b[first][1], **{k: b[k][0] for k in rest}}]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _capacity(args: argparse.Namespace, spec: FleetSpec, workload: Workload) -> float:
    """Capacity (req/s) exactly as `gorgo bench sim` defines and caches it."""
    from gorgo.sim.capacity import cache_key, cached_capacity, find_capacity
    from gorgo.sim.presets import PRESETS

    if args.capacity is not None:
        return float(args.capacity)
    label_ = args.fleet if args.fleet in PRESETS else Path(args.fleet).name
    key = cache_key(workload, label_, spec)  # its window's own (as bench sim)
    cache = args.capacity_cache or args.out.parent / "capacity.json"

    def compute() -> Any:
        log(f"bench tune: searching capacity for {key} ...")
        with fork_pool(args.jobs) as pool:
            return find_capacity(spec, workload, key=key, jobs=args.jobs,
                                 run_many=lambda rates: pool.map(probe_job, rates), log=log)

    return cached_capacity(cache, key, compute).rate_rps


def main(args: argparse.Namespace) -> int:
    from gorgo.sim.bench import Progress, load_windows, load_workload
    from gorgo.sim.presets import resolve_fleet

    try:
        spec = resolve_fleet(args.fleet)
        objective = args.objective or spec.objective
        # The routers score under the objective the tuner minimises: its weights (decode,
        # interference, reuse) route nothing under another objective's cost.
        spec = replace(spec, objective=objective)
        config = optimizer_config(args.opt, args.calibrate,
                                  {"objective": objective, "slo_ttft_ms": spec.slo.ttft_ms})
        starts = ([parse_start(s, config.keys) for s in args.start] if args.start
                  else default_starts(config))
        if args.seeds < 1 or args.jobs < 1 or args.grid < 2:
            raise ValueError("--seeds and --jobs must be >= 1, --grid >= 2")
        if not args.load > 0 or not 0 < args.tolerance < 1:
            raise ValueError("--load must be > 0 and --tolerance in (0, 1)")
        if args.tick_s < 0 or args.publish_delay_s < 0:
            raise ValueError("--tick-s and --publish-delay-s must be >= 0")
        window = parse_window(args.window)
        if args.null_only and args.skip_null:
            raise ValueError("--null-only and --skip-null exclude each other")
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
        if "weight_keys" not in doc:
            print(f"bench tune: --report-only: {out / 'results.json'} predates weights keyed by "
                  "name; rerun the bench", file=sys.stderr)
            return 2
        print(render(out, doc)["summary_md"])
        return 0
    output_dir(out)
    t_start = time.monotonic()
    if window is None:
        workload = load_workload("bench tune", args.trace, spec, args.requests, log)
    else:
        workload = load_windows("bench tune", args.trace, spec, args.requests, window[1], log,
                                pick=window[0])[0]
    _CTX.update(spec=spec, workload=workload, capacity_workload=workload)
    seeds = list(range(1, args.seeds + 1))
    axes = grid_axes(config.search_bounds(), args.grid)
    points = grid(axes)
    cache_path = args.static_cache or out / "static_cache.json"
    capacity = _capacity(args, spec, workload)
    scale = workload.scale_for_rate(args.load * capacity)
    _CTX["scale"] = scale  # before the pool forks: the workers see the whole context
    _CTX["slo_ttft_ms"] = config.slo_ttft_ms if config.objective == SLO else 0.0
    digest = model_digest()
    slo = f"slo={config.slo_ttft_ms!r}|" if _CTX["slo_ttft_ms"] else ""
    where = "" if window is None else f"@{workload.trace}"
    # the fleet's contents too: runs of a fleet file since edited were reused
    fleet = f"{args.fleet}|{spec.name}:{fleet_digest(spec)}"
    # ... and the requests' (a trace file rewritten in place reused the old file's grid)
    slice_key = (f"{args.trace}{where}|{fleet}|n={workload.n}|w={workload_digest(workload)}|"
                 f"scale={scale!r}|{POLICY}|objective={spec.objective}|{slo}code={digest}")
    static = load_cache(cache_path, slice_key)
    log(f"bench tune: {workload.n} requests at load {args.load:g} = "
        f"{args.load * capacity:.3f} req/s (time scale {scale:.4f}); " + (
            "A/A runs only" if args.null_only
            else f"{len(points)} grid points; {len(static)} static runs cached"))
    settings = []
    for start in [] if args.null_only else starts:
        for seed in seeds:
            base = TuneSettings(config, start, seed, tick_s=args.tick_s,
                                publish_delay_s=args.publish_delay_s, early=not args.ends_only)
            settings.append((f"{label(start)} seed {seed} guard", base))
            settings.append((f"{label(start)} seed {seed} no-guard",
                             replace(base, config=replace(config, e2e_margin=math.inf))))
    if not args.skip_null:
        for seed in seeds:
            settings.append((f"null seed {seed}", TuneSettings(
                null_config(config), default_point(config.keys), seed, tick_s=args.tick_s,
                publish_delay_s=args.publish_delay_s, null=True, early=not args.ends_only)))
    if args.null_only:
        with fork_pool(args.jobs) as pool:
            bar = Progress(len(settings), "bench tune (A/A)")
            done = []
            for r in pool.imap_unordered(tune_job, settings):
                done.append(r)
                bar.step(f"{r[0]}: {r[2].samples} samples, {r[4]:.1f} s")
        nulls = [summarize_null(label_, st, trace)
                 for label_, st, trace, _, _ in sorted(done, key=lambda r: r[1].seed)]
        doc = write_null_outputs(out, args, workload, config, seeds, nulls, digest)
        log(f"bench tune: done in {time.monotonic() - t_start:.0f} s; wrote {out / 'results.md'}")
        print(doc["summary_md"])
        return 0
    grid_jobs: list[StaticJob] = [(static_key(p, {}, s), p, (), s) for p in points for s in seeds]
    tuned: list[tuple[str, TuneSettings, TuneTrace, dict[str, float], float]] = []
    with fork_pool(args.jobs) as pool:
        todo = [j for j in grid_jobs if j[0] not in static]
        bar = Progress(len(settings) + len(todo), "bench tune")
        for r in pool.imap_unordered(tune_job, settings):
            tuned.append(r)
            bar.step(f"{r[0]}: {r[2].samples} samples, {r[4]:.1f} s")
        for key, m in pool.imap_unordered(static_job, todo):
            static[key] = m
            bar.step(f"grid: {m['wall_s']:.1f} s")
        save_cache(cache_path, slice_key, static)
        best = grid_best(points, seeds, static, OBJECTIVE_METRIC[config.objective])
        reeval: dict[str, StaticJob] = {}
        for seed in seeds:  # the grid best's worst live p95 (older cache entries lack it)
            key = static_key(best.weights, {}, seed)
            if LIVE_MAX not in static[key]:
                reeval[key] = (key, best.weights, (), seed)
        for _, st, trace, _, _ in tuned:
            if st.null:
                continue
            incs = trace.incumbents if math.isfinite(st.config.e2e_margin) else (
                trace.incumbents[-1:])  # without the guard only the final incumbent is needed
            for _, weights, rates in incs:
                key = static_key(weights, rates, st.seed)
                if key not in static:
                    reeval[key] = (key, weights, tuple(sorted(rates.items())), st.seed)
        bar = Progress(len(reeval), "re-run incumbents")
        for key, m in pool.imap_unordered(static_job, list(reeval.values())):
            static[key] = m
            bar.step(f"{m['wall_s']:.1f} s")
        save_cache(cache_path, slice_key, static)
    order = {label_: k for k, (label_, _) in enumerate(settings)}
    tuned.sort(key=lambda r: order[r[0]])
    runs, nulls = [], []
    for label_, st, trace, run, _ in tuned:
        if st.null:
            nulls.append(summarize_null(label_, st, trace))
            continue
        if not math.isfinite(st.config.e2e_margin):
            trace = replace(trace, incumbents=trace.incumbents[-1:])
        runs.append(summarize_run(label_, st, trace, run, static, best, args.tolerance))
    doc = write_outputs(out, args, spec, workload, capacity, scale, config, axes, seeds,
                        static, best, runs, nulls, digest)
    log(f"bench tune: done in {time.monotonic() - t_start:.0f} s; wrote {out / 'results.md'}")
    print(doc["summary_md"])
    return 0
