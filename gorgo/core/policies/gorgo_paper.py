"""gorgo-paper: the GORGO paper's deployed score, with its unbounded prefix trie.

Source: the GORGO paper (score of its deployed proxy): per replica

    score = 0.276 * rtt_ms + uncached_tokens + 0.5 * in_flight_prompt_tokens

lowest wins. Units are mixed on purpose: the constants were fitted so that a token of uncached
prefill, half a token of queued prompt and 0.276 ms of RTT cost the same on the paper's fleet. The
paper's trie never evicts, so when this is the fleet's default policy the Router builds its state
with an unbounded prefix index (``unbounded_prefix``); a per-request override to gorgo-paper on a
fleet whose default is another policy reads that router's bounded index instead.
Signals: ``s.rtt_or_default()`` (EWMA of probes; unprobed replicas at the worst known RTT),
``s.uncached_tokens(f)`` and ``s.inflight_prompt_tokens``. Scores: the score above.
"""

from __future__ import annotations

from gorgo.core.decision import Decision
from gorgo.core.features import RequestFeatures
from gorgo.core.policies.base import PolicyBase
from gorgo.core.state import FleetState

RTT_WEIGHT = 0.276  # per ms
INFLIGHT_WEIGHT = 0.5  # per prompt token in flight


class GorgoPaper(PolicyBase):
    name = "gorgo-paper"
    unbounded_prefix = True

    def choose(self, f: RequestFeatures, s: FleetState) -> Decision:
        score = (
            RTT_WEIGHT * s.rtt_or_default()
            + s.uncached_tokens(f)
            + INFLIGHT_WEIGHT * s.inflight_prompt_tokens
        )
        return self.pick_lowest(score, s)
