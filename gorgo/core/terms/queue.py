"""queue: how long this request waits for the prompts already queued for prefill on the replica.

The waiting prompt tokens (this router's own backlog, or a fresh engine scrape if larger) divided
by the replica's prefill rate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from gorgo.core.terms.base import FREE, CostTerm

if TYPE_CHECKING:
    from gorgo.core.features import RequestFeatures
    from gorgo.core.state import FleetState


def _queue(f: RequestFeatures, s: FleetState) -> np.ndarray:
    return s.waiting_tokens() * (1000.0 / s.prefill_rate)


TERM = CostTerm(
    name="queue", doc="wait for the prefill already queued on the replica", compute=_queue,
    weight="queue", default=1.0, bounds=(0.05, 20.0), fit=FREE,
)
