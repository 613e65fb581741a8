"""oracle (simulation only): greedy on the engines' true state, a bound for what routing can do.

It sees what no real router can: each engine's real prefix cache, its real prefill backlog (the
uncached tokens of admitted-but-unprefilled requests plus the whole prompts still waiting) and the
links' true mean RTT, and sends each request where its TTFT would be lowest if nothing else
arrived. Greedy is not optimal over time, so it is a strong reference, not a strict lower bound;
`sim.lookahead` (``oracle-lookahead``) improves on it by rolling the known future forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gorgo.core.decision import Decision
from gorgo.core.features import RequestFeatures
from gorgo.core.fleet import FleetSpec
from gorgo.core.policies.base import PolicyBase
from gorgo.core.state import FleetState
from gorgo.sim.engine import Engine


def greedy_costs(engines: Sequence[Engine], rtt_ms: np.ndarray, ms_per_token: np.ndarray,
                 transit_tokens: Sequence[int], f: RequestFeatures) -> np.ndarray:
    """Each engine's TTFT (ms) for ``f`` if nothing else arrived: the link's mean RTT plus the
    true prefill backlog (``transit_tokens``: uncached prompt tokens still on the link to it)
    and the request's own uncached tokens at that engine's prefill rate."""
    cost = np.empty(len(engines))
    for i, e in enumerate(engines):
        m = e.metrics()
        backlog = m.pending_prefill_tokens + m.waiting_prompt_tokens + transit_tokens[i]
        uncached = f.prompt_tokens - e.cached_prefix_tokens(f.block_hashes)
        cost[i] = rtt_ms[i] + (backlog + uncached) * ms_per_token[i]
    return cost


def prefill_ms_per_token(engines: Sequence[Engine]) -> np.ndarray:
    return np.array([e.profile.c_prefill_ms_per_token / e.speed for e in engines])


class Oracle(PolicyBase):
    name = "oracle"

    def __init__(self, spec: FleetSpec, engines: list[Engine], rtt_ms: np.ndarray) -> None:
        super().__init__(spec)
        self.engines = engines
        self.rtt_ms = rtt_ms
        self.ms_per_token = prefill_ms_per_token(engines)
        # Requests still on the link to each engine: (arrival time there, prompt tokens).
        self.transit: list[list[tuple[float, int]]] = [[] for _ in engines]

    def choose(self, f: RequestFeatures, s: FleetState) -> Decision:
        self.transit = [[(t, n) for t, n in tr if t > s.now] for tr in self.transit]
        cost = greedy_costs(self.engines, self.rtt_ms, self.ms_per_token,
                            [sum(n for _, n in tr) for tr in self.transit], f)
        d = self.pick_lowest(cost, s)
        i = d.replica
        self.transit[i].append((s.now + self.rtt_ms[i] / 2000.0, int(
            f.prompt_tokens - self.engines[i].cached_prefix_tokens(f.block_hashes))))
        return d


def oracle_factory(sim) -> Oracle:
    """For `Simulation(policy_factory=...)`: an oracle bound to that run's engines and links."""
    return Oracle(sim.spec, sim.engines, sim.net.rtt_ms())
