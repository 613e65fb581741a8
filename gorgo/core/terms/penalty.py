"""penalty: a decaying price on a replica that misbehaves (failed responses, failed probes).

Not a latency prediction, so the tuner's weight fit leaves it out; it is in the cost so that a
replica that fails fast never looks cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from gorgo.core.terms.base import EXCLUDED, CostTerm

if TYPE_CHECKING:
    from gorgo.core.features import RequestFeatures
    from gorgo.core.state import FleetState


def _penalty(f: RequestFeatures, s: FleetState) -> np.ndarray:
    return s.penalty()


TERM = CostTerm(
    name="penalty", doc="decaying anomaly penalty (failures)", compute=_penalty, fit=EXCLUDED,
)
