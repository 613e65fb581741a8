"""prefill: the time to prefill the part of this prompt the replica does not cache.

Unweighted: the prefill rate itself is calibrated (the tuner publishes per-replica rates), so the
term is already in milliseconds of real work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from gorgo.core.terms.base import FIXED, CostTerm

if TYPE_CHECKING:
    from gorgo.core.features import RequestFeatures
    from gorgo.core.state import FleetState


def _prefill(f: RequestFeatures, s: FleetState) -> np.ndarray:
    return s.uncached_tokens(f) * (1000.0 / s.prefill_rate)


TERM = CostTerm(
    name="prefill", doc="prefill of the uncached part of the prompt", compute=_prefill, fit=FIXED,
)
