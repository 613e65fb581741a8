"""Every series the router and the tuner export, and Prometheus' naming rules as a check.

Series are read from the metric families the collectors describe, not from samples, so a labelled
counter that has not counted anything yet is still listed.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from pathlib import Path

from prometheus_client import Metric

from extproc.admin import AdminApi
from extproc.telemetry import RouterMetrics
from gorgo.core.fleet import parse_fleet
from gorgo.core.router import Router
from tuner.main import TunerService, _StatusCollector, parse_config

# What each family type exposes (the text format's sample names).
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"),
            "summary": ("_sum", "_count", ""), "info": ("_info",)}
SNAKE = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+)*")
# Units that are not Prometheus base units, as a name's word: use _seconds, _bytes, _ratio.
NON_BASE_UNITS = {"ms", "us", "ns", "msec", "millis", "milliseconds", "microseconds",
                  "nanoseconds", "minutes", "hours", "days", "percent", "pct", "kb", "mb", "gb",
                  "kib", "mib", "gib", "kilobytes", "megabytes", "bits", "per_s"}
# A dimensionless 0-1 quantity: the name ends in _ratio.
RATIO_WORDS = {"usage", "utilization", "fraction", "share"}


def naming_problems(name: str, kind: str) -> list[str]:
    """Why a metric family's name breaks Prometheus' naming conventions (empty: it does not)."""
    out = []
    if not SNAKE.fullmatch(name):
        out.append("not snake_case")
    if not name.startswith("gorgo_"):
        out.append("no gorgo_ namespace")
    words = name.split("_")
    bad = NON_BASE_UNITS & ({*words} | {"_".join(p) for p in itertools.pairwise(words)})
    if bad:
        out.append(f"non-base unit {sorted(bad)}")
    if RATIO_WORDS & set(words) and not name.endswith("_ratio"):
        out.append("a 0-1 quantity without _ratio")
    if name.endswith(("_total", "_created", "_count", "_sum", "_bucket")):
        out.append("a reserved suffix in the family name")
    if kind == "histogram" and not name.endswith(("_seconds", "_bytes", "_ratio", "_tokens")):
        out.append("a histogram without a unit")
    return out


def exposed(families: Iterable[Metric]) -> dict[str, str]:
    """Sample name -> family type, as the text format exposes them."""
    return {f.name + suffix: f.type for f in families for suffix in SUFFIXES[f.type]}


def router_families() -> list[Metric]:
    router = Router(parse_fleet({
        "regions": {"near": {}},
        "replicas": [{"name": "r0", "engine": "sglang", "region": "near",
                      "address": "127.0.0.1:1"}],
    }))
    metrics = RouterMetrics(router.state, lambda: 0)
    AdminApi(router, None, metrics.registry)  # registers the admin API's counter
    return list(metrics.registry.collect())


def tuner_families(tmp: Path) -> list[Metric]:
    (tmp / "token").write_text("t")
    svc = TunerService(parse_config(
        {"routers": [{"url": "http://127.0.0.1:1", "token_file": "token"}],
         "token_file": "token"}, tmp))
    return list(_StatusCollector(svc).collect())
