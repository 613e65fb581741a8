"""Routing policies, one per module, selected by name from the fleet file or a request header."""

from __future__ import annotations

from gorgo.core.fleet import FleetSpec
from gorgo.core.policies.base import Policy
from gorgo.core.policies.gorgo import Gorgo
from gorgo.core.policies.least_request import LeastRequest
from gorgo.core.policies.round_robin import RoundRobin

REGISTRY: dict[str, type] = {cls.name: cls for cls in (RoundRobin, LeastRequest, Gorgo)}


def make_policy(name: str, spec: FleetSpec) -> Policy:
    try:
        cls = REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(REGISTRY)})") from None
    return cls(spec)
