"""session-affinity: rendezvous (highest-random-weight) hashing on the session.

Source: Envoy's hash-based load balancing (RING_HASH/MAGLEV with a header hash policy) and
rendezvous hashing (Thaler and Ravishankar, 1998), the usual way LLM gateways pin a session to
a replica so its prefix cache stays warm. The key is the request's session (``x-session-id``,
else ``prompt_cache_key``/``user``); without one it is the hash of the prompt's first 256 tokens
(``f.head_hash``), so requests sharing a system prompt and opening stick together. An unroutable
replica is skipped by taking the next-highest weight, and because salts come from replica names,
ejecting a replica moves only the keys it owned. Sessionless requests that all open with the
same 256 tokens (a shared system prompt) share one key and one replica.
"""

from __future__ import annotations

from gorgo.core.decision import Decision
from gorgo.core.features import RequestFeatures
from gorgo.core.fleet import FleetSpec
from gorgo.core.policies.base import PolicyBase
from gorgo.core.policies.rendezvous import rendezvous_scores, replica_salts, request_key
from gorgo.core.state import FleetState


class SessionAffinity(PolicyBase):
    name = "session-affinity"

    def __init__(self, spec: FleetSpec) -> None:
        super().__init__(spec)
        self.salts = replica_salts(spec)

    def choose(self, f: RequestFeatures, s: FleetState) -> Decision:
        return self.pick_lowest(rendezvous_scores(request_key(f), self.salts), s)
