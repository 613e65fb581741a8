"""oracle (simulation only): greedy on the engines' true state, a bound for what routing can do.

It sees what no real router can: each engine's real prefix cache, its real prefill backlog (the
uncached tokens of admitted-but-unprefilled requests plus the whole prompts still waiting) and the
links' true mean RTT, and sends each request where its TTFT would be lowest if nothing else
arrived. Greedy is not optimal over time, so it is a strong reference, not a strict lower bound.
"""

from __future__ import annotations

import numpy as np

from gorgo.core.decision import Decision
from gorgo.core.features import RequestFeatures
from gorgo.core.fleet import FleetSpec
from gorgo.core.policies.base import PolicyBase
from gorgo.core.state import FleetState
from gorgo.sim.engine import Engine


class Oracle(PolicyBase):
    name = "oracle"

    def __init__(self, spec: FleetSpec, engines: list[Engine], rtt_ms: np.ndarray) -> None:
        super().__init__(spec)
        self.engines = engines
        self.rtt_ms = rtt_ms
        self.ms_per_token = np.array([
            e.profile.c_prefill_ms_per_token / e.speed for e in engines])
        # Requests still on the link to each engine: (arrival time there, prompt tokens).
        self.transit: list[list[tuple[float, int]]] = [[] for _ in engines]

    def choose(self, f: RequestFeatures, s: FleetState) -> Decision:
        cost = np.empty(len(self.engines))
        for i, e in enumerate(self.engines):
            m = e.metrics()
            transit = self.transit[i] = [(t, n) for t, n in self.transit[i] if t > s.now]
            backlog = (m.pending_prefill_tokens + m.waiting_prompt_tokens
                       + sum(n for _, n in transit))
            uncached = f.prompt_tokens - e.cached_prefix_tokens(f.block_hashes)
            cost[i] = self.rtt_ms[i] + (backlog + uncached) * self.ms_per_token[i]
        d = self.pick_lowest(cost, s)
        i = d.replica
        self.transit[i].append((s.now + self.rtt_ms[i] / 2000.0, int(
            f.prompt_tokens - self.engines[i].cached_prefix_tokens(f.block_hashes))))
        return d


def oracle_factory(sim) -> Oracle:
    """For `Simulation(policy_factory=...)`: an oracle bound to that run's engines and links."""
    return Oracle(sim.spec, sim.engines, sim.net.rtt_ms())
