"""What a cost term is: a named, per-replica price in milliseconds, and how it is weighted.

A term is data, not code threaded through the router: the total, the decision's fields, the span
tags, the admin API's validation, `explain` and the tuner's search space all iterate over the
registry (`gorgo.core.terms.TERMS`), so adding a term touches its own module and the registry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
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

# What a fleet may minimise (`objective:` in the fleet file): the predicted time to first token
# (the GORGO paper's cost), the whole request (first token plus decoding, with what this request
# costs the others already decoding there), or the whole request among the replicas predicted to
# meet the request's TTFT and time-per-output-token targets (the least violating when none does).
TTFT = "ttft"
E2E = "e2e"
SLO = "slo"
OBJECTIVES = (TTFT, E2E, SLO)


@dataclass(frozen=True, slots=True)
class CostTerm:
    """One term of the cost; ``compute`` returns its unweighted value per replica in ``unit``.

    ``weight`` is the key of its weight in `Weights` (None: always weighted 1), with its default
    and the bounds every process enforces (fleet file, admin API, tuner). ``objectives`` are the
    objectives whose total includes the term (a TTFT term counts for every objective). ``params``
    are per-replica constants the term reads from ``FleetState.params[name]``, with defaults, so a
    term needs no field of its own in the fleet state.
    """

    name: str
    doc: str
    compute: Callable[[RequestFeatures, FleetState], np.ndarray]
    unit: str = "ms"
    weight: str | None = None
    default: float = 1.0
    bounds: tuple[float, float] = (1.0, 1.0)
    fit: str = FIXED
    objectives: frozenset[str] = frozenset(OBJECTIVES)
    params: Mapping[str, float] = field(default_factory=dict)

    @property
    def field(self) -> str:
        """Its name in a decision, the `gorgo.*` metadata and span tags, e.g. ``rtt_ms``."""
        return f"{self.name}_{self.unit}"
