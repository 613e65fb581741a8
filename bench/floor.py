"""How low the matrix's goal asks p95 TTFT to go, against what no routing can beat: one region.

On the `one-region` fleet every replica is the same distance and speed, so a request's first
token costs its round trip, its uncached prefill and its wait in the queue, and only the wait
and the cache depend on routing. The same trace window replayed at a load of ``--floor-load``
(default 0.05) of its capacity has next to no queue, and the prefix caches hold what they hold
at any load (they evict by space, never by time): its best p95 TTFT over a few cache-keeping
policies is a floor no policy reaches at a load ten times higher. The goal asks for 0.85x the
best peer's p95 TTFT; where that is below the floor, the TTFT part of a cell cannot be met by any
router, and where it is a few percent above, only a router with no queue at that load would.

For each project trace (`bench.matrix.TRACES`) this runs `gorgo bench sim` on `one-region` at
the floor load (same windows and request count as the matrix, one seed: nothing but the link
jitter is drawn there) and prints, per window averaged over the three windows, the floor over
the best peer's p95 TTFT and E2E p95 at each of the matrix's loads, read from a matrix output
folder, and the gorgo variant's p95 over the floor.

    .venv/bin/python -m bench.floor --matrix results/matrix [--out results/floor] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.matrix import LOADS, TRACES, trace_spec
from gorgo.sim import bench

FLEET = "one-region"
POLICIES = ("cache-aware-tree", "gorgo@ttft", "kv-cost")  # the lowest p95 TTFT at load 0.05
GOAL = bench.GOALS["ttft_p95_ms"]


def run_floor(trace: str, args: argparse.Namespace) -> Path:
    """`gorgo bench sim` of ``trace`` on `one-region` at the floor load; its results folder."""
    out = args.out / trace
    if not args.report_only:
        parser = argparse.ArgumentParser()
        bench.add_arguments(parser)
        bench.main(parser.parse_args([
            "--trace", trace_spec(trace, "exact"), "--fleet", FLEET,
            "--policies", ",".join(POLICIES), "--windows", str(args.windows), "--seeds", "1",
            "--requests", str(args.requests), "--load", str(args.floor_load),
            "--capacity-cache", str(args.matrix / "capacity.json"), "--out", str(out),
            "--jobs", str(args.jobs)]))
    return out


def p95(runs: list[dict[str, Any]], policy: str, window: int, metric: str) -> float:
    """The mean over seeds of one policy's p95 on one window."""
    return statistics.mean(r["metrics"][metric] for r in runs
                           if r["policy"] == policy and r["window"] == window)


def row(trace: str, floor_runs: list[dict[str, Any]], matrix_runs: list[dict[str, Any]],
        variant: str) -> str:
    """One trace's line of the table."""
    windows = sorted({r["window"] for r in floor_runs})
    floor = {m: {w: min(r["metrics"][m] for r in floor_runs if r["window"] == w)
                 for w in windows} for m in ("ttft_p95_ms", "e2e_p95_ms")}
    cells: dict[str, list[float]] = {"ttft": [], "e2e": [], "variant": []}
    for load in LOADS:
        runs = [r for r in matrix_runs if abs(r["load"] - load) < 1e-9]
        peers = {r["policy"] for r in runs
                 if not bench.is_gorgo(r["policy"]) and not r["policy"].startswith("oracle")}

        def best(metric: str, runs: list[dict[str, Any]] = runs, peers: set[str] = peers) -> str:
            return min(peers, key=lambda p: statistics.mean(p95(runs, p, w, metric)
                                                           for w in windows))

        bt, be = best("ttft_p95_ms"), best("e2e_p95_ms")
        cells["ttft"].append(statistics.mean(
            floor["ttft_p95_ms"][w] / p95(runs, bt, w, "ttft_p95_ms") for w in windows))
        cells["e2e"].append(statistics.mean(
            floor["e2e_p95_ms"][w] / p95(runs, be, w, "e2e_p95_ms") for w in windows))
        cells["variant"].append(statistics.mean(
            p95(runs, variant, w, "ttft_p95_ms") / floor["ttft_p95_ms"][w] for w in windows))

    def fmt(xs: list[float], mark: bool = False) -> str:
        return " / ".join(f"**{x:.2f}**" if mark and x > GOAL else f"{x:.2f}" for x in xs)

    ms = " / ".join(f"{floor['ttft_p95_ms'][w]:.0f}" for w in windows)
    return (f"| {trace} | {ms} | {fmt(cells['ttft'], mark=True)} | {fmt(cells['variant'])} "
            f"| {fmt(cells['e2e'])} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--matrix", type=Path, required=True,
                    help="a bench/matrix.py output folder (its runs and capacities)")
    ap.add_argument("--out", type=Path, default=Path("results/floor"))
    ap.add_argument("--floor-load", type=float, default=0.05)
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--variant", default="gorgo@e2e")
    ap.add_argument("--report-only", action="store_true", help="read earlier floor runs")
    args = ap.parse_args(argv)
    loads = " / ".join(f"{x:g}" for x in LOADS)
    lines = [
        f"| trace (`{FLEET}`) | floor p95 TTFT per window, ms (load {args.floor_load:g}) "
        f"| floor / best peer's p95 TTFT at {loads} (bold: above the goal's {GOAL:g}) "
        f"| {args.variant} p95 TTFT / floor | floor E2E p95 / best peer's |",
        "|---|---:|---:|---:|---:|",
    ]
    for trace in TRACES:
        matrix_file = args.matrix / f"{trace}-{FLEET}" / "results.json"
        if not matrix_file.exists():
            print(f"bench.floor: no matrix results in {matrix_file}", file=sys.stderr)
            return 2
        floor_runs = json.loads((run_floor(trace, args) / "results.json").read_text())["runs"]
        matrix_runs = json.loads(matrix_file.read_text())["runs"]
        lines.append(row(trace, floor_runs, matrix_runs, args.variant))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
