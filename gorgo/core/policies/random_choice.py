"""random: a uniformly random routable replica (the load-, cache- and network-blind baseline).

Source: the `random` policy every peer router ships (sgl-router src/policies/random.rs, AIBrix
`random`, Envoy RANDOM). The generator is seeded from the fleet name, so an offline simulation of
the same fleet draws the same sequence every run; a live router mixes in its own id (`reseed`).
"""

from __future__ import annotations

from gorgo.core.decision import Decision
from gorgo.core.features import RequestFeatures
from gorgo.core.fleet import FleetSpec
from gorgo.core.policies.base import PolicyBase
from gorgo.core.state import FleetState


class RandomChoice(PolicyBase):
    name = "random"
    carried = ("rng",)
    seed_prefix = ""

    def __init__(self, spec: FleetSpec) -> None:
        super().__init__(spec)
        self.rng = self.generator()

    def choose(self, f: RequestFeatures, s: FleetState) -> Decision:
        # One draw per replica, lowest wins: uniform over whichever replicas are routable.
        return self.pick_lowest(self.rng.random(s.n), s)
