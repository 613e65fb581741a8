"""`gorgo sim view`: another proxy's view of a fleet has its own addresses and RTTs, same
replicas; bad arguments are one-line user errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gorgo.cli import main
from gorgo.core.fleet import load_fleet, parse_fleet
from gorgo.sim.presets import fleet_document
from gorgo.sim.routers import link_from
from gorgo.sim.view import offset_addresses, view_doc

DOC = fleet_document({"us-east": 2, "eu-frankfurt": 1, "ap-seoul": 1}, name="demo")


def test_view_keeps_replicas_and_takes_the_regions_rtts() -> None:
    spec = parse_fleet(DOC)
    view = parse_fleet(view_doc(DOC, "ap-seoul", offset_addresses(DOC, 100)))
    assert view.proxy_region == "ap-seoul" and view.name == "demo-ap-seoul"
    assert [r.name for r in view.replicas] == [r.name for r in spec.replicas]
    assert [(r.host, r.port) for r in view.replicas] == [(r.host, r.port + 100)
                                                         for r in spec.replicas]
    for g in view.regions:
        assert (g.rtt_ms, g.jitter_ms) == link_from(spec, "ap-seoul", g.name)
    assert view.regions[-1].rtt_ms < view.regions[0].rtt_ms  # ap-seoul is near, us-east far
    with pytest.raises(ValueError, match="3 addresses for 4 replicas"):
        view_doc(DOC, "ap-seoul", offset_addresses(DOC, 100)[:3])


def test_a_sharing_fleets_views_keep_its_subject() -> None:
    doc = {**DOC, "sharing": {"nats": "nats://bus:4222"}}
    view = parse_fleet(view_doc(doc, "ap-seoul", offset_addresses(doc, 100)))
    assert view.name == "demo-ap-seoul" and view.sharing == parse_fleet(doc).sharing


def test_cli_writes_the_view_with_its_command(tmp_path: Path) -> None:
    fleet, out = tmp_path / "fleet.yaml", tmp_path / "view.yaml"
    fleet.write_text(yaml.safe_dump(DOC))
    assert main(["sim", "view", str(fleet), "--region", "eu-frankfurt", "--port-offset", "7",
                 "-o", str(out)]) == 0
    text = out.read_text()
    assert f"gorgo sim view {fleet} --region eu-frankfurt --port-offset 7" in text
    assert yaml.safe_load(text) == view_doc(DOC, "eu-frankfurt", offset_addresses(DOC, 7))
    assert load_fleet(out).proxy_region == "eu-frankfurt"


@pytest.mark.parametrize(("args", "message"), [
    (["--region", "us-east", "--port-offset", "100"], "the fleet's own proxy region"),
    (["--region", "mars", "--port-offset", "100"], "unknown region 'mars'"),
    (["--region", "ap-seoul", "--port-offset", "70000"], "out of range"),
])
def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 args: list[str], message: str) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(DOC))
    assert main(["sim", "view", str(fleet), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
