"""`gorgo demo --proxy-per-region`: the demo's fleet behind one proxy (Envoy + router) per region.

One simulated fleet (the demo's three regions), and per region a real Envoy and a `gorgo extproc`
whose probes, scrapes and requests go over that region's links (`gorgo.harness.multiproxy`).
The slice's clients are dealt over the regions as the offline multi-router simulation deals them
(`gorgo.sim.routers.client_regions`: a session stays with one region), and each
region's clients replay their requests through their own proxy, all at once. The same slice
runs again with the routers sharing their bookings over a real NATS server (the fleet's
``sharing:``, `gorgo.core.peers`), then through a single proxy in us-east, each on a fresh stack
(cold caches). The report shows, per proxy, its requests, where they went (per region and
replica), p95 TTFT and E2E p95, and how the proxies' choices differ from the single router's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import threading
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

import numpy as np

from gorgo.core.fleet import FleetSpec, parse_fleet
from gorgo.core.tokens import Tokenization
from gorgo.demo import REGIONS, LiveRun, live_table, replay_all
from gorgo.harness.multiproxy import ProxyPerRegion
from gorgo.harness.nats_proc import NatsProcess
from gorgo.harness.stack import LiveStack, StackOptions, with_free_ports
from gorgo.progress import StatusLine
from gorgo.sim import bench, routers
from gorgo.sim.stats import summarize
from gorgo.sim.workload import tokenization, workload_from_requests

SINGLE = "single proxy"
SHARED = "shared"  # suffix of the runs whose routers share their bookings


def _status(runs: list[LiveRun], total: int, status: StatusLine, elapsed: float,
            final: bool = False) -> None:
    parts = []
    for run in runs:
        recs = run.answered()
        ttft = summarize([r.first_answer_ms for r in recs if r.first_answer_ms is not None])
        p95 = f"{ttft.p95 / 1000:.2f}s" if ttft.count else "-"
        errors = sum(r.outcome != "ok" for r in recs)
        parts.append(f"{run.policy}: {len(recs)} p95 {p95} err {errors}")
    line = f"  {elapsed:5.0f}s  of {total}: " + "; ".join(parts)
    (status.done if final else status.update)(line)


def _run(plan: list[tuple[LiveRun, list, str]], args: argparse.Namespace, tok: Tokenization,
         stop_flag: threading.Event) -> None:
    runs = [run for run, _, _ in plan]
    total = sum(len(reqs) for _, reqs, _ in plan)
    status = StatusLine(sys.stderr)
    done = threading.Event()

    def tick() -> None:
        while not done.wait(1.0):
            _status(runs, total, status, time.monotonic() - t0)

    t0 = time.monotonic()
    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        asyncio.run(replay_all(plan, args.time_scale, tok, stop_flag))
    finally:
        done.set()
        ticker.join(2)
        _status(runs, total, status, time.monotonic() - t0, final=True)
        for run in runs:
            run.wall_s = time.monotonic() - t0


def client_regions(doc: dict, requests, seed: int) -> list[str]:
    """Each request's client region, dealt as the offline simulation deals them."""
    spec = parse_fleet(doc)
    features = workload_from_requests("demo", requests, tokenization(spec)).features
    names = routers.fleet_regions(spec)
    return [names[int(c)] for c in routers.client_regions(features, spec, seed)]


def _options(args: argparse.Namespace) -> StackOptions:
    return StackOptions(policy="gorgo", stream_interval=args.stream_interval, seed=args.seed)


def _per_region(args: argparse.Namespace, doc: dict, requests, homes: list[str], out: Path,
                suffix: str, tok: Tokenization, stop_flag: threading.Event) -> list[LiveRun]:
    """One run with a proxy per region, each region's clients through their own."""
    runs = [LiveRun(f"proxy {g}{suffix}") for g in REGIONS]
    with ProxyPerRegion(with_free_ports(doc), out / f"stack-multi{suffix.replace(' ', '-')}",
                        _options(args), REGIONS) as multi:
        _run([(run, [r for r, h in zip(requests, homes, strict=True) if h == g],
               multi.stacks[g].url) for run, g in zip(runs, REGIONS, strict=True)],
             args, tok, stop_flag)
    return runs


def run_multi(args: argparse.Namespace, doc: dict, requests, out: Path,
              stop_flag: threading.Event) -> tuple[list[LiveRun], list[LiveRun], LiveRun | None]:
    """The proxy-per-region runs (own bookings, then shared), then the single proxy."""
    homes = client_regions(doc, requests, args.seed)
    tok = Tokenization(parse_fleet(doc).chars_per_token, parse_fleet(doc).block_tokens)
    print("- a proxy per region: starting the fleet, then Envoy + router in "
          f"{', '.join(REGIONS)} ...", file=sys.stderr)
    runs = _per_region(args, doc, requests, homes, out, "", tok, stop_flag)
    if stop_flag.is_set():
        return runs, [], None
    print("- a proxy per region, bookings shared over NATS ...", file=sys.stderr)
    with NatsProcess() as bus:
        shared = _per_region(args, {**doc, "sharing": {"nats": bus.url}}, requests, homes, out,
                             f" {SHARED}", tok, stop_flag)
    if stop_flag.is_set():
        return runs, shared, None
    single = LiveRun(SINGLE)
    print(f"- a single proxy in {REGIONS[0]} for the same clients: starting fleet, router and "
          "Envoy ...", file=sys.stderr)
    with LiveStack(with_free_ports(doc), out / "stack-single", _options(args)) as stack:
        _run([(single, list(requests), stack.url)], args, tok, stop_flag)
    return runs, shared, single


