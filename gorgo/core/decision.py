"""A routing decision: the replica, and the predicted TTFT split into its terms (all in ms)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class NoReplicaAvailable(Exception):
    """Every replica is ejected or unroutable: answer 503 with Retry-After."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"no healthy replica; retry after {retry_after_s:.0f} s")
        self.retry_after_s = retry_after_s


class Shed(Exception):
    """Admission control refused the request: answer 429 with Retry-After."""

    def __init__(self, predicted_ms: float, limit_ms: float, retry_after_s: float) -> None:
        super().__init__(
            f"best predicted TTFT {predicted_ms:.0f} ms exceeds the limit {limit_ms:.0f} ms"
        )
        self.predicted_ms = predicted_ms
        self.limit_ms = limit_ms
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class Decision:
    replica: int
    policy: str
    predicted_ms: float = float("nan")
    rtt_ms: float = float("nan")
    queue_ms: float = float("nan")
    prefill_ms: float = float("nan")
    penalty_ms: float = 0.0
    uncached_tokens: int = 0
    prompt_tokens: int = 0
    weights_version: int = 0
    id: str = ""
    # Per-replica costs the policy ranked by (lower is better), for explain and fallbacks.
    scores: np.ndarray | None = field(default=None, repr=False)
