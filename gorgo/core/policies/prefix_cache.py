"""prefix-cache: AIBrix's prefix-cache router with its code defaults.

Source: vllm-project/aibrix pkg/plugins/gateway/algorithms/prefix_cache.go (the version with
``podRunningRequestImbalanceAbsCount = 8`` and ``standardDeviationFactor = 1``), its prefix index
pkg/utils/prefixcacheindexer/hash.go, and least_request.go for the fallback. The rule:

1. Over ready replicas, if max - min running requests > 8, the load is imbalanced: pick a
   replica with the fewest running requests (AIBrix: random among them).
2. Else match the prompt's chained block hashes: a replica's match is the integer percentage
   ``matched_blocks * 100 // prompt_blocks``; replicas with no matched block are not candidates.
   Candidates are ranked by highest percentage, then fewest running requests (AIBrix shuffles
   first, so full ties are random); the first one whose running count is <= mean + 1 sample
   standard deviation of the running counts of all ready replicas wins.
3. No candidate (no match, or every match overloaded): fewest running requests.

"Running" is what AIBrix reads as ``RealtimeNumRequestsRunning``: the gateway's own count of
requests it has in flight per pod. We use ``s.inflight_reqs`` and, where an engine scrape is
fresh and shows more running requests (load from other routers, which AIBrix's Redis-shared
counter would see), the scraped count. A stale scrape never replaces the exact local count.

Newer AIBrix releases replace step 1 by a load gate (max > 2 * (mean + 1) and a gap of at least
8 restricts matching to the least-loaded pods); we keep the defaults the GORGO issue names.

Deviations: blocks are the fleet's ``block_tokens`` (AIBrix hashes 4-token blocks of its own
character tokenizer), the index is ours (per-replica LRU bounded by KV capacity, where AIBrix keeps
a global LRU of 200k blocks with a 20-minute TTL), and ties rotate deterministically instead of
being shuffled. Scores: running requests on the least-request paths; on the prefix path
``(100 - percent) + running / (max_running + 1)``, inf for non-candidates, so the integer part is
the match and the fraction the load.
"""

from __future__ import annotations

import numpy as np

from gorgo.core.decision import Decision
from gorgo.core.features import RequestFeatures
from gorgo.core.policies.base import PolicyBase, routable_or_raise
from gorgo.core.state import FleetState

IMBALANCE_ABS_COUNT = 8
STD_DEV_FACTOR = 1.0


def running_requests(s: FleetState) -> np.ndarray:
    """Requests running per replica: our own count, or a fresh scrape where it shows more."""
    own = s.inflight_reqs.astype(float)
    fresh = (s.now - s.eng_scraped_at) <= s.spec.signals.metrics_stale_s
    # A replica never scraped holds a NaN count, but is never fresh: `where` drops it.
    return np.where(fresh, np.maximum(own, s.eng_running_reqs), own)


class PrefixCache(PolicyBase):
    name = "prefix-cache"
    imbalance_abs_count = IMBALANCE_ABS_COUNT
    std_dev_factor = STD_DEV_FACTOR

    def choose(self, f: RequestFeatures, s: FleetState) -> Decision:
        ok = routable_or_raise(s)
        running = running_requests(s)
        ready = running[ok]
        if ready.max() - ready.min() > self.imbalance_abs_count:
            return self.pick_lowest(running, s)
        if f.n_blocks:
            percent = s.matched_blocks(f) * 100 // f.n_blocks
            sd = float(ready.std(ddof=1)) if ready.size > 1 else 0.0
            limit = float(ready.mean()) + self.std_dev_factor * sd
            candidates = ok & (percent > 0) & (running <= limit)
            if candidates.any():
                load = running / (ready.max() + 1.0)
                return self.pick_lowest(np.where(candidates, (100 - percent) + load, np.inf), s)
        return self.pick_lowest(running, s)
