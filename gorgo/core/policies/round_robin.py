"""round-robin: each routable replica in turn, blind to load, cache and network (baseline)."""

from __future__ import annotations

import numpy as np

from gorgo.core.decision import Decision
from gorgo.core.features import RequestFeatures
from gorgo.core.policies.base import PolicyBase
from gorgo.core.state import FleetState


class RoundRobin(PolicyBase):
    name = "round-robin"

    def choose(self, f: RequestFeatures, s: FleetState) -> Decision:
        # Distance ahead of the cursor: the next routable replica scores lowest.
        order = (np.arange(s.n) - self._ticks) % s.n
        return self.pick_lowest(order, s)
