"""cache-aware: SGLang router's cache-aware policy with its launcher defaults.

Source: sgl-project/sglang sgl-router/src/policies/cache_aware.rs (rule), src/policies/tree.rs
(approximate radix tree: ``prefix_match``, ``get_smallest_tenant``), and the defaults the router
is launched with, sgl-router py_src/sglang_router/router_args.py: cache_threshold 0.3,
balance_abs_threshold 64, balance_rel_threshold 1.5. (The Rust ``CacheAwareConfig::default`` of
0.5 / 32 / 1.1 is only used by code that builds the policy without a config.)

1. Load = the router's own count of requests in flight per worker (``Worker::load``), taken over
   every worker, healthy or not, exactly as SGLang does. Imbalanced when
   ``max - min > 64`` and ``max > 1.5 * min``: route to the least-loaded healthy worker.
2. Else the longest prefix any worker holds; match rate = matched / prompt length. Above 0.3,
   route to a worker holding that longest match; otherwise to the worker with the smallest tree.

Deviations: match rate is over tokens in full blocks (SGLang counts characters), the tree is our
prefix index (blocks per replica, bounded by KV capacity, where SGLang evicts characters past
``max_tree_size``), tree size is ``s.prefix.sizes()`` in blocks, unhealthy workers are left out of
the match and smallest-tree choices (SGLang picks among all and then falls back to the first
healthy worker), and ties rotate (SGLang takes whichever the map yields first). Scores: load on
the imbalanced path, the unmatched fraction ``1 - matched/prompt`` on the match path, tree size in
blocks on the smallest-tree path.
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
        hi, lo = int(load.max()), int(load.min())
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            return self.pick_lowest(load, s)
        if f.prompt_tokens > 0:
            matched = np.minimum(s.matched_blocks(f) * s.spec.block_tokens, f.prompt_tokens)
            rate = np.where(ok, matched, 0) / f.prompt_tokens
            if rate.max() > self.cache_threshold:
                return self.pick_lowest(1.0 - rate, s)
        return self.pick_lowest(s.prefix.sizes(), s)