def _fmt(v: float, unit: str = "") -> str:
    return "∞" if v == float("inf") else ("-" if v != v else f"{v:.0f}{unit}")


def write_report(out: Path, args: argparse.Namespace, runs: list[LiveRun], shared: list[LiveRun],
                 single: LiveRun | None, doc: dict, client_of: dict[int, str]) -> Path:
    spec = parse_fleet(doc)
    region_of = {r.name: r.region for r in spec.replicas}
    replicas = [r.name for r in spec.replicas]
    merged = LiveRun("all proxies", [r for run in runs for r in run.records])
    merged_shared = LiveRun(f"all proxies {SHARED}", [r for run in shared for r in run.records])
    rows = [*runs, merged, *(shared and [*shared, merged_shared]), *([single] if single else [])]
    table = live_table(rows, region_of)
    links = "; ".join(f"{g}: " + ", ".join(f"{h} {routers.link_from(spec, g, h)[0]:.0f}"
                                           for h in REGIONS) for g in REGIONS)
    lines = [
        "# GORGO demo report: a proxy per region", "",
        f"- date: {datetime.now().isoformat(timespec='seconds')}",
        f"- trace: `{args.trace}`, slice offset {args.offset:g} s, {len(client_of)} requests, "
        f"time scale {args.time_scale:g} ({args.duration:g} s of replay per run)",
        f"- fleet: 3 regions x 2 simulated `{args.profile}` replicas; one Envoy + one "
        "`gorgo extproc` (policy gorgo, no tuner) per region, each probing, scraping and "
        "routing over its own region's links, all loading the same engines",
        f"- link RTTs (ms) from each proxy region: {links} (the fleet's links are measured from "
        "us-east; the others follow the offline simulator's model, `gorgo.sim.routers`)",
        "- clients: dealt over the regions as the offline `spread` placement deals them (a "
        "session stays in one region); each region's clients send through their own proxy, "
        f"all at once. `... {SHARED}`: the same again, the routers sharing their bookings over a "
        "real NATS server (fleet `sharing:`), so each counts the others' requests as its own. "
        f"`{SINGLE}`: the same requests through one proxy in {REGIONS[0]}; each run on a "
        "fresh stack (cold caches), as `gorgo demo` runs gorgo. Clients reach their proxy over "
        "loopback (no client link is emulated), so the single proxy's TTFT and E2E omit the "
        f"RTT that the clients outside {REGIONS[0]} would pay to reach it", "",
        "## Per proxy", "",
        "| proxy | requests | failed % | TTFT p95 (ms) | E2E p95 (ms) | "
        + " | ".join(f"to {g} %" for g in REGIONS) + " |",
        "|---|---|---|---|---|" + "---|" * len(REGIONS),
    ]
    for run in rows:
        m = {k: table.stat(run.policy, k).mean
             for k in ("failed", "ttft_p95_ms", "e2e_p95_ms",
                       *(f"share_{g}" for g in REGIONS))}
        lines.append(f"| {run.policy} | {len(run.answered())} | {m['failed']:.1f} | "
                     f"{_fmt(m['ttft_p95_ms'])} | {_fmt(m['e2e_p95_ms'])} | "
                     + " | ".join(f"{m[f'share_{g}']:.0f}" for g in REGIONS) + " |")
    short = [run for run in (*runs, *shared, *([single] if single else [])) if run.interrupted]
    if short or single is None:
        lines += ["", "**Interrupted**: a stop signal ended the demo early"
                  + (f"; cut short: {'; '.join(run.cut_short() for run in short)}. The rows "
                     "count only the answered requests" if short else "") + "."]
    counts = {run.policy: Counter(r.replica for r in run.ok()) for run in rows}
    lines += ["", "## Requests per replica", "",
              "| proxy | " + " | ".join(replicas) + " |",
              "|---|" + "---|" * len(replicas)]
    lines += [f"| {run.policy} | " + " | ".join(str(counts[run.policy][n]) for n in replicas)
              + " |" for run in rows]
    lines += ["", "## Do the routers agree", "",
              *agreement(runs, merged, merged_shared if shared else None, single, table),
              *client_felt(spec, runs, shared, single, client_of)]
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    for run in rows:
        if run is merged:
            continue
        with open(out / f"live-{run.policy.replace(' ', '-')}.jsonl", "w") as fh:
            for r in run.records:
                fh.write(json.dumps(r.to_dict()) + "\n")
    return report


