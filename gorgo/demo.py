"""`gorgo demo`: the simulated 3-region demo, end to end, with a report at the end.

What runs (all real processes on this machine; only the GPUs and the WAN are simulated):
`gorgo sim fleet` (six engines in us-east, eu-frankfurt and ap-seoul behind link emulators with
the GORGO paper's RTTs), `gorgo extproc`, `gorgo tuner` (receiving Envoy's spans over OTLP and
publishing weights), and real Envoy. A slice of the Mooncake trace is replayed through Envoy,
first with the `gorgo` policy and the tuner, then with each baseline on a fresh stack (cold
caches) for a fair comparison. The same slice then runs in the offline simulation for every
policy. The report (markdown + PNG plots) goes into the results folder named at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
from gorgo.core.features import extract_features
from gorgo.core.fleet import parse_fleet
from gorgo.core.tokens import Tokenization
from gorgo.errors import UserError
from gorgo.harness.stack import LiveStack, StackOptions, with_free_ports
from gorgo.progress import StatusLine
from gorgo.sim.presets import fleet_document
from gorgo.sim.replay import RequestRecord, replay, select_window
from gorgo.sim.stats import summarize
from gorgo.sim.traces import load_trace

REGIONS = ("us-east", "eu-frankfurt", "ap-seoul")
DEMO_PROFILE = "h100-llama3-8b"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default="mooncake", help="trace spec (see `gorgo replay --help`)")
    p.add_argument("--offset", type=float, default=0.0,
                   help="start of the slice in trace seconds")
    p.add_argument("--duration", type=float, default=60.0,
                   help="replay seconds per live run (the slice is duration/time-scale long)")
    p.add_argument("--time-scale", type=float, default=0.5,
                   help="multiply trace times by this (0.5 = twice the trace's rate)")
    p.add_argument("--baselines", default="round-robin",
                   help="comma-separated policies to replay live after gorgo ('' for none)")
    p.add_argument("--offline-policies", default="all",
                   help="policies for the offline comparison on the same slice ('' for none)")
    p.add_argument("--profile", default=DEMO_PROFILE, help="engine profile of the replicas")
    p.add_argument("--stream-interval", type=int, default=8, help="tokens per streamed chunk")
    p.add_argument("--no-tuner", action="store_true", help="run without the online tuner")
    p.add_argument("--out", default=None,
                   help="results folder (default results/demo-YYYYmmdd-HHMMSS)")
    p.add_argument("--seed", type=int, default=0)


@dataclass
class LiveRun:
    policy: str
    records: list[RequestRecord] = field(default_factory=list)
    weights: list[tuple[float, int, float, float]] = field(default_factory=list)
    wall_s: float = 0.0

    def ok(self) -> list[RequestRecord]:
        return [r for r in self.records if r.outcome == "ok"]


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
        recs = list(self.run.records)
        ttft = summarize([r.ttft_ms for r in recs if r.ttft_ms is not None])
        errors = sum(r.outcome != "ok" for r in recs)
        p = (f"{ttft.p50 / 1000:.2f}/{ttft.p95 / 1000:.2f} s" if ttft.count else "-")
        line = (f"  [{self.run.policy:>13}] {elapsed:5.0f}s  done {len(recs):4d}/{self.total}  "
                f"errors {errors}  TTFT p50/p95 {p}  weights v{self.version}")
        (self.status.done if final else self.status.update)(line)


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
            asyncio.run(_replay(requests, stack.url, args.time_scale, stack, run, stop_flag))
        finally:
            live.stop.set()
            ticker.join(2)
            live.print(time.monotonic() - t0, final=True)
        run.wall_s = time.monotonic() - t0
    return run


async def _replay(requests, url: str, time_scale: float, stack: LiveStack, run: LiveRun,
                  stop_flag: threading.Event) -> None:
    stop = asyncio.Event()

    async def watch() -> None:
        while not stop_flag.is_set():
            await asyncio.sleep(0.2)
        stop.set()

    watcher = asyncio.create_task(watch())
    tok = Tokenization(stack.spec.chars_per_token, stack.spec.block_tokens)
    try:
        await replay(requests, url, time_scale, tok=tok, timeout_s=120.0,
                     on_result=run.records.append, stop=stop)
    finally:
        watcher.cancel()


def run_offline(doc: dict[str, Any], requests, time_scale: float, policies: list[str],
                seed: int) -> dict[str, list[float]]:
    from gorgo.sim.offline import Simulation
    from gorgo.sim.oracle import oracle_factory

    spec = parse_fleet(doc)
    tok = Tokenization(spec.chars_per_token, spec.block_tokens)
    arrivals = [r.arrival_s * time_scale for r in requests]
    feats = [extract_features("/v1/chat/completions", {},
                              json.dumps(r.chat_body(tok, "demo")).encode(), tok)
             for r in requests]
    outputs = [r.output_tokens for r in requests]
    out = {}
    for p in policies:
        sim = Simulation(spec, p, seed=seed,
                         policy_factory=oracle_factory if p == "oracle" else None)
        res = sim.run(arrivals, feats, outputs)
        out[p] = [r.ttft * 1000 for r in res.served()]
    return out


def _cdf(ax, values: list[float], label: str) -> None:
    s = np.sort(np.asarray(values, dtype=float)) / 1000.0
    if s.size:
        ax.step(s, np.arange(1, s.size + 1) / s.size, where="post", label=label)


def write_report(out: Path, args: argparse.Namespace, runs: list[LiveRun],
                 offline: dict[str, list[float]], n_requests: int) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        _cdf(ax, [r.ttft_ms for r in run.ok() if r.ttft_ms is not None], f"{run.policy} (live)")
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
        "| policy | served | errors | TTFT p50 (s) | TTFT p95 (s) | E2E p95 (s) | "
        + " | ".join(f"{g} share" for g in REGIONS) + " |",
        "|---|---:|---:|---:|---:|---:|" + "---:|" * len(REGIONS),
    ]
    for run in runs:
        ok = run.ok()
        tt = summarize([r.ttft_ms for r in ok if r.ttft_ms is not None])
        e2e = summarize([r.e2e_ms for r in ok if r.e2e_ms is not None])
        shares = [sum(1 for r in ok if region_of.get(r.replica) == g) / max(1, len(ok))
                  for g in REGIONS]
        lines.append(
            f"| {run.policy} | {len(ok)} | {len(run.records) - len(ok)} | "
            f"{_s(tt.p50)} | {_s(tt.p95)} | {_s(e2e.p95)} | "
            + " | ".join(f"{x:.0%}" for x in shares) + " |")
    if tuned and tuned.weights:
        last = tuned.weights[-1]
        lines += ["", f"The tuner published {last[1]} weight versions during the gorgo run; "
                  f"last weights w_rtt={last[2]:.3g}, w_queue={last[3]:.3g}."]
    if offline:
        lines += ["", "## Offline simulation of the same slice (same router code)", "",
                  "| policy | TTFT p50 (s) | TTFT p95 (s) | TTFT p99 (s) |", "|---|---:|---:|---:|"]
        for p, values in sorted(offline.items(), key=lambda kv: summarize(kv[1]).p95 or 0):
            st = summarize(values)
            lines.append(f"| {p} | {_s(st.p50)} | {_s(st.p95)} | {_s(st.p99)} |")
    lines += ["", "![TTFT CDF](ttft_cdf.png)", "", "![requests per region]"
              "(requests_per_region.png)", "", "![tuner weights](tuner_weights.png)", ""]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    for run in runs:
        with open(out / f"live-{run.policy}.jsonl", "w") as fh:
            for r in run.records:
                fh.write(json.dumps(r.to_dict()) + "\n")
    return report


def _s(ms: float | None) -> str:
    return "-" if ms is None else f"{ms / 1000:.2f}"


def main(args: argparse.Namespace) -> int:
    requests = _slice(args)  # a bad --trace is a TraceError (UserError) before anything starts
    if not requests:
        raise UserError("the slice is empty; move --offset into the trace or raise --duration")
    out = Path(args.out or f"results/demo-{datetime.now():%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    doc = fleet_document({r: 2 for r in REGIONS}, profile=args.profile, name="demo")
    stop_flag = threading.Event()
    previous = {sig: signal.getsignal(sig) for sig in shutdown.STOP_SIGNALS}

    def interrupt(signum: int, _frame: object) -> None:
        """The first stop signal ends the demo after the current run, with a report; the next
        one (the previous handlers: gorgo.shutdown's) aborts at once."""
        shutdown.note(signum)
        print("\nstopping: ending this run, then the report (Ctrl-C again to abort at once)",
              file=sys.stderr)
        stop_flag.set()
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    for sig in shutdown.STOP_SIGNALS:
        signal.signal(sig, interrupt)
    baselines = [p for p in args.baselines.split(",") if p]
    print(f"gorgo demo: {len(requests)} requests of {args.trace} per run, "
          f"{args.duration:g} s each; live policies: gorgo, {', '.join(baselines) or '-'}",
          file=sys.stderr)
    runs: list[LiveRun] = []
    for policy in ["gorgo", *baselines]:
        if stop_flag.is_set():
            break
        runs.append(run_live(args, doc, policy, out, requests, stop_flag))
    offline: dict[str, list[float]] = {}
    if args.offline_policies and not stop_flag.is_set():
        from gorgo.core.policies import REGISTRY

        names = ([*REGISTRY, "oracle"] if args.offline_policies == "all"
                 else args.offline_policies.split(","))
        print(f"- offline simulation of the same slice: {len(names)} policies ...",
              file=sys.stderr)
        offline = run_offline(doc, requests, args.time_scale, names, args.seed)
    report = write_report(out, args, runs, offline, len(requests))
    print(f"\nreport: {report}")
    return 130 if stop_flag.is_set() else 0
