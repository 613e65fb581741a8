"""`gorgo demo`: the simulated 3-region demo, end to end, with a report at the end.

What runs (all real processes on this machine; only the GPUs and the WAN are simulated):
`gorgo sim fleet` (six engines in us-east, eu-frankfurt and ap-seoul behind link emulators with
the GORGO paper's RTTs), `gorgo extproc`, `gorgo tuner` (receiving Envoy's spans over OTLP and
publishing weights), and real Envoy. A slice of the Mooncake trace is replayed through Envoy,
first with the `gorgo` policy and the tuner, then with each baseline on a fresh stack (cold
caches) for a fair comparison. The same slice then runs in the offline simulation for every
policy, over several seeds. The report (markdown + PNG plots) goes into the results folder named
at the end: p95 TTFT and E2E p95 side by side, and, computed from those numbers, where gorgo
loses.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from gorgo import shutdown
from gorgo.core.fleet import parse_fleet
from gorgo.core.policies import REGISTRY
from gorgo.core.tokens import Tokenization
from gorgo.errors import UserError, at_least, output_dir, positive_number
from gorgo.harness.envoy_proc import envoy_binary
from gorgo.harness.nats_proc import nats_binary
from gorgo.harness.stack import LiveStack, StackOptions, with_free_ports
from gorgo.progress import StatusLine
from gorgo.sim import bench
from gorgo.sim.presets import fleet_document
from gorgo.sim.profiles import PROFILES
from gorgo.sim.replay import RequestRecord, replay, select_window
from gorgo.sim.stats import summarize
from gorgo.sim.traces import load_trace
from gorgo.sim.workload import simulate, tokenization, workload_from_requests

REGIONS = ("us-east", "eu-frankfurt", "ap-seoul")
DEMO_PROFILE = "h100-llama3-8b"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default="mooncake",
                   help="trace spec (see `gorgo replay --help`; the demo's clients send the "
                   "trace's exact max_tokens)")
    p.add_argument("--offset", type=at_least(0.0, float), default=0.0,
                   help="start of the slice in trace seconds")
    p.add_argument("--duration", type=positive_number, default=60.0,
                   help="replay seconds per live run (the slice is duration/time-scale long)")
    p.add_argument("--time-scale", type=positive_number, default=0.5,
                   help="multiply trace times by this (0.5 = twice the trace's rate)")
    p.add_argument("--baselines", default="round-robin",
                   help="comma-separated policies to replay live after gorgo ('' for none)")
    p.add_argument("--offline-policies", default="all",
                   help="policies for the offline comparison on the same slice ('' for none; "
                   "names as for `gorgo bench sim --policies`)")
    p.add_argument("--offline-seeds", type=int, default=3,
                   help="link and policy seeds per policy offline (the intervals' runs)")
    p.add_argument("--profile", default=DEMO_PROFILE, choices=sorted(PROFILES),
                   help="engine profile of the replicas")
    p.add_argument("--stream-interval", type=at_least(1), default=8,
                   help="tokens per streamed chunk")
    p.add_argument("--no-tuner", action="store_true", help="run without the online tuner")
    p.add_argument("--cache", default="approximate", choices=("approximate", "precise"),
                   help="the router's cache view: precise follows the simulated vLLMs' KV events")
    p.add_argument("--out", default=None,
                   help="results folder (default results/demo-YYYYmmdd-HHMMSS)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--proxy-per-region", action="store_true",
                   help="one Envoy + router per region, each fed by its region's clients, then "
                        "one proxy for the same clients (gorgo/demo_multi.py); no tuner, "
                        "baselines or offline runs")


@dataclass
class LiveRun:
    policy: str
    records: list[RequestRecord] = field(default_factory=list)
    weights: list[tuple[float, int, float, float]] = field(default_factory=list)
    wall_s: float = 0.0
    planned: int = 0  # requests in the run's slice
    interrupted: bool = False  # a stop signal ended the replay before its last answer

    def ok(self) -> list[RequestRecord]:
        return [r for r in self.records if r.outcome == "ok"]

    def answered(self) -> list[RequestRecord]:
        """The records the run measured: not those a stop cancelled in flight, whose answer
        never came because the run ended, not because the stack failed (counted as failed, a
        baseline stopped by Ctrl-C showed 78.3 % failed and a TTFT p95 of ∞)."""
        return [r for r in self.records if r.outcome != "cancelled"]

    def cut_short(self) -> str:
        """What a stop left out of this run, in words."""
        cancelled = len(self.records) - len(self.answered())
        return (f"{self.policy} after {self.wall_s:.0f} s: {len(self.answered())} of its "
                f"{self.planned} requests answered, {cancelled} cancelled in flight, "
                f"{self.planned - len(self.records)} never sent")


class Live:
    """One progress line on stderr, refreshed while a live run replays."""

    def __init__(self, run: LiveRun, stack: LiveStack, total: int) -> None:
        self.run, self.stack, self.total = run, stack, total
        self.stop = threading.Event()
        self.version = 0
        self.status = StatusLine(sys.stderr)

    def loop(self) -> None:
        t0 = time.monotonic()
        while not self.stop.wait(1.0):
            try:
                w = self.stack.weights()
                self.version = int(w["version"])
                self.run.weights.append((time.monotonic() - t0, self.version, w["rtt"],
                                         w["queue"]))
            except OSError:
                pass
            self.print(time.monotonic() - t0)

    def print(self, elapsed: float, final: bool = False) -> None:
        recs = self.run.answered()
        ttft = summarize([r.first_answer_ms for r in recs if r.first_answer_ms is not None])
        errors = sum(r.outcome != "ok" for r in recs)
        p = (f"{ttft.p50 / 1000:.2f}/{ttft.p95 / 1000:.2f} s" if ttft.count else "-")
        line = (f"  [{self.run.policy:>13}] {elapsed:5.0f}s  done {len(recs):4d}/{self.total}  "
                f"errors {errors}  TTFT p50/p95 {p}  weights v{self.version}")
        (self.status.done if final else self.status.update)(line)


def live_policies(args: argparse.Namespace) -> list[str]:
    """--baselines as the router's policies (`round-robbin` was refused by the router only when
    its stack started, after the whole gorgo run, and left no report)."""
    names = [p.strip() for p in args.baselines.split(",") if p.strip()]
    bad = [p for p in names if p not in REGISTRY]
    if bad:
        raise ValueError(f"--baselines: unknown policy {', '.join(bad)} (the router's policies: "
                         f"{', '.join(REGISTRY)})")
    again = sorted({p for p in names if p == "gorgo" or names.count(p) > 1})
    if again:  # one run per policy: a second overwrote the first's row, log and stack
        raise ValueError(f"--baselines: {', '.join(again)} named twice (gorgo always runs)")
    return names


def _slice(args: argparse.Namespace):
    requests = load_trace(args.trace)
    return select_window(requests, args.offset, args.duration, None, args.time_scale)


def run_live(args: argparse.Namespace, doc: dict[str, Any], policy: str, out: Path,
             requests, stop_flag: threading.Event) -> LiveRun:
    tuned = policy == "gorgo" and not args.no_tuner
    opts = StackOptions(policy=policy, tuner=tuned, stream_interval=args.stream_interval,
                        seed=args.seed,
                        tuner_optimizer={"window_samples": 15, "pairs": 1} if tuned else None)
    run = LiveRun(policy)
    stack = LiveStack(with_free_ports(doc), out / f"stack-{policy}", opts)
    print(f"- {policy}: starting fleet, router{', tuner' if tuned else ''} and Envoy ...",
          file=sys.stderr)
    with stack:
        live = Live(run, stack, len(requests))
        ticker = threading.Thread(target=live.loop, daemon=True)
        ticker.start()
        t0 = time.monotonic()
        try:
            tok = Tokenization(stack.spec.chars_per_token, stack.spec.block_tokens)
            asyncio.run(replay_all([(run, requests, stack.url)], args.time_scale, tok,
                                   stop_flag))
        finally:
            live.stop.set()
            ticker.join(2)
            live.print(time.monotonic() - t0, final=True)
        run.wall_s = time.monotonic() - t0
    return run


async def replay_all(plan: list[tuple[LiveRun, list, str]], time_scale: float,
                     tok: Tokenization, stop_flag: threading.Event) -> None:
    """Every (run, requests, url) at once, from one start time, until done or ``stop_flag``."""
    stop = asyncio.Event()

    async def watch() -> None:
        while not stop_flag.is_set():
            await asyncio.sleep(0.2)
        stop.set()

    watcher = asyncio.create_task(watch())
    for run, reqs, _ in plan:
        run.planned = len(reqs)
    try:
        results = await asyncio.gather(*(replay(reqs, url, time_scale, tok=tok, timeout_s=120.0,
                                                on_result=run.records.append, stop=stop)
                                         for run, reqs, url in plan))
    finally:
        watcher.cancel()
    for (run, _, _), result in zip(plan, results, strict=True):
        run.interrupted = result.interrupted


def run_offline(doc: dict[str, Any], requests, time_scale: float, policies: list[str],
                seeds: int) -> bench.Table:
    """Every policy on the live runs' slice in the offline simulation, seeds 1..``seeds`` each
    (as `gorgo bench sim` runs them, at the live runs' time scale)."""
    spec = parse_fleet(doc)
    workload = workload_from_requests("demo", requests, tokenization(spec))
    runs = []
    for name in policies:
        policy, pspec = bench.policy_setup(name, spec)
        for seed in range(1, seeds + 1):
            res = simulate(pspec, policy, workload, time_scale, seed)
            runs.append({"policy": name, "seed": seed, "load": time_scale,
                         "metrics": bench.run_metrics(res, pspec)[0]})
    return next(iter(bench.tables(runs).values()))


def live_table(runs: list[LiveRun], region_of: dict[str, str]) -> bench.Table:
    """The live runs as a bench table (one run per policy): the same metrics, a failed request
    counting as infinitely slow as offline; a request a stop cancelled is no part of it."""
    rows = []
    for run in runs:
        recs = run.answered()
        ok = [r.outcome == "ok" for r in recs]
        ttft = np.array([np.inf if r.first_answer_ms is None else r.first_answer_ms
                         for r in recs])  # None for a failed request
        e2e = np.array([r.e2e_ms if good and r.e2e_ms is not None else np.inf
                        for r, good in zip(recs, ok, strict=True)])
        served = [r for r, good in zip(recs, ok, strict=True) if good]
        itl = np.array([r.itl_ms for r in served if r.itl_ms is not None])  # per token
        prompt = sum(r.prompt_tokens or 0 for r in served)
        n = max(1, len(recs))
        m = {"ttft_p50_ms": bench.pct(ttft, 50), "ttft_p95_ms": bench.pct(ttft, 95),
             "ttft_p99_ms": bench.pct(ttft, 99), "e2e_p95_ms": bench.pct(e2e, 95),
             "itl_p50_ms": bench.pct(itl, 50),
             "cache_hit": 100.0 * sum(r.cached_tokens or 0 for r in served) / prompt
             if prompt else float("nan"),
             "failed": 100.0 * (len(recs) - len(served)) / n}
        for g in REGIONS:
            m[f"share_{g}"] = 100.0 * sum(region_of.get(r.replica or "") == g
                                          for r in served) / n
        rows.append({"policy": run.policy, "seed": 0, "load": 1.0, "metrics": m})
    return next(iter(bench.tables(rows).values()))


def _cdf(ax, values: list[float], label: str) -> None:
    """The share of ``values`` at or below each TTFT; a failed request (inf) is in the total and
    never reached, so a run with failures stops below 1, as the offline chart does."""
    s = np.sort(np.asarray(values, dtype=float)) / 1000.0
    done = s[np.isfinite(s)]
    if s.size:
        ax.step(done, np.arange(1, done.size + 1) / s.size, where="post", label=label)


def write_report(out: Path, args: argparse.Namespace, runs: list[LiveRun],
                 offline: bench.Table | None, n_requests: int) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        firsts = [np.inf if r.first_answer_ms is None else r.first_answer_ms
                  for r in run.answered()]  # as the table counts them
        _cdf(ax, firsts, f"{run.policy} (live)")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ttft_cdf.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / max(1, len(runs))
    region_of = {}
    for run in runs:
        for r in run.ok():
            if r.replica:
                region_of[r.replica] = next((g for g in REGIONS if r.replica.startswith(g)),
                                            r.replica)
    for k, run in enumerate(runs):
        counts = [sum(1 for r in run.ok() if region_of.get(r.replica) == g) for g in REGIONS]
        ax.bar(np.arange(len(REGIONS)) + k * width, counts, width, label=run.policy)
    ax.set_xticks(np.arange(len(REGIONS)) + width * (len(runs) - 1) / 2, REGIONS)
    ax.set_ylabel("requests served")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "requests_per_region.png", dpi=110)
    plt.close(fig)

    fig, (a1, a2) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    tuned = next((r for r in runs if r.policy == "gorgo"), None)
    if tuned and tuned.weights:
        t = [w[0] for w in tuned.weights]
        a1.plot(t, [w[2] for w in tuned.weights], label="w_rtt")
        a1.plot(t, [w[3] for w in tuned.weights], label="w_queue")
        a1.set_yscale("log")
        a1.legend()
        a2.step(t, [w[1] for w in tuned.weights], where="post")
    a1.set_ylabel("weight")
    a2.set_ylabel("weights version")
    a2.set_xlabel("seconds into the gorgo run")
    fig.tight_layout()
    fig.savefig(out / "tuner_weights.png", dpi=110)
    plt.close(fig)

    lines = [
        "# GORGO demo report", "",
        f"- date: {datetime.now().isoformat(timespec='seconds')}",
        f"- trace: `{args.trace}`, slice offset {args.offset:g} s, {n_requests} requests, "
        f"time scale {args.time_scale:g} ({args.duration:g} s of replay per run)",
        f"- fleet: 3 regions x 2 simulated `{args.profile}` replicas behind link emulators "
        "(us-east 37 ms, eu-frankfurt 279 ms, ap-seoul 456 ms RTT from the proxy)",
        "- simulated: GPUs (engine model) and WAN links (userspace emulator); real: Envoy, "
        "gRPC ext_proc, OTLP spans, HTTP/SSE streaming", "",
        "## Live runs (through Envoy)", "",
        "One run per policy on a fresh stack, so the live cells have no interval: a difference "
        "of a few percent between two of them may be run-to-run noise. Peers are the "
        "policies other than gorgo; each ratio is to the best peer on that metric. A failed "
        "request counts as infinitely slow (∞: the percentile falls among the failures). ITL "
        "is each request's mean gap between tokens, (E2E - TTFT) / (output tokens - 1), as in "
        "the offline table (not between streamed chunks).", "",
    ]
    live = live_table(runs, region_of) if runs else None
    if live is not None:
        lines += bench.load_table(live, REGIONS)
    short = [run for run in runs if run.interrupted]
    ran = {run.policy for run in runs}
    skipped = [p for p in ["gorgo", *live_policies(args)] if p not in ran]
    if offline is None and args.offline_policies and (short or skipped):
        skipped.append("the offline simulation")
    if short or skipped:
        lines += ["", " ".join([
            "**Interrupted**: a stop signal ended the demo early.",
            *([f"Cut short: {'; '.join(run.cut_short() for run in short)}. The table counts "
               "only the answered requests, the first of the slice, so a run cut short is not "
               "comparable with a whole one."] if short else []),
            *([f"Not run: {', '.join(skipped)}."] if skipped else [])])]
    if tuned and tuned.weights:
        last = tuned.weights[-1]
        lines += ["", f"The tuner published {last[1]} weight versions during the gorgo run; "
                  f"last weights w_rtt={last[2]:.3g}, w_queue={last[3]:.3g}."]
    if offline is not None:
        seeds = args.offline_seeds
        lines += ["", "## Offline simulation of the same slice (same router code)", "",
                  f"Every policy on the same requests at the same time scale, {seeds} link and "
                  f"policy seeds each; cells are mean ± 95 % CI half width (Student t over the "
                  "seeds; one trace slice, so they measure simulation noise, not the "
                  "workload's: `gorgo bench sim --windows` varies that). `gorgo@e2e` is gorgo "
                  "minimising predicted end-to-end time instead of TTFT; oracle sees the "
                  "engines' true state (a reference, not a peer).", "",
                  *bench.load_table(offline, REGIONS)]
    lines += ["", "## Where gorgo loses", "",
              "Computed from the tables above: every case where a gorgo variant's p95 TTFT or "
              "E2E p95 is worse than the best peer's.", ""]
    for label, table in (("Live", live), ("Offline", offline)):
        if table is None:
            continue
        if label == "Live" and short:
            lines.append(f"- Live: {', '.join(r.policy for r in short)} cut short (above), "
                         "so the lines below weigh a partial run against a whole one, not like "
                         "for like.")
        lost = bench.losses(table)
        if not any(bench.is_peer(p) for p in table.stats):
            lines.append(f"- {label}: no peer ran, so there is nothing to lose to.")
        elif not lost:
            lines.append(f"- {label}: nowhere: no gorgo variant's p95 TTFT or E2E p95 is above "
                         "the best peer's (ratio taken run by run, as the table's).")
        lines += [f"- {label}: {x}." for x in lost]
    lines += ["", "![TTFT CDF](ttft_cdf.png)", "", "![requests per region]"
              "(requests_per_region.png)", "", "![tuner weights](tuner_weights.png)", ""]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    for run in runs:
        with open(out / f"live-{run.policy}.jsonl", "w") as fh:
            for r in run.records:
                fh.write(json.dumps(r.to_dict()) + "\n")
    return report


