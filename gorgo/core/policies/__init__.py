"""Routing policies, one per module, selected by name from the fleet file or a request header."""

from __future__ import annotations

from gorgo.core.fleet import FleetSpec
from gorgo.core.policies.base import Policy
from gorgo.core.policies.cache_aware import CacheAware
from gorgo.core.policies.cache_aware_tree import CacheAwareTree
from gorgo.core.policies.gorgo import Gorgo
from gorgo.core.policies.gorgo_paper import GorgoPaper
from gorgo.core.policies.irb import Irb
from gorgo.core.policies.kv_cost import KvCost
from gorgo.core.policies.least_load import LeastLoad
from gorgo.core.policies.least_request import LeastRequest
from gorgo.core.policies.prefix_cache import PrefixCache
from gorgo.core.policies.random_choice import RandomChoice
from gorgo.core.policies.round_robin import RoundRobin
from gorgo.core.policies.session_affinity import SessionAffinity

REGISTRY: dict[str, type] = {
    cls.name: cls
    for cls in (
        RoundRobin,
        LeastRequest,
        Gorgo,
        RandomChoice,
        LeastLoad,
        SessionAffinity,
        PrefixCache,
        CacheAware,
        CacheAwareTree,
        KvCost,
        GorgoPaper,
        Irb,
    )
}


def make_policy(name: str, spec: FleetSpec) -> Policy:
    try:
        cls = REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(REGISTRY)})") from None
    return cls(spec)
