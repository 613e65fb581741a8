"""3. Saturated throughput through each front Envoy: wrk (or an aiohttp fallback), with the CPU
each process and the whole machine used over the run."""

from __future__ import annotations

import asyncio
import re
import resource
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from gorgo.harness.envoy_proc import EnvoyProcess

from .run import Stack
from .stats import Dist, cpu_s, machine_busy_s, metric_values, self_cpu
from .workload import CHAT_PATH, ROUTED_PATHS, Plan

PROCESSORS = {"noop": "no-op ext_proc", "noop-skip-both": "no-op ext_proc",
              "routed": "gorgo extproc", "workers2": "gorgo extproc (supervisor + 2 workers)",
              "skip": "gorgo extproc", "skip-both": "gorgo extproc"}


@dataclass
class Load:
    path: str
    requests: int
    seconds: float
    errors: int
    p50_ms: float
    p99_ms: float
    cpu_cores: dict[str, float] = field(default_factory=dict)
    decisions: int = 0  # decisions the router made during the run
    fail_open: int = 0  # requests Envoy let through unrouted (ext_proc failure or timeout)
    machine_cores: float = 0.0  # the whole machine's busy cores over the run, any process

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    @property
    def routed_rps(self) -> float:
        """Answered requests that the router routed (not failed open, not errors), per second."""
        return (self.requests - self.errors - self.fail_open) / self.seconds


def _lua_script(bodies: list[bytes]) -> str:
    def quote(b: bytes) -> str:
        level = "=" * 3
        while f"]{level}]" in b.decode():
            level += "="
        return f"[{level}[{b.decode()}]{level}]"

    return "\n".join([
        "local bodies = {" + ",\n".join(quote(b) for b in bodies) + "}",
        "local reqs = {}",
        "local i = 0",
        "init = function(args)",
        "  for k, b in ipairs(bodies) do",
        f'    reqs[k] = wrk.format("POST", "{CHAT_PATH}", '
        '{["Content-Type"] = "application/json"}, b)',
        "  end",
        "end",
        "request = function()",
        "  i = i % #reqs + 1",
        "  return reqs[i]",
        "end",
        "",
    ])


_WRK_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0}


def _wrk_latency(out: str, pct: str) -> float:
    m = re.search(rf"^\s*{pct}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
    return float(m.group(1)) * _WRK_UNITS[m.group(2)] if m else float("nan")


def _run_wrk(url: str, script: Path, plan: Plan, seconds: float) -> tuple[Load, float]:
    """wrk's figures and its own CPU seconds (it is this process's only child that exits)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(
        ["wrk", "-t1", f"-c{plan.connections}", f"-d{seconds:g}s", "--latency", "--timeout", "5s",
         "-s", str(script), url + CHAT_PATH],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=seconds + 30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    m = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s)", out)
    if proc.returncode != 0 or m is None:
        raise RuntimeError(f"wrk failed ({proc.returncode}): {out}")
    took = float(m.group(2)) * _WRK_UNITS[m.group(3)] / 1000
    errors = 0
    if e := re.search(r"Non-2xx or 3xx responses: (\d+)", out):
        errors += int(e.group(1))
    if e := re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out):
        errors += sum(int(g) for g in e.groups())
    load = Load("", int(m.group(1)), took, errors, _wrk_latency(out, "50"), _wrk_latency(out, "99"))
    return load, cpu


async def _aiohttp_load(url: str, bodies: list[bytes], conns: int, seconds: float) -> Load:
    """Fallback closed-loop generator; in one Python process it is usually the bottleneck."""
    times: list[float] = []
    errors = 0
    deadline = time.perf_counter() + seconds

    async def worker(session: aiohttp.ClientSession, k: int) -> None:
        nonlocal errors
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            try:
                async with session.post(url + CHAT_PATH, data=bodies[k % len(bodies)],
                                        headers={"content-type": "application/json"}) as r:
                    await r.read()
                    ok = r.status == 200
            except aiohttp.ClientError:
                ok = False
            times.append((time.perf_counter() - t0) * 1000)
            errors += not ok
            k += 1

    start = time.perf_counter()
    connector = aiohttp.TCPConnector(limit=conns)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(worker(session, k) for k in range(conns)))
    took = time.perf_counter() - start
    d = Dist.of(times) if times else Dist(float("nan"), float("nan"), float("nan"), 0)
    return Load("", len(times), took, errors, d.p50, d.p99)


def _decisions(st: Stack, path: str) -> int:
    return int(sum(metric_values(st.metrics_ports[path], "gorgo_decisions_total")))


def _fail_open(envoy: EnvoyProcess) -> int:
    """Requests Envoy let through unrouted: ``failure_mode_allowed`` counts every cause (a timed
    out answer, a refused or broken stream). A timeout also counts in ``message_timeouts``, so
    adding that counted each timed-out request twice (3 fail-opens read as 6)."""
    stats = envoy.stats("ext_proc")
    return sum(v for k, v in stats.items() if k.endswith(".failure_mode_allowed"))


def run_load(st: Stack, path: str, bodies: list[bytes], plan: Plan, tmp: Path,
             use_wrk: bool) -> Load:
    url = f"http://127.0.0.1:{st.ports[path]}"
    front = st.fronts[path]
    pids = {"front Envoy": [front.proc.pid], "upstream Envoy": [st.upstream.proc.pid]}
    processors = st.processor_pids(path)
    if processors:
        pids[PROCESSORS[path]] = processors
    routed = path in ROUTED_PATHS
    cpu0 = {k: sum(map(cpu_s, ps)) for k, ps in pids.items()}
    busy0 = machine_busy_s()
    self0 = self_cpu()
    dec0, fo0 = _decisions(st, path) if routed else 0, _fail_open(front)
    if use_wrk:
        script = tmp / "post.lua"
        script.write_text(_lua_script(bodies))
        load, gen_cpu = _run_wrk(url, script, plan, plan.saturate_s)
        gen_name = "wrk"
    else:
        load = asyncio.run(_aiohttp_load(url, bodies, plan.connections, plan.saturate_s))
        gen_cpu = self_cpu() - self0
        gen_name = "load generator (aiohttp)"
    load.path = path
    load.machine_cores = (machine_busy_s() - busy0) / load.seconds
    load.cpu_cores = {k: (sum(map(cpu_s, ps)) - cpu0[k]) / load.seconds
                      for k, ps in pids.items()}
    load.cpu_cores[gen_name] = gen_cpu / load.seconds
    if path != "alone":
        load.fail_open = _fail_open(front) - fo0
    if routed:
        load.decisions = _decisions(st, path) - dec0
    return load
