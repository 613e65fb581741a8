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

Clients (`client_regions`). The users are the same whatever the routers: clients are dealt
evenly over the fleet's regions (a client is a session when the request has a session key, since
a user does not change continent mid-conversation, else the request itself), deterministic from
the seed, from a generator of their own so the simulation's draws are untouched.

Arrivals (`assign_routers`, from the same generator). ``same``: each request to a router drawn
uniformly. ``spread``: a request reaches a router of its client's region drawn uniformly (an L4
balancer knows no sessions), or of the nearest region that hosts one.

What the client feels (`client_legs`). The simulator measures TTFT and E2E from a request's
arrival at its router, as Envoy's span does. A user also pays the way to the proxy and back: the
mean RTT between the client's region and its router's. That leg is what a proxy per region
saves, so comparisons between placements (one router against K spread) read the client's figures
beside the router's.

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
ASSIGN_STREAM = 17  # second seed word of the generator of clients and arrivals


def router_regions(spec: FleetSpec, routers: int, placement: str) -> list[str]:
    """The region of each of ``routers`` routers; router 0 is in the proxy region."""
    if routers < 1:
        raise ValueError(f"routers must be >= 1, got {routers}")
    if placement not in PLACEMENTS:
        raise ValueError(f"router placement must be one of {', '.join(PLACEMENTS)}, "
                         f"got {placement!r}")
    if placement == SAME:
        return [spec.proxy_region] * routers
    order = fleet_regions(spec)
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


def client_regions(features: Sequence[RequestFeatures], spec: FleetSpec, seed: int) -> np.ndarray:
    """The region of each request's client, as an index into ``fleet_regions(spec)`` (see the
    module docstring)."""
    return _deal(features, len(spec.regions), np.random.default_rng([seed, ASSIGN_STREAM]))


def _deal(features: Sequence[RequestFeatures], regions: int,
          rng: np.random.Generator) -> np.ndarray:
    # Clients in order of first request; each run of ``regions`` of them covers every region
    # once, in a shuffled order, so the regions' client counts differ by at most one.
    deal = np.concatenate([rng.permutation(regions)
                           for _ in range(len(features) // regions + 1)])
    of_client: dict[object, int] = {}
    out = np.empty(len(features), dtype=np.int64)
    for m, f in enumerate(features):
        key = m if f.session_key is None else f.session_key
        out[m] = of_client.setdefault(key, int(deal[len(of_client)]))
    return out


def fleet_regions(spec: FleetSpec) -> list[str]:
    """The fleet's regions, the proxy region first (the order `spread` places routers in)."""
    return [spec.proxy_region, *(r for r in spec.region_names if r != spec.proxy_region)]


def assign_routers(features: Sequence[RequestFeatures], spec: FleetSpec, regions: Sequence[str],
                   placement: str, seed: int) -> np.ndarray:
    """The router each request arrives at (see the module docstring); ``regions`` are the
    routers'."""
    n, k = len(features), len(regions)
    if k == 1:
        return np.zeros(n, dtype=np.int64)
    rng = np.random.default_rng([seed, ASSIGN_STREAM])
    if placement == SAME:
        return rng.integers(0, k, n)
    hosts = np.asarray(regions)
    # Each client region's routers: its own, or those of the nearest region that has any.
    members = []
    for c in fleet_regions(spec):
        near = c if c in regions else min(dict.fromkeys(regions),
                                          key=lambda r: link_from(spec, c, r)[0])
        members.append(np.flatnonzero(hosts == near))
    clients = _deal(features, len(members), rng)  # the draws `client_regions` makes
    pick = rng.random(n)
    return np.array([members[c][int(u * len(members[c]))]
                     for c, u in zip(clients, pick, strict=True)])


def client_legs(features: Sequence[RequestFeatures], spec: FleetSpec, regions: Sequence[str],
                home: np.ndarray, seed: int) -> np.ndarray:
    """Each request's way from its client to its router and back, in ms: the mean RTT of the
    link between their regions (`link_from`)."""
    clients = fleet_regions(spec)
    rtt = {(c, r): link_from(spec, c, r)[0] for c in clients for r in set(regions)}
    return np.array([rtt[clients[c], regions[h]]
                     for c, h in zip(client_regions(features, spec, seed), home, strict=True)])
