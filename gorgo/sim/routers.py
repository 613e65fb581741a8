"""Several independent GORGO routers in one offline simulation: where each sits, what it sees of
the WAN, and which requests reach it.

A real deployment runs several proxies (Envoy + router), often one per region. Each router keeps
its own `FleetState`: its in-flight accounting and approximate prefix index see only the requests
it routed itself, and its probes and scrapes run on their own timers over its own links. What they
share is the engines: every router scrapes the same queues and, with ``cache: precise``,
receives the same KV events.

Placement. ``same``: all K routers in the fleet's proxy region (several Envoys behind one L4
balancer). ``spread``: routers placed round-robin over the fleet's regions, the proxy region
first, so router 0 always sits where a single router would and K = 1 is today's simulation.

Arrivals (`assign_routers`, deterministic from the seed, from a generator of its own so the
simulation's draws are untouched). ``same``: each request to a router drawn uniformly. ``spread``:
clients are dealt evenly over the regions that host a router (a client is a session when the
request has a session key, since a user does not change continent mid-conversation, else the
request itself); a request reaches a router of its client's region drawn uniformly (an L4
balancer knows no sessions).

Links seen from another region (`view_from`). The fleet file gives each region's link from the
proxy region P only. A router in region A reaches a replica in its own region over P's own link
(the in-region RTT), P's replicas over A's link from P (links are symmetric), and a third region
B over the larger of A's and B's links from P: never shorter than either leg, never longer than
going through P.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from gorgo.core.features import RequestFeatures
from gorgo.core.fleet import FleetSpec

SAME, SPREAD = "same", "spread"
PLACEMENTS = (SAME, SPREAD)
ASSIGN_STREAM = 17  # second seed word of the arrival-assignment generator


def router_regions(spec: FleetSpec, routers: int, placement: str) -> list[str]:
    """The region of each of ``routers`` routers; router 0 is in the proxy region."""
    if routers < 1:
        raise ValueError(f"routers must be >= 1, got {routers}")
    if placement not in PLACEMENTS:
        raise ValueError(f"router placement must be one of {', '.join(PLACEMENTS)}, "
                         f"got {placement!r}")
    if placement == SAME:
        return [spec.proxy_region] * routers
    order = [spec.proxy_region, *(r for r in spec.region_names if r != spec.proxy_region)]
    return [order[j % len(order)] for j in range(routers)]


def link_from(spec: FleetSpec, src: str, dst: str) -> tuple[float, float]:
    """(RTT ms, sd ms) from region ``src`` to region ``dst`` under the module's model."""
    links = {r.name: (r.rtt_ms, r.jitter_ms) for r in spec.regions}
    proxy = spec.proxy_region
    if src == proxy:
        return links[dst]
    if dst == src:
        return links[proxy]
    if dst == proxy:
        return links[src]
    return max(links[src], links[dst])


def view_from(spec: FleetSpec, region: str) -> FleetSpec:
    """The fleet as a router in ``region`` sees it: its proxy region, and each region's link from
    there. The proxy region's view is ``spec`` itself."""
    if region == spec.proxy_region:
        return spec
    regions = []
    for r in spec.regions:
        rtt, sd = link_from(spec, region, r.name)
        regions.append(replace(r, rtt_ms=rtt, jitter_ms=sd))
    return replace(spec, proxy_region=region, regions=tuple(regions))


def assign_routers(features: Sequence[RequestFeatures], regions: Sequence[str], placement: str,
                   seed: int) -> np.ndarray:
    """The router each request arrives at (see the module docstring)."""
    n, k = len(features), len(regions)
    if k == 1:
        return np.zeros(n, dtype=np.int64)
    rng = np.random.default_rng([seed, ASSIGN_STREAM])
    if placement == SAME:
        return rng.integers(0, k, n)
    homes = list(dict.fromkeys(regions))
    members = [np.flatnonzero(np.asarray(regions) == h) for h in homes]
    # Clients in order of first request; each run of len(homes) of them covers every region
    # once, in a shuffled order, so the regions' client counts differ by at most one.
    deal = np.concatenate([rng.permutation(len(homes)) for _ in range(n // len(homes) + 1)])
    of_client: dict[object, int] = {}
    client = np.empty(n, dtype=np.int64)
    for m, f in enumerate(features):
        key = m if f.session_key is None else f.session_key
        client[m] = of_client.setdefault(key, int(deal[len(of_client)]))
    pick = rng.random(n)
    return np.array([members[c][int(u * len(members[c]))] for c, u in zip(client, pick,
                                                                            strict=True)])

