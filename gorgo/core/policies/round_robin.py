"""round-robin: each routable replica in turn, blind to load, cache and network (baseline)."""

from __future__ import annotations

import numpy as np

from gorgo.core.decision import Decision
from gorgo.core.features import RequestFeatures
from gorgo.core.policies.base import PolicyBase
from gorgo.core.state import FleetState


class RoundRobin(PolicyBase):
    name = "round-robin"
    carried = ("_cursor",)
    _cursor = 0

    def choose(self, f: RequestFeatures, s: FleetState) -> Decision:
        # Distance ahead of the cursor: the next routable replica scores lowest, and the cursor
        # moves past the one chosen, so an ejected replica's turn is not given to its neighbour.
        d = self.pick_lowest((np.arange(s.n) - self._cursor) % s.n, s)
        self._cursor = d.replica + 1
        return d
