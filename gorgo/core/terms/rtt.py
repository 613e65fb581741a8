"""rtt: the network round trip to the replica, from this router's probes (EWMA).

A replica not probed yet is priced at the worst RTT known, never as free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from gorgo.core.terms.base import ANCHOR, CostTerm

if TYPE_CHECKING:
    from gorgo.core.features import RequestFeatures
    from gorgo.core.state import FleetState


def _rtt(f: RequestFeatures, s: FleetState) -> np.ndarray:
    return s.rtt_or_default()


TERM = CostTerm(
    name="rtt", doc="network round trip to the replica (probed EWMA)", compute=_rtt,
    weight="rtt", default=1.0, bounds=(0.05, 20.0), fit=ANCHOR,
)
