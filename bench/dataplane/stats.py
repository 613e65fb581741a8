"""Latency distributions, and the CPU and counter readings the runs take."""

from __future__ import annotations

import os
import resource
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class Dist:
    p50: float
    p90: float
    p99: float
    n: int

    @classmethod
    def of(cls, ms: list[float] | np.ndarray) -> Dist:
        a = np.asarray(ms, dtype=float)
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        return cls(float(p50), float(p90), float(p99), len(a))


def metric_values(port: int, name: str) -> list[float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
        text = r.read().decode()
    return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith((name + "{", name + " "))]


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy (all processes, all cores) since boot."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process, all threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def self_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime
