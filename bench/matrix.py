"""The offline acceptance matrix: every project trace x fleet preset x load, gorgo vs the peers.

Traces: Mooncake (conversation), the Azure 2023 conversation trace with its synthetic shared
system prompt and without it (``system_tokens=0``: every prompt unique), and the ``chat``
generator (its windows are generator seeds 0, 1, 2, ...). Fleets: every preset. Loads: 0.5, 0.8
and 0.95 of each window's capacity. Policies: gorgo under each objective (``gorgo@ttft``,
``gorgo@e2e``) and every peer (the registry but gorgo). One ``gorgo bench sim`` per
(trace, fleet) runs all loads, so each window's capacity is searched once (cached in
``<out>/capacity.json``); its full tables stay in ``<out>/<trace>-<fleet>/results.md``. The summary,
one row per (trace, fleet, load) and none dropped (a run that fails is a row saying so), goes to
``<out>/summary.md`` and, with ``--write-docs``, between this script's markers in that file.

``--bound MODE`` replays clients that send another ``max_tokens`` than their exact output (the
trace option ``max_tokens=MODE``, docs/simulator.md: ``none`` or one cap N) into its own folder
and docs block; ``--loads`` runs some of the loads.

    .venv/bin/python bench/matrix.py [--requests 1500] [--windows 5] [--seeds 2] [--jobs N]
        [--bound none|N] [--loads 0.8] [--write-docs docs/results.md] [--report-only]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gorgo.core.policies import REGISTRY
from gorgo.core.terms import OBJECTIVES
from gorgo.errors import UserError
from gorgo.harness.docblock import command_lines, public_args, stop_on_signals, write_block
from gorgo.sim import bench
from gorgo.sim.capacity import code_digest
from gorgo.sim.presets import PRESETS
from gorgo.sim.workload import BOUND_OPTION, EXACT, parse_client_bound

TRACES: dict[str, str] = {
    "mooncake": "mooncake",
    "azure": "azure",
    "azure-unique": "azure:system_tokens=0",
    "chat": "chat",
}
LOADS = (0.5, 0.8, 0.95)
METRICS = tuple(bench.GOALS)
SECTION = "## Offline matrix: every trace, fleet and load"
BEGIN, END = "<!-- bench/matrix.py begin -->", "<!-- bench/matrix.py end -->"
BOUND_SECTION = "### The matrix when clients do not send their output length"
OUT = Path("results/matrix")


def policies() -> list[str]:
    """gorgo under every objective, then every peer."""
    variants = [f"{bench.GORGO}{bench.VARIANT}{o}" for o in OBJECTIVES]
    return [*variants, *(p for p in REGISTRY if p != bench.GORGO)]


def variants(pols: list[str]) -> list[str]:
    return [p for p in pols if bench.is_gorgo(p)]


def trace_spec(trace: str, bound: str) -> str:
    """The bench's trace spec: the project trace with the client's bound, when not exact."""
    spec = TRACES[trace]
    if bound == EXACT:
        return spec
    return f"{spec}{',' if ':' in spec else ':'}{BOUND_OPTION}={bound}"


def run_pair(trace: str, fleet: str, pols: list[str], args: argparse.Namespace,
             capacity: Path | None = None) -> Path:
    """One `gorgo bench sim` over every load; returns its results folder. Each window's capacity
    is cached in ``capacity`` (default: ``capacity.json`` in the output folder)."""
    out = args.out / f"{trace}-{fleet}"
    if not args.report_only:
        parser = argparse.ArgumentParser()
        bench.add_arguments(parser)
        bench.main(parser.parse_args([
            "--trace", trace_spec(trace, args.bound), "--fleet", fleet,
            "--policies", ",".join(pols),
            "--windows", str(args.windows), "--seeds", str(args.seeds),
            "--requests", str(args.requests), "--load", ",".join(map(str, args.loads)),
            "--capacity-cache", str(capacity or args.out / "capacity.json"), "--out", str(out),
            "--jobs", str(args.jobs), *(["--rerun", args.rerun] if args.rerun else [])]))
    return out


@dataclass(frozen=True)
class Row:
    """One cell of the matrix: its table cells and, per variant, the goal parts it misses."""

    cells: list[str]
    missed: dict[str, list[str]]  # variant -> headers of the metrics whose goal is not met

    def line(self) -> str:
        goals = ["met" if not m else f"NOT met ({', '.join(m)})" for m in self.missed.values()]
        return "| " + " | ".join([*self.cells, *goals]) + " |"


def rows(trace: str, fleet: str, out: Path, gorgos: list[str], loads: tuple[float, ...]
         ) -> list[Row]:
    """The summary rows of one (trace, fleet): one per load, also for loads without results;
    ``gorgos`` are the gorgo variants that ran."""
    try:
        by_load = bench.tables(bench.load_runs(json.loads((out / "results.json").read_text())))
        error = "not run"
    except (OSError, ValueError, KeyError) as exc:
        by_load, error = {}, f"no results ({exc})"
    width = len(METRICS) * (1 + len(gorgos))
    everything = [bench.TABLE_METRICS[k][0] for k in METRICS]
    out_rows = []
    for load in (f"{x:g}" for x in loads):
        head = [trace, fleet, load]
        t = by_load.get(load)
        if t is None:
            out_rows.append(Row([*head, error, *["-"] * (width - 1)],
                                {v: everything for v in gorgos}))
            continue
        cells: list[str] = []
        for k in METRICS:
            peer = t.best_peer(k)
            cells.append("none" if peer is None else
                         f"{peer} {bench.fmt_stat(t.stat(peer, k), bench.TABLE_METRICS[k][1])}")
            for v in gorgos:
                c = t.compare(v, k)
                cells.append("n/a" if c is None else bench.fmt_ratio(c.ratio))
        missed = {v: [bench.TABLE_METRICS[k][0] for k in METRICS
                      if (c := t.compare(v, k)) is None or not c.met] for v in gorgos}
        out_rows.append(Row([*head, *cells], missed))
    return out_rows


def tally(table: list[Row]) -> list[str]:
    """How many cells each variant meets, and how often each part of the goal is missed."""
    out = []
    for v in table[0].missed if table else ():
        parts = "; ".join(f"{bench.TABLE_METRICS[k][0]} part missed in "
                          f"{sum(bench.TABLE_METRICS[k][0] in r.missed[v] for r in table)}"
                          for k in METRICS)
        out.append(f"- {v}: goal met in {sum(not r.missed[v] for r in table)} of "
                   f"{len(table)} cells; {parts}")
    return out


def summary(table: list[Row], args: argparse.Namespace, run: dict[str, Any]) -> str:
    """The docs block: the command, how the cells are made, the table and the tallies."""
    pols = run["policies"]
    gorgos = variants(pols)
    head, took = command_lines("bench/matrix.py", run["argv"], run.get("wall_s"))
    ttft, e2e = bench.GOALS["ttft_p95_ms"], bench.GOALS["e2e_p95_ms"]
    heads = []
    for k in METRICS:
        heads.append(f"best peer by {bench.TABLE_METRICS[k][0]} (ms)")
        heads += [f"{v} / best" for v in gorgos]
    heads += [f"goal {v}" for v in gorgos]
    return "\n".join([
        *head,
        f"{len(table)} cells ({len(TRACES)} traces x {len(PRESETS)} fleets x "
        f"{len(args.loads)} loads){took}.{_bound_note(args.bound)} Each cell: {args.windows} "
        f"trace windows of {args.requests} requests "
        f"(`chat`: generator seeds 0-{args.windows - 1}) x {args.seeds} seeds, every policy at "
        "that load of each window's own capacity. Peers: "
        f"{', '.join(p for p in pols if p not in gorgos)}. Cells are {bench.CI_NOTE}. A "
        "ratio is the "
        "gorgo variant's p95 over the best peer's on that metric (best by mean). Goal: p95 "
        f"TTFT <= {ttft:g}x and E2E p95 <= {e2e:g}x, each ratio's interval wholly below 1; the "
        f"goal column names the parts missed. Per-cell tables: "
        f"`{args.out}/<trace>-<fleet>/results.md`. One process ran every cell with the code "
        f"it loaded at its start ({run['code']}).{_rerun_note(run)}", "",
        "| trace | fleet | load | " + " | ".join(heads) + " |",
        "|---|---|---:|" + "---:|" * len(heads),
        *(r.line() for r in table), "", *tally(table), ""])


def _bound_note(bound: str) -> str:
    if bound == EXACT:
        return ""
    what = "no `max_tokens`" if bound == "none" else f"`max_tokens` {bound} (outputs cut to it)"
    return (f" Every client sends {what} instead of its exact output length (trace option "
            f"`{BOUND_OPTION}={bound}`, docs/simulator.md).")


def _rerun_note(run: dict[str, Any]) -> str:
    """What a --rerun run re-simulated and where the other runs come from."""
    r = run.get("rerun")
    if not r:
        return ""
    return (f" Only {r['policies']} were re-simulated; every other policy's runs (and each "
            f"window's capacity) are kept from the previous full run ({r['kept_from']}), whose "
            "code those policies share with this one.")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1500, help="requests per trace window")
    # Five: the goal's interval is a Student t over the windows, whose quantile at three windows
    # (4.30) left cells with gorgo ahead in every run undecided (docs/results.md).
    p.add_argument("--windows", type=int, default=5, help="trace windows per cell")
    p.add_argument("--seeds", type=int, default=2, help="link and policy seeds per window")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--write-docs", type=Path, default=None, metavar="FILE.md")
    p.add_argument("--report-only", action="store_true",
                   help="rebuild the summary from the results already in --out")
    p.add_argument("--bound", default=EXACT, metavar="MODE",
                   help="what each client sends as max_tokens: exact (default), none or a cap "
                   "N; not exact: its own --out and docs block")
    p.add_argument("--loads", default=",".join(map(str, LOADS)), metavar="X,Y",
                   help="multiples of capacity (default: 0.5,0.8,0.95)")
    p.add_argument("--rerun", default=None, metavar="POLICIES",
                   help="re-simulate only these policies in every cell, keeping the other "
                   "policies' runs (see `gorgo bench sim --rerun`)")
    args = p.parse_args(argv)
    try:
        bound = parse_client_bound(args.bound)
        args.loads = tuple(bench.parse_loads(args.loads))
    except ValueError as exc:
        p.error(str(exc))
    args.bound = args.bound.strip().lower() if bound in (EXACT, None) else str(bound)
    section, begin, end = SECTION, BEGIN, END
    if args.bound != EXACT:
        section = f"{BOUND_SECTION} ({BOUND_OPTION}={args.bound})"
        begin, end = (m.replace("bench/matrix.py", f"bench/matrix.py {BOUND_OPTION}={args.bound}")
                      for m in (BEGIN, END))
        if args.out == OUT:
            args.out = OUT.with_name(f"matrix-{BOUND_OPTION}-{args.bound}")
    stop_on_signals()
    t0 = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    meta = args.out / "matrix.json"  # what the full run ran, for --report-only
    if args.report_only:
        try:
            run = json.loads(meta.read_text())
        except (OSError, ValueError) as exc:
            raise SystemExit(f"matrix: --report-only needs a full run's {meta}: {exc}") from None
    else:
        run = {"argv": public_args(argv), "policies": policies(),
               "code": f"router and simulator digest {code_digest()}, as `sim.capacity` "
                       "computes it"}
        if args.rerun:
            previous = json.loads(meta.read_text()) if meta.exists() else {}
            run["rerun"] = {"policies": args.rerun, "kept_from": previous.get("code"),
                            "kept_argv": previous.get("argv")}
    table: list[Row] = []
    for trace in TRACES:
        for fleet in PRESETS:
            print(f"matrix: {trace} x {fleet} ({time.monotonic() - t0:.0f} s so far)",
                  file=sys.stderr, flush=True)
            try:
                out = run_pair(trace, fleet, run["policies"], args)
            except (UserError, RuntimeError) as exc:  # the cell is reported, not dropped
                print(f"matrix: {trace} x {fleet} failed: {exc}", file=sys.stderr)
                out = args.out / f"{trace}-{fleet}" / "failed"
            table += rows(trace, fleet, out, variants(run["policies"]), args.loads)
    if not args.report_only:
        run["wall_s"] = time.monotonic() - t0
        meta.write_text(json.dumps(run) + "\n")
    text = summary(table, args, run)
    (args.out / "summary.md").write_text(f"{section}\n\n{text}")
    if args.write_docs is not None:
        write_block(args.write_docs, section, begin, end, text, "# Results")
    print(f"matrix: {len(table)} cells in {time.monotonic() - t0:.0f} s; wrote "
          f"{args.out / 'summary.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
