"""kv-cost: NVIDIA Dynamo's KV router cost, lowest wins.

Source: ai-dynamo/dynamo lib/kv-router/src/scheduling/selector.rs (``DefaultWorkerSelector``),
the per-worker load projection ``ActiveSequences::potential_blocks_and_tokens`` and
``KvRouterConfig::default`` (overlap_score_weight 1.0, router_temperature 0.0,
router_track_active_blocks true, router_track_output_blocks false). Per worker w:

    prefill_tokens[w] = (isl - overlap_blocks[w] * block_size) + active_prefill_tokens[w]
    decode_blocks[w]  = active_blocks[w] + new_blocks(request on w)
    logit[w]          = overlap_score_weight * prefill_tokens[w] / block_size + decode_blocks[w]

Temperature 0 takes the minimum logit; ties go to the smaller radix tree, then at random.

Signals here: overlap from our prefix index (Dynamo learns it from engine KV events); active
prefill tokens = ``s.waiting_tokens()``, the uncached prompt tokens still waiting for prefill
(Dynamo counts a request's new tokens until its first token marks prefill done; our backlog drains
at the prefill rate, raised to a fresh scrape of the engine queue). Active blocks =
``inflight_prompt_tokens / block_tokens`` (Dynamo, tracking prompt blocks only by default, counts
each active sequence's prompt blocks, deduplicated per worker; we cannot deduplicate, so shared
prefixes count once per request), raised to the engine's reported KV usage
(``kv_usage * kv_capacity_tokens / block_tokens``) where a scrape is fresh, which sees other
routers' requests. New blocks = the request's full blocks (Dynamo subtracts blocks already active
on the worker). Tree size for ties = ``s.prefix.sizes()``; remaining ties rotate.
Scores: the logits.
"""

from __future__ import annotations

import numpy as np

from gorgo.core.decision import Decision
from gorgo.core.features import RequestFeatures
from gorgo.core.fleet import FleetSpec
from gorgo.core.policies.base import PolicyBase
from gorgo.core.state import FleetState

OVERLAP_SCORE_WEIGHT = 1.0


class KvCost(PolicyBase):
    name = "kv-cost"
    overlap_score_weight = OVERLAP_SCORE_WEIGHT

    def __init__(self, spec: FleetSpec) -> None:
        super().__init__(spec)
        self.kv_blocks = np.array(
            [r.kv_capacity_tokens / spec.block_tokens for r in spec.replicas], dtype=float
        )

    def logits(self, f: RequestFeatures, s: FleetState) -> np.ndarray:
        bt = s.spec.block_tokens
        new_tokens = np.maximum(f.prompt_tokens - s.matched_blocks(f) * bt, 0)
        prefill_tokens = new_tokens + s.waiting_tokens()
        active = s.inflight_prompt_tokens / bt
        fresh = (s.now - s.eng_scraped_at) <= s.spec.signals.metrics_stale_s
        reported = np.nan_to_num(s.eng_kv_usage) * self.kv_blocks
        active = np.where(fresh, np.maximum(active, reported), active)
        decode_blocks = active + f.n_blocks
        return self.overlap_score_weight * prefill_tokens / bt + decode_blocks

    def choose(self, f: RequestFeatures, s: FleetState) -> Decision:
        return self.pick_lowest(self.logits(f, s), s, tiebreak=s.prefix.sizes)
