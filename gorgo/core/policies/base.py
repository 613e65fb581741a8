"""What every policy shares: the interface and a tie-break that favours no replica."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from gorgo.core.decision import Decision, NoReplicaAvailable
from gorgo.core.features import RequestFeatures
from gorgo.core.fleet import FleetSpec
from gorgo.core.state import FleetState


class Policy(Protocol):
    """A pure, synchronous scorer: features and fleet state in, a decision out. No I/O."""

    name: str

    def choose(self, f: RequestFeatures, s: FleetState) -> Decision: ...


class PolicyBase:
    """Shared plumbing: masking of unroutable replicas and the rotating tie-break."""

    name = "base"

    def __init__(self, spec: FleetSpec) -> None:
        self.spec = spec
        self._ticks = 0

    def pick_lowest(self, scores: np.ndarray, s: FleetState) -> Decision:
        """The lowest score among routable replicas; ties rotate so none is favoured."""
        masked = np.where(s.routable(), scores.astype(float), np.inf)
        best = masked.min()
        if not np.isfinite(best):
            raise NoReplicaAvailable(retry_after(s))
        ties = np.flatnonzero(masked <= best + 1e-9 * max(1.0, abs(best)))
        self._ticks += 1
        i = int(ties[self._ticks % len(ties)])
        return Decision(replica=i, policy=self.name, scores=masked)


def retry_after(s: FleetState) -> float:
    """Seconds until the first ejected replica is probed again (at least 1)."""
    return max(1.0, float(np.min(s.retry_at) - s.now)) if s.n else 1.0
