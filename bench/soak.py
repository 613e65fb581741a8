"""Soak: the whole stack under steady load for a long time, watching every process's memory.

Stands up `gorgo sim fleet` + `gorgo extproc` + `gorgo tuner` + real Envoy
(gorgo.harness.stack.LiveStack),
replays the Azure conversation trace open-loop at ``--load`` of the fleet's capacity for
``--duration`` seconds, and reads each process's resident memory (VmRSS in /proc/PID/status)
every ``--sample`` seconds. When the load stops, the router must have nothing in flight and the
engines nothing running or queued.

Capacity is the project's load unit (sim/capacity.py, as in `gorgo bench sim`): the highest mean
arrival rate at which round-robin keeps up with this very trace slice in the offline simulator,
decode included. The simulated engines run at ``--speed`` (their prefill-rate hints scaled alike)
so that the rate is one two cores can drive through Envoy for the whole run.

Growth is counted from the end of the warm-up (``--warmup`` seconds, in which the engines' KV
caches and the router's prefix index fill up to their fixed capacities and allocator pools settle)
to the end of the run, so what it bounds is memory that keeps growing with traffic: a leak. The
bound (``--max-growth-mib`` per process, default 16) is small against the traffic the run carries:
16 MiB over the ~4,000 requests after a 5-minute warm-up is ~4 KiB per request. Failed requests
must stay under ``--max-error-rate`` (default 1 %): at 80 % of capacity none should fail.

Exit status 0 when every check holds, 1 otherwise. Usage:

    .venv/bin/python bench/soak.py [--duration 900] [--load 0.8] [--out soak.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from gorgo.core.fleet import FleetSpec, parse_fleet
from gorgo.core.tokens import Tokenization
from gorgo.harness.stack import LiveStack, StackOptions, with_free_ports
from gorgo.sim.capacity import Capacity, analytic_estimate, find_capacity
from gorgo.sim.presets import fleet_document
from gorgo.sim.replay import RequestRecord, replay
from gorgo.sim.traces import TraceRequest, azure_trace
from gorgo.sim.workload import workload_from_requests

PROFILE = "h100-llama3-8b"
LINKS = {"near": {"rtt_ms": 10.0, "jitter_ms": 1.0}, "far": {"rtt_ms": 60.0, "jitter_ms": 3.0}}
MIB = 1024 * 1024


def rss_bytes(pid: int) -> int | None:
    """Resident set size of a live process, from /proc (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def stack_pids(stack: LiveStack) -> dict[str, int]:
    pids = {name: proc.p.pid for name, proc in stack.procs.items()}
    if stack.envoy is not None and stack.envoy.proc is not None:
        pids["envoy"] = stack.envoy.proc.pid
    return pids


class MemorySampler:
    """Every ``period_s``, each process's RSS and the requests finished so far."""

    def __init__(self, pids: dict[str, int], period_s: float, done: list[RequestRecord]) -> None:
        self.pids = pids
        self.period_s = period_s
        self.done = done
        self.samples: list[dict[str, Any]] = []
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def sample(self) -> dict[str, Any]:
        row: dict[str, Any] = {"t_s": round(time.monotonic() - self.t0, 1),
                               "done": len(self.done)}
        row.update({name: rss_bytes(pid) for name, pid in self.pids.items()})
        self.samples.append(row)
        mem = "  ".join(f"{k} {row[k] / MIB:6.1f}" for k in self.pids if row[k] is not None)
        print(f"[soak] {row['t_s']:6.0f}s  done {row['done']:6d}  RSS MiB: {mem}",
              file=sys.stderr, flush=True)
        return row

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()

    def start(self) -> None:
        self.sample()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sample()


def fleet(speed: float) -> dict[str, Any]:
    doc = fleet_document({"near": 2, "far": 2}, profile=PROFILE, links=LINKS,
                         speed={"near": speed, "far": speed}, name="soak")
    doc["signals"] = {"probe_interval_s": 1.0, "scrape_interval_s": 0.5}
    return doc


def workload(duration_s: float, load: float, spec: FleetSpec,
             max_tokens: int) -> tuple[list[TraceRequest], float, Capacity]:
    """The first requests of the trace, time-scaled so that ``load`` x capacity arrive per second
    on average over ``duration_s``: (requests, time scale, capacity).

    The capacity is searched on the slice itself, and the slice's length depends on the capacity:
    two passes, starting from the optimistic prefill-only estimate."""
    tok = Tokenization(spec.chars_per_token, spec.block_tokens)
    trace = [replace(r, output_tokens=min(r.output_tokens, max_tokens)) for r in azure_trace()]
    n = len(trace)
    rate = analytic_estimate(spec, workload_from_requests("azure", trace, tok))
    for _ in range(2):
        n = min(len(trace), max(2, round(load * rate * duration_s)))
        capacity = find_capacity(spec, workload_from_requests("azure", trace[:n], tok), tol=0.05,
                                 key=f"azure[:{n}]")
        rate = capacity.rate_rps
    reqs = trace[:n]
    return reqs, workload_from_requests("azure", reqs, tok).scale_for_rate(load * rate), capacity


def summarize(samples: list[dict[str, Any]], names: list[str], warmup_s: float) -> dict[str, Any]:
    out = {}
    warm = next((s for s in samples if s["t_s"] >= warmup_s), samples[-1])
    for name in names:
        vals = [s[name] for s in samples if s.get(name) is not None]
        if not vals:
            continue
        late = [(s["done"], s[name]) for s in samples
                if s["t_s"] >= warm["t_s"] and s.get(name) is not None]
        done, rss = zip(*late, strict=True)
        # Slope of RSS against requests finished after the warm-up: what a leak would show.
        slope = float(np.polyfit(done, rss, 1)[0]) / 1024 if len(set(done)) > 1 else 0.0
        out[name] = {
            "start_mib": vals[0] / MIB, "warm_mib": warm[name] / MIB, "end_mib": vals[-1] / MIB,
            "max_mib": max(vals) / MIB, "growth_mib": (vals[-1] - vals[0]) / MIB,
            "growth_after_warmup_mib": (vals[-1] - warm[name]) / MIB,
            "kib_per_request_after_warmup": slope,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=900.0, help="seconds of load (default 900)")
    p.add_argument("--load", type=float, default=0.8, help="fraction of capacity (default 0.8)")
    p.add_argument("--speed", type=float, default=0.1, help="simulated engine speed factor")
    p.add_argument("--max-tokens", type=int, default=64, help="cap on output tokens")
    p.add_argument("--sample", type=float, default=10.0, help="seconds between RSS samples")
    p.add_argument("--warmup", type=float, default=300.0,
                   help="seconds before growth is counted (default 300)")
    p.add_argument("--max-growth-mib", type=float, default=16.0,
                   help="allowed RSS growth per process after the warm-up (default 16)")
    p.add_argument("--max-error-rate", type=float, default=0.01,
                   help="allowed fraction of failed requests (default 0.01)")
    p.add_argument("--out", type=Path, default=None, help="write samples and summary as JSON")
    args = p.parse_args(argv)

    doc = fleet(args.speed)
    reqs, scale, cap = workload(args.duration, args.load, parse_fleet(doc), args.max_tokens)
    capacity = cap.rate_rps
    print(f"[soak] capacity {capacity:.2f} req/s (round-robin keeps up; unstable at "
          f"{cap.unstable_rps:.2f}), offering {args.load:.0%} = {args.load * capacity:.2f} req/s: "
          f"{len(reqs)} requests over {args.duration:.0f} s", file=sys.stderr, flush=True)
    done: list[RequestRecord] = []
    with tempfile.TemporaryDirectory(prefix="gorgo-soak-") as tmp:
        stack = LiveStack(with_free_ports(doc), Path(tmp), StackOptions(tuner=True,
                                                                      stream_interval=16))
        with stack:
            pids = stack_pids(stack)
            sampler = MemorySampler(pids, args.sample, done)
            sampler.start()
            t0 = time.monotonic()
            try:
                tok = Tokenization(stack.spec.chars_per_token, stack.spec.block_tokens)
                result = asyncio.run(replay(reqs, stack.url, scale, tok=tok, timeout_s=300.0,
                                            on_result=done.append))
            finally:
                sampler.stop()
            wall = time.monotonic() - t0
            idle = stack.wait_idle(60)
            inflight = stack.inflight()
            open_decisions = sum(stack.metric_values("gorgo_open_decisions").values())
            engines = stack.fleet_status()
            busy = {k: v["running"] + v["waiting"] for k, v in engines.items()
                    if v["running"] + v["waiting"]}

    memory = summarize(sampler.samples, list(pids), args.warmup)
    s = result.summary
    errors = dict(Counter(k for r in result.records if (k := r.error_key) is not None))
    failed = len(result.records) - s["ok"]
    checks = {
        f"errors_within_{args.max_error_rate:g}": failed <= args.max_error_rate * len(reqs),
        "inflight_zero": idle and inflight == 0 and open_decisions == 0,
        "engines_idle": not busy,
        **{f"{name}_growth_within_{args.max_growth_mib:g}_mib":
           m["growth_after_warmup_mib"] <= args.max_growth_mib for name, m in memory.items()},
    }
    report = {
        "duration_s": wall, "capacity_rps": capacity, "offered_rps": args.load * capacity,
        "requests": len(reqs), "ok": s["ok"], "errors": errors,
        "ttft_ms": {k: s["ttft_ms"][k] for k in ("p50", "p95", "p99")},
        "slip_ms_p99": s["slip_ms"]["p99"], "memory": memory, "inflight_after": inflight,
        "open_decisions_after": open_decisions, "engines_busy_after": busy, "checks": checks,
        "samples": sampler.samples,
    }
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))
    print(f"\nsoak: {wall:.0f} s, {len(reqs)} requests at {args.load * capacity:.1f} req/s "
          f"({args.load:.0%} of {capacity:.1f}), ok {s['ok']}, errors {errors or 'none'}, "
          f"TTFT p50/p95 {s['ttft_ms']['p50']:.0f}/{s['ttft_ms']['p95']:.0f} ms")
    print(f"{'process':8} {'start':>8} {'warm':>8} {'end':>8} {'max':>8} {'growth':>8} "
          f"{'after warm-up':>14}  (MiB)  {'KiB/request after warm-up':>26}")
    for name, m in memory.items():
        print(f"{name:8} {m['start_mib']:8.1f} {m['warm_mib']:8.1f} {m['end_mib']:8.1f} "
              f"{m['max_mib']:8.1f} {m['growth_mib']:+8.1f} {m['growth_after_warmup_mib']:+14.1f}"
              f"        {m['kib_per_request_after_warmup']:+26.2f}")
    print(f"in flight after the load: {inflight:g} (open decisions {open_decisions:g}), "
          f"engines busy: {busy or 'none'}")
    broken = [k for k, ok in checks.items() if not ok]
    print("checks: " + ("all passed" if not broken else "FAILED " + ", ".join(broken)))
    return 0 if not broken else 1


if __name__ == "__main__":
    sys.exit(main())
