"""Weight points as the bench handles them: mappings weight key -> factor, one entry per weighted
term of the registry (`gorgo.core.terms.WEIGHTED`, in its order), and the keys, labels and grids
built from them."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import numpy as np

from gorgo.core.terms import TTFT, WEIGHTED, weight_keys
from gorgo.core.weights import Weights

# The grid's weights: the TTFT objective's search space (tuner.optimizer.KEYS). Another
# objective searches more (`weight_keys`); its grid holds the others at their defaults.
KEYS: tuple[str, ...] = weight_keys(TTFT)
Point = dict[str, float]


def default_point(keys: Sequence[str] = KEYS) -> Point:
    """The searched weights' defaults (what a fleet file without ``weights`` routes with)."""
    defaults = Weights()
    return {k: defaults[k] for k in keys}


def keys_of(p: Mapping[str, float]) -> tuple[str, ...]:
    """The weights a point names, in registry order."""
    return tuple(k for k in WEIGHTED if k in p)


def values(p: Mapping[str, float], keys: Sequence[str] = KEYS) -> tuple[float, ...]:
    return tuple(float(p[k]) for k in keys)


def point_key(p: Mapping[str, float], keys: Sequence[str] | None = None) -> str:
    """Exact (repr) floats joined by ``|``, in registry order: ``1.0|0.5`` for rtt 1, queue 0.5;
    of ``keys``, else of every weight it names (a point of the TTFT keys keeps the key earlier
    versions wrote)."""
    return "|".join(repr(float(p[k])) for k in (keys_of(p) if keys is None else keys))


def static_key(p: Mapping[str, float], rates: Mapping[str, float], seed: int) -> str:
    """A static run's cache key; exact floats, so an incumbent is re-run with the very weights it
    held. With today's two weights it is the key earlier versions of the bench wrote."""
    r = ",".join(f"{k}={v!r}" for k, v in sorted(rates.items()))
    return f"{point_key(p)}|{r}|{seed}"


def label(p: Mapping[str, float], keys: Sequence[str] | None = None, sep: str = ",") -> str:
    """``20,0.05``: the values in registry order, as ``--start`` takes them (of ``keys``, else
    of every weight it names)."""
    return sep.join(f"{float(p[k]):g}" for k in (keys_of(p) if keys is None else keys))


def grid_axes(bounds: Mapping[str, Sequence[float]], k: int) -> dict[str, list[float]]:
    """``k`` log-spaced values per weight over its (lo, hi)."""
    return {key: [float(x) for x in np.geomspace(bounds[key][0], bounds[key][1], k)]
            for key in KEYS}


def grid(axes: Mapping[str, Sequence[float]], keys: Sequence[str] = KEYS) -> list[Point]:
    """Every combination of the axes' values (the cartesian product, first key slowest)."""
    return [dict(zip(keys, combo, strict=True))
            for combo in itertools.product(*(axes[k] for k in keys))]


def parse_start(text: str, keys: Sequence[str] = KEYS) -> Point:
    """``--start``: ``rtt=20,queue=0.05`` (an unnamed weight takes its default), or the values in
    registry order, ``20,0.05``; over the searched ``keys``."""
    parts = [p.strip() for p in text.split(",")]
    shape = (f"{','.join(f'{k.upper()}' for k in keys)} or "
             f"{','.join(f'{k}=X' for k in keys)}")
    try:
        if any("=" in p for p in parts):
            named = {}
            for part in parts:
                key, eq, value = part.partition("=")
                if not eq:
                    raise ValueError
                named[key.strip()] = value
            unknown = sorted(set(named) - set(keys))
            if unknown:
                raise ValueError(f"--start: unknown weight {unknown[0]!r} (known: "
                                 f"{', '.join(keys)})")
            point = {**default_point(keys), **{k: float(v) for k, v in named.items()}}
        else:
            if len(parts) != len(keys):
                raise ValueError
            point = dict(zip(keys, (float(p) for p in parts), strict=True))
    except ValueError as exc:
        if str(exc).startswith("--start"):
            raise
        raise ValueError(f"--start: expected {shape}, got {text!r}") from None
    if not all(math.isfinite(v) and v > 0 for v in point.values()):
        raise ValueError(f"--start: weights must be finite and > 0, got {text!r}")
    return point
