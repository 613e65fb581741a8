"""How low the matrix's goal asks p95 TTFT to go, against what no routing can beat: one region.

On the `one-region` fleet every replica is the same distance and speed, so a request's first
token costs its round trip, its uncached prefill and its wait in the queue, and only the wait
and the cache depend on routing. The same trace window replayed at a load of ``--floor-load``
(default 0.05) of its capacity has next to no queue, and the prefix caches hold what they hold
at any load (they evict by space, never by time): its best p95 TTFT over a few cache-keeping
policies is a floor no policy reaches at a load ten times higher. The goal asks for 0.85x the
best peer's p95 TTFT; where that is below the floor, the TTFT part of a cell cannot be met by any
router, and where it is a few percent above, only a router with no queue at that load would.

For each project trace (`bench.matrix.TRACES`) this runs `gorgo bench sim` on `one-region`
(`bench.matrix.run_pair`) at the floor load (the windows, request count and loads the matrix
ran, read from its results; one seed: nothing but the link jitter is drawn there) and prints,
per window averaged over the windows, the floor over the best peer's p95 TTFT and E2E p95 at
each of the matrix's loads, and the gorgo variant's p95 over the floor.

    .venv/bin/python -m bench.floor --matrix results/matrix [--out results/floor] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.matrix import TRACES, run_pair
from gorgo.sim import bench
from gorgo.sim.workload import EXACT

FLEET = "one-region"
POLICIES = ("cache-aware-tree", "gorgo@ttft", "kv-cost")  # the lowest p95 TTFT at load 0.05
GOAL = bench.GOALS["ttft_p95_ms"]


def run_floor(trace: str, args: argparse.Namespace, windows: int, requests: int) -> Path:
    """`gorgo bench sim` of ``trace`` on `one-region` at the floor load over the matrix's
    ``windows`` windows of ``requests``, each window's capacity the matrix's; its results folder."""
    at = argparse.Namespace(out=args.out, bound=EXACT, windows=windows, seeds=1,
                            requests=requests, loads=(args.floor_load,), jobs=args.jobs,
                            rerun=None, report_only=args.report_only)
    return run_pair(trace, FLEET, list(POLICIES), at, capacity=args.matrix / "capacity.json")


def window_means(values: dict[tuple[int, int], float]) -> dict[int, float]:
    """A policy's values of one metric (run key (window, seed) -> value): the mean per window."""
    per: dict[int, list[float]] = {}
    for (window, _), v in values.items():
        per.setdefault(window, []).append(v)
    return {w: statistics.mean(v) for w, v in sorted(per.items())}


def row(trace: str, floor_runs: list[dict[str, Any]], matrix_runs: list[dict[str, Any]],
        loads: list[float], variant: str) -> str:
    """One trace's line of the table, from the floor's runs (one load) and the matrix's at each
    of its ``loads``."""
    (low,) = bench.tables(floor_runs).values()
    floor: dict[str, dict[int, float]] = {}
    for m in ("ttft_p95_ms", "e2e_p95_ms"):
        means = [window_means(metrics[m]) for metrics in low.values.values()]
        floor[m] = {w: min(x[w] for x in means) for w in means[0]}
    windows = list(floor["ttft_p95_ms"])
    by_load = bench.tables(matrix_runs)
    cells: dict[str, list[float]] = {"ttft": [], "e2e": [], "variant": []}
    for load in loads:
        t = by_load[f"{load:g}"]

        def ratios(policy: str, metric: str, t: bench.Table = t) -> list[float]:
            """The floor over ``policy``'s mean per window."""
            mine = window_means(t.values[policy][metric])
            return [floor[metric][w] / mine[w] for w in windows]

        for metric, key in (("ttft_p95_ms", "ttft"), ("e2e_p95_ms", "e2e")):
            peer = t.best_peer(metric)
            assert peer is not None, f"{trace} at {load:g}: no peer ran"
            cells[key].append(statistics.mean(ratios(peer, metric)))
        cells["variant"].append(statistics.mean(1 / x for x in ratios(variant, "ttft_p95_ms")))

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
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--variant", default="gorgo@e2e")
    ap.add_argument("--report-only", action="store_true", help="read earlier floor runs")
    args = ap.parse_args(argv)
    rows: list[str] = []
    loads: list[float] | None = None
    for trace in TRACES:
        matrix_file = args.matrix / f"{trace}-{FLEET}" / "results.json"
        if not matrix_file.exists():
            print(f"bench.floor: no matrix results in {matrix_file}", file=sys.stderr)
            return 2
        matrix_doc = json.loads(matrix_file.read_text())
        if loads is None:
            loads = matrix_doc["loads"]
        elif matrix_doc["loads"] != loads:  # one header for every row
            print(f"bench.floor: {matrix_file} ran other loads than the other traces",
                  file=sys.stderr)
            return 2
        labels = [w["label"] for w in matrix_doc["windows"]]
        floor_doc = json.loads((run_floor(trace, args, len(labels),
                                          matrix_doc["windows"][0]["requests"])
                                / "results.json").read_text())
        if [w["label"] for w in floor_doc["windows"]] != labels:  # runs pair by window index
            print(f"bench.floor: {args.out} ran other windows of {trace} than {matrix_file}",
                  file=sys.stderr)
            return 2
        rows.append(row(trace, bench.load_runs(floor_doc), bench.load_runs(matrix_doc), loads,
                        args.variant))
    at = " / ".join(f"{x:g}" for x in loads or [])
    lines = [
        f"| trace (`{FLEET}`) | floor p95 TTFT per window, ms (load {args.floor_load:g}) "
        f"| floor / best peer's p95 TTFT at {at} (bold: above the goal's {GOAL:g}) "
        f"| {args.variant} p95 TTFT / floor | floor E2E p95 / best peer's |",
        "|---|---:|---:|---:|---:|",
        *rows,
    ]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
