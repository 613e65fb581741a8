"""What routing one request yields: a decision (the replica, and the predicted cost split into its
terms, in ms) or a rejection (no routable replica, or shed by admission control)."""

from __future__ import annotations

import zlib
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
    # The replicas it could have chosen (healthy, not draining, serving the request's model):
    # a fallback among them where the policy scored every other one infinite ("not preferred").
    routable: np.ndarray | None = field(default=None, repr=False)


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
    where Envoy retries a failed attempt, live (`extproc.service`) and offline (`sim.offline`).
    Policies score a replica they do not prefer infinite (prefix-cache's uncached ones, irb's
    unweighted ones, `slo`'s that miss the targets); when every other routable one is, the
    fallback is one of those, spread by the decision's id, rather than no retry at all."""
    if d.scores is None:
        return None
    others = np.asarray(d.scores, dtype=float).copy()
    others[d.replica] = np.inf
    j = int(np.argmin(others))
    if np.isfinite(others[j]):
        return j
    if d.routable is None:
        return None
    rest = np.flatnonzero(d.routable)
    rest = rest[rest != d.replica]
    return int(rest[zlib.crc32(d.id.encode()) % len(rest)]) if len(rest) else None
