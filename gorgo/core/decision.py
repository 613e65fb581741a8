"""What routing one request yields: a decision (the replica, and the predicted cost split into its
terms, in ms) or a rejection (no routable replica, or shed by admission control)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

NO_REPLICA = "no_healthy_replica"
SHED = "shed"
TOO_LARGE = "context_length_exceeded"  # OpenAI's code: the request fits no replica
UNKNOWN_MODEL = "model_not_found"  # OpenAI's code: no replica serves the requested model


class NoReplicaAvailable(Exception):
    """Raised by a policy when every replica is ejected; the router turns it into a Rejection."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"no healthy replica; retry after {retry_after_s:.0f} s")
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class Decision:
    replica: int
    policy: str
    predicted_ms: float = float("nan")
    terms: dict[str, float] = field(default_factory=dict)  # term name -> unweighted ms
    uncached_tokens: int = 0
    prompt_tokens: int = 0
    weights_version: int = 0
    id: str = ""
    # Per-replica costs the policy ranked by (lower is better), for explain and fallbacks.
    scores: np.ndarray | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class Rejection:
    """The router refused the request: 503 (no routable replica) or 429 (shed), with Retry-After,
    or 400 (it fits no replica: retrying cannot help).

    Both drivers turn it into the same outcome: the live server answers ``status`` with an
    OpenAI-style error, the simulator records a failed request.
    """

    status: int
    reason: str  # NO_REPLICA, SHED, TOO_LARGE or UNKNOWN_MODEL
    retry_after_s: float
    message: str
    priority: int | None = None


RouteResult = Decision | Rejection


def next_best(d: Decision) -> int | None:
    """The routable replica ranked right after the chosen one (lowest other score), or None:
    where Envoy retries a failed attempt, live (`extproc.service`) and offline (`sim.offline`)."""
    if d.scores is None:
        return None
    others = np.asarray(d.scores, dtype=float).copy()
    others[d.replica] = np.inf
    j = int(np.argmin(others))
    return j if np.isfinite(others[j]) else None
