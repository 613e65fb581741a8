"""reuse: what the following requests lose when this one goes where its prefix is not cached.

The `prefill` term prices this request's own re-prefill of a prefix cached elsewhere. A move also
costs what follows: the session's next turns (or the next requests sharing the prefix) find
their cache split between replicas, and the copy pushes other prefixes out of the new one's
cache. The greedy TTFT choice does not see that, so it breaks a session away from its cached
replica for a small gain (issue 13: on `chat` the sticky peers reach 81-83 % cache hits against
gorgo's 71-75 %). This term prices it as the re-prefill the following turns would repeat:

    reuse_i = (cached_best - cached_i) * 1000 / prefill_rate_i * turns

with ``cached_best`` the most tokens of this prompt any replica it may go to caches (healthy,
not draining, serving its model: `FleetState.routable`), and ``turns`` the expected number of
further requests that reuse a prefix, learned online as a fleet EWMA: ``FleetState.reuse_share``
is the share of each routed prompt already cached on its best replica of its model, and a prefix
reused with probability r is reused r / (1 - r) more times on average (geometric). Capped at
``MAX_SHARE`` so a trace whose prompts all share one system prompt does not price a move as
forever. Zero for the best-cached replica and wherever
nothing is cached.

Weighted (``reuse``) and no latency prediction (the tuner's fit leaves it out); the `e2e` and
`slo` objectives count it, the TTFT objective (the paper's cost) does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from gorgo.core.terms.base import E2E, EXCLUDED, SLO, CostTerm

if TYPE_CHECKING:
    from gorgo.core.features import RequestFeatures
    from gorgo.core.state import FleetState

MAX_SHARE = 0.9  # at most 9 further turns expected
REUSE_EWMA_ALPHA = 0.01  # per routed request: about the last 100 requests


def expected_turns(s: FleetState) -> float:
    """Further requests expected to reuse a prefix, from the learned reuse share."""
    r = min(s.reuse_share, MAX_SHARE)
    return r / (1.0 - r)


def cached_tokens(f: RequestFeatures, s: FleetState) -> np.ndarray:
    """Tokens of this prompt each replica caches (at most the prompt)."""
    return np.minimum(s.matched_blocks(f) * s.spec.block_tokens, f.prompt_tokens)


def _reuse(f: RequestFeatures, s: FleetState) -> np.ndarray:
    cached = cached_tokens(f, s)
    live = s.routable()
    turns = expected_turns(s)
    if turns == 0.0 or not live.any():
        return np.zeros(s.n)
    lost = np.maximum(cached[live].max() - cached, 0)
    return lost * (1000.0 / s.prefill_rate) * turns


TERM = CostTerm(
    name="reuse", doc="re-prefill the following turns repeat if this one leaves its cache",
    compute=_reuse, weight="reuse", default=1.0, bounds=(0.05, 20.0), fit=EXCLUDED,
    objectives=frozenset({E2E, SLO}),
)
