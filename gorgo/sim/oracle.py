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
from gorgo.core.policies.base import PolicyBase
from gorgo.core.state import FleetState
from gorgo.sim.engine import Engine
from gorgo.sim.offline import SUBMIT, Simulation


def greedy_costs(engines: Sequence[Engine], rtt_ms: np.ndarray, ms_per_token: np.ndarray,
                 transit_tokens: Sequence[int], uncached: Sequence[int]) -> np.ndarray:
    """Each engine's TTFT (ms) for a request if nothing else arrived: the link's mean RTT plus
    the true prefill backlog (``transit_tokens``: uncached prompt tokens still on the link to
    it) and the request's own ``uncached`` tokens there at that engine's prefill rate."""
    cost = np.empty(len(engines))
    for i, e in enumerate(engines):
        m = e.metrics()
        backlog = m.pending_prefill_tokens + m.waiting_prompt_tokens + transit_tokens[i]
        cost[i] = rtt_ms[i] + (backlog + uncached[i]) * ms_per_token[i]
    return cost


def uncached_tokens(sim: Simulation, e: Engine, i: int, f: RequestFeatures) -> int:
    """``f``'s prompt tokens engine ``e`` (replica ``i``, or its rollout clone) has not cached,
    looked up with the hashes it keys its cache on (`Simulation.engine_hashes`)."""
    return f.prompt_tokens - e.cached_prefix_tokens(sim.engine_hashes(f, i))


def prefill_ms_per_token(engines: Sequence[Engine]) -> np.ndarray:
    return np.array([e.profile.c_prefill_ms_per_token / e.speed for e in engines])


class Oracle(PolicyBase):
    name = "oracle"

    def __init__(self, sim: Simulation) -> None:
        super().__init__(sim.spec)
        self.sim = sim
        self.engines = engines = sim.engines
        self.rtt_ms = sim.net.rtt_ms()
        self.ms_per_token = prefill_ms_per_token(engines)

    def choose(self, f: RequestFeatures, s: FleetState) -> Decision:
        uncached = [uncached_tokens(self.sim, e, i, f) for i, e in enumerate(self.engines)]
        _, transit = in_transit(self.sim)
        return self.pick_lowest(
            greedy_costs(self.engines, self.rtt_ms, self.ms_per_token, transit, uncached), s)


def in_transit(sim: Simulation) -> tuple[list[tuple[float, int, int]], list[int]]:
    """The requests on their way to an engine, as (arrival there, request, replica), and each
    engine's uncached tokens among them: the simulation's own pending submissions, the router's
    intake queue and the links' jitter included (booked at the mean one-way delay, the oracle
    missed up to 344 of 2,596 requests in transit)."""
    submits = [(t, int(j), sim.records[int(j)].replica)  # type: ignore[call-overload]
               for t, j in sim.pending(SUBMIT)]
    transit = [0] * len(sim.engines)
    for _, j, i in submits:
        transit[i] += uncached_tokens(sim, sim.engines[i], i, sim.features[j])
    return submits, transit


def oracle_factory(sim: Simulation) -> Oracle:
    """For `Simulation(policy_factory=...)`: an oracle bound to that run's engines and links."""
    return Oracle(sim)
