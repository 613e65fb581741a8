"""cache-aware-tree: SGLang's older cache-aware rule, a miss goes to the smallest tree.

Source: sgl-project/sglang sgl-router/src/policies/cache_aware.rs before the router sent misses
to the least-loaded worker (the rule still described in that file's header comment:
"If match rate <= cache_threshold: route to the worker with smallest tree size") and
src/policies/tree.rs ``get_smallest_tenant``. Everything else is `cache-aware`'s (same thresholds,
imbalance switch and deviations); only the miss differs. Kept as a named variant because it is
what this project's earlier results were measured with.
"""

from __future__ import annotations

import numpy as np

from gorgo.core.policies.cache_aware import CacheAware
from gorgo.core.state import FleetState


class CacheAwareTree(CacheAware):
    name = "cache-aware-tree"

    def miss_scores(self, s: FleetState) -> np.ndarray:
        """The worker whose tree is smallest (blocks held), i.e. with the most cache room."""
        return s.prefix.sizes()
