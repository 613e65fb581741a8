"""A routing decision: the replica, and the predicted TTFT split into its terms (all in ms)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class NoReplicaAvailable(Exception):
    """Every replica is ejected or unroutable: answer 503 with Retry-After."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"no healthy replica; retry after {retry_after_s:.0f} s")
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class Decision:
    replica: int
    policy: str
    predicted_ms: float = float("nan")
    rtt_ms: float = float("nan")
    queue_ms: float = float("nan")
    prefill_ms: float = float("nan")
    uncached_tokens: int = 0
    prompt_tokens: int = 0
    weights_version: int = 0
    id: str = ""
    # Per-replica costs the policy ranked by (lower is better), for explain and fallbacks.
    scores: np.ndarray | None = field(default=None, repr=False)
