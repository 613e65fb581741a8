"""least-load: fewest prompt tokens in flight from this router.

Source: the GORGO issue's token-weighted least-outstanding-work baseline (the idea behind AIBrix's
`least-load`, pkg/plugins/gateway/algorithms/least_load.go, which ranks by a utilisation provider
instead). A replica with two 30k-token prompts in flight is busier than one with five short
chats, which least-request cannot see. Signal: ``s.inflight_prompt_tokens``, this router's own
accounting: exact for what it sent, blind to other routers.
"""

from __future__ import annotations

from gorgo.core.decision import Decision
from gorgo.core.features import RequestFeatures
from gorgo.core.policies.base import PolicyBase
from gorgo.core.state import FleetState


class LeastLoad(PolicyBase):
    name = "least-load"

    def choose(self, f: RequestFeatures, s: FleetState) -> Decision:
        return self.pick_lowest(s.inflight_prompt_tokens, s)