def main(args: argparse.Namespace) -> int:
    requests = _slice(args)  # a bad --trace is a TraceError (UserError) before anything starts
    if not requests:
        raise UserError("the slice is empty; move --offset into the trace or raise --duration")
    doc = fleet_document({r: 2 for r in REGIONS}, profile=args.profile, name="demo",
                         cache=args.cache)
    try:  # before the live runs: a bad name fails in a second, not after minutes
        names = (bench.parse_policies(args.offline_policies, parse_fleet(doc).objective)
                 if args.offline_policies else [])
        if args.offline_seeds < 1:
            raise ValueError("--offline-seeds must be >= 1")
        baselines = live_policies(args)
        # The binaries too: a missing nats-server (a dev extra) failed after the first run, a
        # traceback and no report.
        envoy_binary()
        if args.proxy_per_region:
            nats_binary()
    except (ValueError, FileNotFoundError) as exc:
        raise UserError(str(exc)) from None
    out = output_dir(args.out or f"results/demo-{datetime.now():%Y%m%d-%H%M%S}")
    stop_flag = threading.Event()
    previous = {sig: signal.getsignal(sig) for sig in shutdown.STOP_SIGNALS}

    def interrupt(signum: int, _frame: object) -> None:
        """The first stop signal ends the demo after the current run, with a report; the next
        one (the previous handlers: gorgo.shutdown's) aborts at once."""
        shutdown.note(signum)
        if signum == signal.SIGHUP:
            _leave_a_hung_up_terminal()
        print("\nstopping: ending this run, then the report (Ctrl-C again to abort at once)",
              file=sys.stderr)
        stop_flag.set()
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    # SIGHUP too (the terminal or SSH session closed): it ended the demo at once, its routers
    # and simulated fleet left running.
    previous[signal.SIGHUP] = signal.getsignal(signal.SIGHUP)
    for sig in previous:
        signal.signal(sig, interrupt)
    try:
        return _run_all(args, requests, doc, out, stop_flag, baselines, names)
    finally:  # gorgo.cli puts back its own (SIGINT, SIGTERM); this one is the demo's
        hup = previous[signal.SIGHUP]
        signal.signal(signal.SIGHUP, signal.SIG_DFL if hup is None else hup)


