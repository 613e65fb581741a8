"""least-request: fewest requests in flight from this router (Envoy's LEAST_REQUEST idea)."""

from __future__ import annotations

from gorgo.core.decision import Decision
from gorgo.core.features import RequestFeatures
from gorgo.core.policies.base import PolicyBase
from gorgo.core.state import FleetState


class LeastRequest(PolicyBase):
    name = "least-request"

    def choose(self, f: RequestFeatures, s: FleetState) -> Decision:
        return self.pick_lowest(s.inflight_reqs, s)
