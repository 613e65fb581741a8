"""Driver parity: every policy decides the same live (ext_proc service, fake clock) and offline.

The simulator's calls into the router are recorded and replayed through the live server's code
(`gorgo.harness.drivers`); a policy whose periodic duty (irb's re-solve) only one driver ran, or a
rejection only one driver handled, would route differently.
"""

from __future__ import annotations

from collections import Counter

import pytest

from gorgo.core.fleet import parse_fleet
from gorgo.core.policies import REGISTRY
from gorgo.harness.drivers import record_offline, replay_live
from gorgo.sim.presets import fleet_document
from gorgo.sim.traces import chat_trace

REQUESTS = 120


@pytest.fixture(scope="module")
def trace():
    return chat_trace(seed=3, limit=REQUESTS)


def _spec(**extra):
    doc = fleet_document({"us-east": 2, "eu-frankfurt": 1, "ap-seoul": 1}, name="parity")
    doc.update(extra)
    return parse_fleet(doc)


@pytest.mark.parametrize("policy", sorted(REGISTRY))
def test_live_and_offline_drivers_decide_alike(policy: str, trace) -> None:
    rec = record_offline(_spec(), policy, trace, scale=0.05)
    assert sum(e.kind == "tick" for e in rec.events) > 4  # the simulator ticked the router
    live = replay_live(rec)
    assert live == rec.replicas
    assert all(r is not None for r in live)


def test_parity_holds_when_requests_are_shed(trace) -> None:
    rec = record_offline(_spec(shedding={"slo_ms": 400}), "gorgo", trace, scale=0.02)
    shed = sum(r is None for r in rec.replicas)
    assert 0 < shed < len(rec.replicas)  # some shed, some routed: the run went to its end
    assert replay_live(rec) == rec.replicas


def test_live_irb_spreads_load(trace) -> None:
    """irb re-solves on the router's tick, so its weights follow demand live too."""
    rec = record_offline(_spec(), "irb", trace, scale=0.05)
    shares = Counter(replay_live(rec))
    assert len(shares) >= 2 and max(shares.values()) < 0.9 * len(rec.replicas)
