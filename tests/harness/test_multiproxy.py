"""`region_view`: the native multi-proxy demo's views, on free loopback ports."""

from __future__ import annotations

from gorgo.core.fleet import parse_fleet
from gorgo.harness.multiproxy import region_view
from gorgo.sim.presets import fleet_document


def test_region_view_is_on_loopback_ports_of_its_own() -> None:
    doc = fleet_document({"us-east": 2, "eu-frankfurt": 1, "ap-seoul": 1}, name="demo")
    assert region_view(doc, "us-east") is doc  # the fleet's own proxy region
    spec, view = parse_fleet(doc), parse_fleet(region_view(doc, "ap-seoul"))
    assert view.proxy_region == "ap-seoul"
    assert [r.name for r in view.replicas] == [r.name for r in spec.replicas]
    assert {r.host for r in view.replicas} == {"127.0.0.1"}
    assert not {r.address for r in view.replicas} & {r.address for r in spec.replicas}
