"""Latency summaries shared by the replay client, the offline simulator and the benches.

One definition of "p95" everywhere (numpy's linear interpolation between closest ranks) keeps
numbers from different tools comparable. Empty inputs give ``None`` fields rather than NaN so the
summaries stay valid JSON.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

PERCENTILES: tuple[int, ...] = (50, 90, 95, 99)


@dataclass(frozen=True, slots=True)
class Summary:
    """Distribution of one metric; every field but ``count`` is ``None`` when there is no data."""

    count: int
    mean: float | None = None
    min: float | None = None
    max: float | None = None
    p50: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None

    def to_dict(self) -> dict[str, float | int | None]:
        return asdict(self)

    def format(self, unit: str = "ms", digits: int = 1) -> str:
        """One line for terminals and reports, e.g. ``n=120 mean=41.2 p50=40.0 ... ms``."""
        if self.count == 0:
            return "n=0"
        parts = [f"n={self.count}"]
        for name in ("mean", "p50", "p90", "p95", "p99", "max"):
            parts.append(f"{name}={getattr(self, name):.{digits}f}")
        return " ".join(parts) + (f" {unit}" if unit else "")


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``values``; ``None`` when empty."""
    arr = _finite(values)
    if arr.size == 0:
        return None
    return float(np.percentile(arr, q))


def summarize(values: Iterable[float]) -> Summary:
    """Count, mean, extremes and p50/p90/p95/p99 of the finite values (NaN/None are skipped)."""
    arr = _finite(values)
    if arr.size == 0:
        return Summary(count=0)
    p50, p90, p95, p99 = (float(v) for v in np.percentile(arr, PERCENTILES))
    return Summary(
        count=int(arr.size),
        mean=float(arr.mean()),
        min=float(arr.min()),
        max=float(arr.max()),
        p50=p50,
        p90=p90,
        p95=p95,
        p99=p99,
    )


def rate_per_s(count: int, span_s: float) -> float | None:
    """Events per second over ``span_s``; ``None`` when the span is empty."""
    if span_s <= 0:
        return None
    return count / span_s


def _finite(values: Iterable[float | None]) -> np.ndarray:
    arr = np.fromiter((np.nan if v is None else v for v in values), dtype=float)
    return arr[np.isfinite(arr)]


def jsonable(obj: Any) -> Any:
    """JSON-safe copy: non-finite floats become null, tuples lists, numpy scalars plain numbers."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj
