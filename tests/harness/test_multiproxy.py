"""`region_view`: another proxy's view of a fleet has its own addresses and RTTs, same replicas."""

from __future__ import annotations

from gorgo.core.fleet import parse_fleet
from gorgo.harness.multiproxy import region_view
from gorgo.sim.presets import fleet_document
from gorgo.sim.routers import link_from


def test_region_view_keeps_replicas_and_takes_the_regions_rtts() -> None:
    doc = fleet_document({"us-east": 2, "eu-frankfurt": 1, "ap-seoul": 1}, name="demo")
    assert region_view(doc, "us-east") is doc  # the fleet's own proxy region
    spec, view = parse_fleet(doc), parse_fleet(region_view(doc, "ap-seoul"))
    assert view.proxy_region == "ap-seoul" and view.name == "demo-ap-seoul"
    assert [r.name for r in view.replicas] == [r.name for r in spec.replicas]
    assert not {r.address for r in view.replicas} & {r.address for r in spec.replicas}
    for g in view.regions:
        assert (g.rtt_ms, g.jitter_ms) == link_from(spec, "ap-seoul", g.name)
    assert view.regions[-1].rtt_ms < view.regions[0].rtt_ms  # ap-seoul is near, us-east far