def agreement(runs: list[LiveRun], merged: LiveRun, merged_shared: LiveRun | None,
              single: LiveRun | None, table) -> list[str]:
    """In words, from the table: where each proxy keeps its traffic, and how all of them together
    (with their own bookings, then shared) differ from the single router."""
    def share(policy: str, g: str) -> float:
        return table.stat(policy, f"share_{g}").mean

    out = []
    for run, g in zip(runs, REGIONS, strict=True):
        top = max(REGIONS, key=lambda h: share(run.policy, h))
        out.append(f"- {run.policy}: {share(run.policy, g):.0f} % of its requests stay in "
                   f"{g}; its largest share goes to {top} ({share(run.policy, top):.0f} %).")
    if single is None:
        out.append("- The single-proxy run did not run (stopped), so there is no comparison.")
        return out
    diffs = {g: share(merged.policy, g) - share(single.policy, g) for g in REGIONS}
    worst = max(REGIONS, key=lambda g: abs(diffs[g]))
    def shares(policy: str) -> str:
        return ", ".join(f"{share(policy, g):.0f} %" for g in REGIONS)

    out.append(f"- All proxies together send {shares(merged.policy)} to {', '.join(REGIONS)}; "
               f"the single proxy in {REGIONS[0]} sends {shares(single.policy)}. The largest "
               f"difference is {worst} ({diffs[worst]:+.0f} points).")
    served = [np.array([sum(r.replica == n for r in run.ok()) for n in
                        sorted({r.replica for r in run.ok() if r.replica})]) for run in
              (merged, single)]
    ratios = [f"{s.max() / max(1, s.min()):.1f}" if s.size else "-" for s in served]
    out.append(f"- Busiest over least busy replica: {ratios[0]} with a proxy per region, "
               f"{ratios[1]} with one proxy (among replicas that served any request).")
    for key, label in (("ttft_p95_ms", "p95 TTFT"), ("e2e_p95_ms", "E2E p95")):
        a, b = table.stat(merged.policy, key).mean, table.stat(single.policy, key).mean
        if np.isfinite(a) and np.isfinite(b) and b > 0:
            out.append(f"- {label} over all clients: {a:.0f} ms with a proxy per region, "
                       f"{b:.0f} ms with one proxy ({a / b:.2f}x).")
        if merged_shared is not None:
            c = table.stat(merged_shared.policy, key).mean
            if np.isfinite(c) and np.isfinite(b) and b > 0:
                out.append(f"  With the bookings shared: {c:.0f} ms ({c / b:.2f}x one proxy's).")
    return out


def client_felt(spec: FleetSpec, runs: list[LiveRun], shared: list[LiveRun],
                single: LiveRun | None, client_of: dict[int, str]) -> list[str]:
    """p95 TTFT and E2E with each client's way to its proxy added. Every client here sends over
    loopback, so the one proxy's far clients do not pay their link to it: the mean RTT between
    the client's region and its proxy's is added (`gorgo.sim.routers.link_from`, as the offline
    simulation's client figures)."""
    def p95s(pairs: list[tuple[LiveRun, str]]) -> tuple[float, float]:
        ttft, e2e = [], []  # as the table counts them: a failed request infinitely slow
        for run, proxy in pairs:
            for r in run.answered():
                leg = routers.link_from(spec, client_of[r.index], proxy)[0]
                first = r.first_answer_ms
                ttft.append(math.inf if first is None else first + leg)
                e2e.append(r.e2e_ms + leg if r.outcome == "ok" and r.e2e_ms is not None
                           else math.inf)
        return bench.pct(np.array(ttft), 95), bench.pct(np.array(e2e), 95)

    if single is None or not runs:
        return []
    one = p95s([(single, REGIONS[0])])
    arms = [("a proxy per region", runs), ("the same, bookings shared", shared)]
    out = ["- As the clients feel it, each client's way to its proxy added (the mean RTT between "
           "their regions, computed: every client here sends over loopback):"]
    for label, arm in arms:
        if not arm:
            continue
        mine = p95s(list(zip(arm, REGIONS, strict=True)))
        out.append(f"  {label}: p95 TTFT {_vs(mine[0], one[0])}, E2E p95 "
                   f"{_vs(mine[1], one[1])}.")
    return out


def _vs(mine: float, one: float) -> str:
    """``mine`` ms against one proxy's ``one`` ms; ∞ where more requests failed than the
    percentile leaves out."""
    def ms(v: float) -> str:
        return f"{v:.0f} ms" if math.isfinite(v) else "∞"
    ratio = f"{mine / one:.2f}x" if math.isfinite(mine) and math.isfinite(one) and one else "-"
    return f"{ms(mine)} ({ratio} one proxy's {ms(one)})"


def main(args: argparse.Namespace, requests, doc: dict, out: Path,
         stop_flag: threading.Event) -> Path:
    print(f"gorgo demo --proxy-per-region: {len(requests)} requests of {args.trace}, "
          f"{args.duration:g} s per run", file=sys.stderr)
    runs, shared, single = run_multi(args, doc, requests, out, stop_flag)
    client_of = dict(zip((r.index for r in requests), client_regions(doc, requests, args.seed),
                         strict=True))
    return write_report(out, args, runs, shared, single, doc, client_of)
