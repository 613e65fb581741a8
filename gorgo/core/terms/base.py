"""What a cost term is: a named, per-replica price in milliseconds, and how it is weighted.

A term is data, not code threaded through the router: the total, the decision's fields, the span
tags, the admin API's validation, `explain` and the tuner's search space all iterate over the
registry (`gorgo.core.terms.TERMS`), so adding a term touches its own module and the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from gorgo.core.features import RequestFeatures
    from gorgo.core.state import FleetState

# How the tuner's weight fit treats a term's weight (see tuner/weight_fit.py):
ANCHOR = "anchor"  # physics fixes it at 1 (a request pays its round trip once)
FREE = "free"  # fitted: the router's estimate may be off by a factor
FIXED = "fixed"  # not weighted (always 1), still part of the predicted latency
EXCLUDED = "excluded"  # not a latency prediction (a penalty): left out of the fit


@dataclass(frozen=True, slots=True)
class CostTerm:
    """One term of the cost; ``compute`` returns its unweighted value per replica in ``unit``.

    ``weight`` is the key of its weight in `Weights` (None: always weighted 1), with its default
    and the bounds every process enforces (fleet file, admin API, tuner).
    """

    name: str
    doc: str
    compute: Callable[[RequestFeatures, FleetState], np.ndarray]
    unit: str = "ms"
    weight: str | None = None
    default: float = 1.0
    bounds: tuple[float, float] = (1.0, 1.0)
    fit: str = FIXED

    @property
    def field(self) -> str:
        """Its name in a decision, the `gorgo.*` metadata and span tags, e.g. ``rtt_ms``."""
        return f"{self.name}_{self.unit}"
