"""cache-aware: SGLang router's cache-aware policy, as sglang-router 0.3.2 runs it.

Source: sgl-project/sglang sgl-model-gateway/src/policies/cache_aware.rs (the rule; on a miss
``min_by_key(|idx| workers[idx].load())`` over the healthy workers), src/policies/tree.rs
(approximate radix tree: ``prefix_match``), and the defaults the router is launched with,
py_src/sglang_router/router_args.py: cache_threshold 0.3, balance_abs_threshold 64,
balance_rel_threshold 1.5. Checked against the installed wheel (sglang-router 0.3.2 from PyPI):
its ``--help`` shows those defaults, and distinct prompts sent one at a time to two idle workers
all go to one worker (least load, ties to the first), where the older smallest-tree rule would
alternate. That older rule is kept as ``cache-aware-tree`` (``cache_aware_tree.py``).

1. Load = the router's own count of requests in flight per worker (``Worker::load``), taken over
   every worker of the request's model, healthy or not, exactly as SGLang does. Imbalanced when
   ``max - min > 64`` and ``max > 1.5 * min``: route to the least-loaded healthy worker.
2. Else the longest prefix any worker holds; match rate = matched / prompt length. Above 0.3,
   route to a worker holding that longest match; otherwise (a miss) to the least-loaded worker.

Deviations: match rate is over tokens in full blocks (SGLang counts characters), the tree is our
prefix index (blocks per replica, bounded by KV capacity, where SGLang evicts characters past
``max_tree_size``), unhealthy workers are left out of the match choice (SGLang picks among all and
then falls back to the first healthy worker), and ties rotate (SGLang takes the first worker).
Scores: load on the imbalanced and miss paths, the unmatched fraction ``1 - matched/prompt`` on
the match path.
"""

from __future__ import annotations

import numpy as np

from gorgo.core.decision import Decision
from gorgo.core.features import RequestFeatures
from gorgo.core.policies.base import PolicyBase, routable_or_raise
from gorgo.core.state import FleetState

CACHE_THRESHOLD = 0.3
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5


class CacheAware(PolicyBase):
    name = "cache-aware"
    cache_threshold = CACHE_THRESHOLD
    balance_abs_threshold = BALANCE_ABS_THRESHOLD
    balance_rel_threshold = BALANCE_REL_THRESHOLD

    def choose(self, f: RequestFeatures, s: FleetState) -> Decision:
        ok = routable_or_raise(s)
        load = s.inflight_reqs
        # SGLang's gateway keeps a worker set per model: another model's load is not imbalance.
        pool = load if s.candidates is None else load[s.candidates]
        hi, lo = int(pool.max()), int(pool.min())
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            return self.pick_lowest(load, s)
        if f.prompt_tokens > 0:
            matched = np.minimum(s.matched_blocks(f) * s.spec.block_tokens, f.prompt_tokens)
            rate = np.where(ok, matched, 0) / f.prompt_tokens
            if rate.max() > self.cache_threshold:
                return self.pick_lowest(1.0 - rate, s)
        return self.pick_lowest(self.miss_scores(s), s)

    def miss_scores(self, s: FleetState) -> np.ndarray:
        """Where a prompt no worker holds enough of goes: the least-loaded worker."""
        return s.inflight_reqs
