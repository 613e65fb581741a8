"""The command line: `python -m bench.dataplane [--quick] [--write-docs] [--connections N]`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from gorgo.core.fleet import parse_fleet
from gorgo.errors import at_least
from gorgo.harness.docblock import stop_on_signals

from . import ROOT
from . import __doc__ as DOC_STRING
from .load import run_load
from .report import DOC, SECTION, Results, render, write_docs
from .run import run_added, run_in_process, run_over_grpc, serve_noop, start_stack
from .workload import E2E_SIZE, FULL, N_REPLICAS, PATHS, QUICK, Plan, bench_fleet, make_workload


def _step(name: str) -> Callable[[], None]:
    t0 = time.perf_counter()
    print(f"[dataplane] {name} ...", file=sys.stderr, flush=True)
    return lambda: print(f"[dataplane] {name}: {time.perf_counter() - t0:.1f} s",
                         file=sys.stderr, flush=True)


@contextlib.contextmanager
def _tempdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="gorgo-dataplane-") as d:
        yield Path(d)


def run(plan: Plan, quick: bool, force_python_load: bool) -> Results:
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    wl = make_workload(plan.warm, per_size=6 if quick else 12)
    done = _step("in-process decisions")
    dummy = bench_fleet([f"127.0.0.1:{20000 + k}" for k in range(N_REPLICAS)])
    in_process = run_in_process(parse_fleet(dummy), wl, plan.decisions)
    done()
    use_wrk = shutil.which("wrk") is not None and not force_python_load
    generator = "wrk 4 (1 thread)" if use_wrk else "Python aiohttp (wrk not installed)"
    bodies = wl.measured[E2E_SIZE]
    with _tempdir() as tmp, contextlib.ExitStack() as stack:
        done = _step("starting upstream Envoy, gorgo extproc, no-op ext_proc, front Envoys")
        st = start_stack(stack, tmp)
        done()
        done = _step("gRPC decisions")
        over_grpc = run_over_grpc(st, wl, plan.grpc)
        done()
        done = _step("added latency at concurrency 1")
        added = run_added(st, bodies, plan.rounds)
        done()
        loads = []
        for path in PATHS:
            done = _step(f"saturating {path}")
            loads.append(run_load(st, path, bodies, plan, tmp, use_wrk))
            done()
    return Results(plan, quick, in_process, over_grpc, added, loads, generator, len(bodies),
                   time.perf_counter() - started, load_before, os.getloadavg()[0])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.dataplane",
                                description=DOC_STRING.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short smoke run (< 30 s)")
    p.add_argument("--write-docs", action="store_true",
                   help=f"write the results into the '{SECTION}' section of {DOC.name}")
    p.add_argument("--connections", type=at_least(1), default=None,
                   help=f"load generator connections (default {FULL.connections})")
    p.add_argument("--serve-noop", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--python-load", action="store_true",
                   help="use the Python load generator even when wrk is installed")
    args = p.parse_args(argv)
    if args.serve_noop is not None:
        asyncio.run(serve_noop(args.serve_noop))
        return 0
    stop_on_signals()
    plan = QUICK if args.quick else FULL
    if args.connections is not None:  # 0 was taken as "not given": the default 32 ran
        plan = dataclasses.replace(plan, connections=args.connections)
    command = ".venv/bin/python -m bench.dataplane" + "".join(
        f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    try:
        results = run(plan, args.quick, args.python_load)
    except KeyboardInterrupt:
        print("[dataplane] interrupted; every process it started was stopped", file=sys.stderr)
        return 130
    block = render(results, command)
    print(block)
    if args.write_docs:
        write_docs(block)
        print(f"[dataplane] wrote {DOC.relative_to(ROOT)}", file=sys.stderr)
    return 0

