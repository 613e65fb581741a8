"""What several independent GORGO routers lose against one: p95 TTFT and E2E p95 for K routers.

K = 1, 2, 4, 8 routers (`gorgo bench sim --routers K`), all in the proxy region (``same``) or
round-robin over the fleet's regions with each request at a router of its client's region
(``spread``), for gorgo under each objective, on Mooncake, Azure conversation and the chat
generator, at one load of each window's capacity. One ``gorgo bench sim`` per (trace, K,
placement); every K runs the same windows and seeds, so a ratio to K = 1 is taken run by run
(same window, seed and link jitter) and summarised as `gorgo bench sim` does (nested over windows).
The summary goes to ``<out>/summary.md`` and, with ``--write-docs``, between this script's markers.

    .venv/bin/python bench/multirouter.py [--requests 1500] [--windows 2] [--seeds 2] [--jobs 1]
        [--fleet paper] [--cache precise] [--scrape-interval S] [--routers 1,4]
        [--write-docs docs/results.md] [--report-only]

``--cache precise``, ``--scrape-interval`` and ``--share`` run a variant of the preset (every
replica a simulated vLLM whose KV events every router follows; the routers' scrape interval; the
fleet's ``sharing:`` on, so each router applies the others' bookings, `gorgo.core.peers`), written
as a fleet file into ``--out``; ``--routers`` keeps only those K (1 is always run: the baseline).
A ``--share`` run writes its own block in the docs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from gorgo.core.terms import E2E, TTFT
from gorgo.harness.docblock import command_lines, public_args, stop_on_signals, write_block
from gorgo.sim import bench
from gorgo.sim.capacity import code_digest
from gorgo.sim.presets import PRESETS, with_cache
from gorgo.sim.routers import SAME, SPREAD

TRACES: dict[str, str] = {"mooncake": "mooncake", "azure": "azure", "chat": "chat"}
CONFIGS: tuple[tuple[int, str], ...] = (
    (1, SAME), (2, SAME), (4, SAME), (8, SAME), (2, SPREAD), (4, SPREAD), (8, SPREAD))
GOAL_K, GOAL = 4, 1.05  # acceptance: K = 4 within 5 % of one router on both metrics
METRICS = ("ttft_p95_ms", "e2e_p95_ms")
# The same as the client feels them, its way to the router and back included (`sim.routers`):
# what a proxy per region saves its users, so `spread` is judged on these too.
CLIENT_METRICS = {"client_ttft_p95_ms": "client TTFT p95", "client_e2e_p95_ms": "client E2E p95"}
SECTION = "## Several routers"
SIM_NATS = "nats://127.0.0.1:4222"


def markers(share: bool) -> tuple[str, str, str]:
    """The docs section and block of a run: shared bookings have their own."""
    tag = "bench/multirouter.py --share" if share else "bench/multirouter.py"
    return (f"{SECTION}, bookings shared" if share else SECTION,
            f"<!-- {tag} begin -->", f"<!-- {tag} end -->")


def policies() -> list[str]:
    """gorgo under the shipped objectives."""
    return [f"{bench.GORGO}{bench.VARIANT}{o}" for o in (E2E, TTFT)]


def run_dir(out: Path, trace: str, k: int, placement: str) -> Path:
    return out / f"{trace}-k{k}-{placement}"


def configs(args: argparse.Namespace) -> list[tuple[int, str]]:
    return [(k, p) for k, p in CONFIGS if k == 1 or k in args.routers]


def fleet_arg(args: argparse.Namespace) -> str:
    """The preset, or the variant ``--cache`` / ``--scrape-interval`` ask for as a fleet file."""
    if args.cache == "approximate" and args.scrape_interval is None and not args.share \
            and args.precise_lookup_tokens is None:
        return args.fleet
    if args.fleet not in PRESETS:
        raise SystemExit("multirouter: --cache, --scrape-interval and --share apply to a preset "
                         "--fleet")
    doc = dict(PRESETS[args.fleet])
    doc["replicas"] = [with_cache(r, args.cache) for r in doc["replicas"]]
    if args.scrape_interval is not None:
        doc["signals"] = {"scrape_interval_s": args.scrape_interval}
    if args.precise_lookup_tokens is not None:
        doc["limits"] = {"precise_lookup_tokens": args.precise_lookup_tokens}
    if args.share:  # the simulator delivers the bookings itself; the server is never dialled
        doc["sharing"] = {"nats": SIM_NATS}
    path = args.out / f"fleet-{args.fleet}.yaml"
    path.write_text(json.dumps(doc, indent=1) + "\n")  # JSON is YAML
    return str(path)


def run_config(trace: str, k: int, placement: str, args: argparse.Namespace) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    bench.main(parser.parse_args([
        "--trace", TRACES[trace], "--fleet", fleet_arg(args), "--policies", ",".join(policies()),
        "--windows", str(args.windows), "--seeds", str(args.seeds),
        "--requests", str(args.requests), "--load", f"{args.load:g}",
        "--capacity-cache", str(args.out / "capacity.json"),
        "--out", str(run_dir(args.out, trace, k, placement)), "--jobs", str(args.jobs),
        "--routers", str(k), "--router-placement", placement]))


def values(out: Path) -> dict[str, dict[str, bench.Values]]:
    """policy -> metric -> (window, seed) -> value of one finished bench."""
    runs = bench.load_runs(json.loads((out / "results.json").read_text()))
    table: dict[str, dict[str, bench.Values]] = {}
    for r in runs:
        per = table.setdefault(r["policy"], {})
        for m, v in r["metrics"].items():
            per.setdefault(m, {})[(int(r["window"]), int(r["seed"]))] = v
    return table


def rows(trace: str, out: Path, runs: list[tuple[int, str]]) -> tuple[list[str], list[str]]:
    """The table rows of one trace and the goal lines (K = GOAL_K against K = 1)."""
    base = values(run_dir(out, trace, 1, SAME))
    lines, goal = [], []
    for k, placement in runs:
        try:
            mine = values(run_dir(out, trace, k, placement))
        except (OSError, ValueError, KeyError) as exc:
            lines.append(f"| {trace} | all | {placement} | {k} | no results ({exc}) |"
                         + " - |" * 7)
            continue
        for p in policies():
            cells = []
            # The router's figures with their values, then the client's as ratios only.
            for m, (head, unit) in [*((m, bench.TABLE_METRICS[m]) for m in METRICS),
                                    *((m, (head, None)) for m, head in CLIENT_METRICS.items())]:
                if unit is not None:
                    cells.append(bench.fmt_stat(bench.nested_ci(mine[p][m]), unit))
                ratio = bench.paired_ratio(mine[p][m], base[p][m])
                cells.append("1" if k == 1 else bench.fmt_ratio(ratio))
                if k == GOAL_K:
                    ok = ratio.mean <= GOAL
                    goal.append(f"- {trace}, {p}, {placement}: {head} {bench.fmt_ratio(ratio)} "
                                f"x one router's: {'met' if ok else 'NOT met'}")
            cells.append(bench.fmt_stat(bench.nested_ci(mine[p]["cache_hit"]), "%"))
            where = "-" if k == 1 else placement
            lines.append(f"| {trace} | {p} | {where} | {k} | " + " | ".join(cells) + " |")
    return lines, goal


def summary(args: argparse.Namespace, run: dict) -> str:
    head, took = command_lines("bench/multirouter.py", run["argv"], run.get("wall_s"))
    table, goals = [], []
    for trace in TRACES:
        try:
            lines, goal = rows(trace, args.out, configs(args))
        except (OSError, ValueError, KeyError) as exc:
            lines, goal = [f"| {trace} | no K = 1 results ({exc}) |" + " - |" * 10], []
        table += lines
        goals += goal
    return "\n".join([
        *head,
        f"Fleet `{args.fleet}` ({fleet_text(args)}), load {args.load:g} of each window's "
        f"capacity; each cell {args.windows} trace windows of {args.requests} requests "
        f"(`chat`: generator seeds) x {args.seeds} seeds{took}. K routers each keep their "
        "own state (in-flight, prefix index, probes and scrapes on their own timers) and see "
        "the same engines; `same`: all in the proxy region; `spread`: round-robin over the "
        "regions, each request at a router of its client's region, clients dealt evenly "
        "(`gorgo/sim/routers.py`)"
        + ("; with `sharing:` each router also applies the others' bookings one delay later "
           "(`gorgo.core.peers`: 1 ms in one region, half the link's RTT between two) and "
           "decides in turns, the one ranked r among its live peers r x `stagger_ms` (2 ms) "
           "after a request arrives"
           if args.share else "") + ". Cells are "
        f"{bench.CI_NOTE.replace('the best peer', 'K = 1')}. Goal: K = {GOAL_K} within "
        f"{(GOAL - 1) * 100:.0f} % of one router (ratio mean <= {GOAL:g}). TTFT and E2E run "
        "from the request's arrival at its router, as Envoy's span measures them; the client's "
        "columns add the way from the client's region to its router's and back (the link's "
        "mean RTT; clients dealt evenly over the fleet's regions whatever the routers), which a "
        f"proxy per region saves. {run['code']}.", "",
        "| trace | policy | placement | K | TTFT p95 (ms) | / K=1 | E2E p95 (ms) | / K=1 | "
        "client TTFT p95 / K=1 | client E2E p95 / K=1 | cache hit (%) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *table, "", *goals, ""])


def fleet_text(args: argparse.Namespace) -> str:
    scrape = ("" if args.scrape_interval is None else
              f", scrape interval {args.scrape_interval:g} s")
    return f"cache view {args.cache}{scrape}{', bookings shared' if args.share else ''}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1500, help="requests per trace window")
    p.add_argument("--windows", type=int, default=2, help="trace windows per cell")
    p.add_argument("--seeds", type=int, default=2, help="link and policy seeds per window")
    p.add_argument("--load", type=float, default=0.8, help="multiple of each window's capacity")
    p.add_argument("--fleet", default="paper", help="preset or fleet YAML path")
    p.add_argument("--cache", choices=("approximate", "precise"), default="approximate",
                   help="the routers' cache view of every replica (precise: KV events)")
    p.add_argument("--scrape-interval", type=float, default=None, metavar="S",
                   help="the routers' engine scrape interval (default: the fleet's)")
    p.add_argument("--precise-lookup-tokens", type=int, default=None, metavar="N",
                   help="with --cache precise: the fleet's limits.precise_lookup_tokens")
    p.add_argument("--share", action="store_true",
                   help="the fleet's sharing: on (every router applies the others' bookings)")
    p.add_argument("--routers", default="1,2,4,8", metavar="K,...",
                   help="numbers of routers to run (default: 1,2,4,8)")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--out", type=Path, default=None,
                   help="default: results/multirouter (results/multirouter-share with --share)")
    p.add_argument("--write-docs", type=Path, default=None, metavar="FILE.md")
    p.add_argument("--report-only", action="store_true",
                   help="rebuild the summary from the results already in --out")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = Path("results/multirouter-share" if args.share else "results/multirouter")
    try:
        args.routers = {int(k) for k in args.routers.split(",")}
    except ValueError:
        p.error(f"--routers: expected numbers, got {args.routers!r}")
    stop_on_signals()
    t0 = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    meta = args.out / "multirouter.json"
    if args.report_only:
        try:
            run = json.loads(meta.read_text())
        except (OSError, ValueError) as exc:
            raise SystemExit(f"multirouter: --report-only needs a full run's {meta}: "
                             f"{exc}") from None
    else:
        run = {"argv": public_args(argv),
               "code": f"Router and simulator digest {code_digest()}"}
        for trace in TRACES:
            for k, placement in configs(args):
                print(f"multirouter: {trace} K={k} {placement} "
                      f"({time.monotonic() - t0:.0f} s so far)", file=sys.stderr, flush=True)
                run_config(trace, k, placement, args)
        run["wall_s"] = time.monotonic() - t0
        meta.write_text(json.dumps(run) + "\n")
    text = summary(args, run)
    (args.out / "summary.md").write_text(f"{markers(args.share)[0]}\n\n{text}")
    if args.write_docs is not None:
        write_block(args.write_docs, *markers(args.share), text, "# Results")
    print(f"multirouter: wrote {args.out / 'summary.md'} in {time.monotonic() - t0:.0f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