def _leave_a_hung_up_terminal() -> None:
    """Point stdout and stderr at /dev/null where they are a terminal that hung up: every write
    to it fails (EIO), and the first one, the stop's own line, ended the demo with a traceback,
    exit 1 and no report."""
    for fd in (1, 2):
        try:
            os.write(fd, b"")
        except OSError:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, fd)
            os.close(null)


def _run_all(args: argparse.Namespace, requests: list, doc: dict, out: Path,
             stop_flag: threading.Event, baselines: list[str], names: list[str]) -> int:
    """The live runs, then the offline simulation and the report (130 once stopped)."""
    if args.proxy_per_region:
        from gorgo import demo_multi  # it imports this module

        report = demo_multi.main(args, requests, doc, out, stop_flag)
        print(f"\nreport: {report}")
        return 130 if stop_flag.is_set() else 0
    print(f"gorgo demo: {len(requests)} requests of {args.trace} per run, "
          f"{args.duration:g} s each; live policies: gorgo, {', '.join(baselines) or '-'}",
          file=sys.stderr)
    runs: list[LiveRun] = []
    for policy in ["gorgo", *baselines]:
        if stop_flag.is_set():
            break
        runs.append(run_live(args, doc, policy, out, requests, stop_flag))
    offline = None
    if names and not stop_flag.is_set():
        print(f"- offline simulation of the same slice: {len(names)} policies x "
              f"{args.offline_seeds} seeds ...", file=sys.stderr)
        offline = run_offline(doc, requests, args.time_scale, names, args.offline_seeds)
    report = write_report(out, args, runs, offline, len(requests))
    print(f"\nreport: {report}")
    return 130 if stop_flag.is_set() else 0
