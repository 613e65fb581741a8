"""A proxy (Envoy + `gorgo extproc`) per region in front of one simulated fleet, on free ports.

Every other proxy than the fleet's own gets a view of the fleet (`gorgo.sim.view`) on free
loopback ports, and `gorgo sim fleet --view` adds one link per replica and view, to the same
engine. Each router therefore probes, scrapes and routes over its own region's links, while all
of them load the same engines: their queues and caches are shared truth, their in-flight
accounting and prefix index are not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from gorgo.core.fleet import parse_fleet
from gorgo.harness.procs import GorgoProcess, ProcessSet, free_ports
from gorgo.harness.stack import LiveStack, StackOptions, start_sim_fleet, with_free_ports
from gorgo.sim.view import view_doc


def region_view(doc: dict[str, Any], region: str) -> dict[str, Any]:
    """The fleet document as a proxy in ``region`` sees it, its replicas on free loopback ports
    (the fleet's proxy region's view is ``doc`` itself, on its own addresses)."""
    if region == parse_fleet(doc).proxy_region:
        return doc
    return view_doc(doc, region, [f"127.0.0.1:{p}" for p in free_ports(len(doc["replicas"]))])


class ProxyPerRegion(ProcessSet):
    """One `gorgo sim fleet` and a `LiveStack` (router + Envoy) per region; `stop()` ends every
    process it started (the stacks first, then the fleet)."""

    def __init__(self, fleet_doc: dict[str, Any], workdir: Path, opts: StackOptions,
                 regions: Sequence[str] | None = None) -> None:
        self.workdir = Path(workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.opts = opts
        spec = parse_fleet(fleet_doc)
        self.regions = list(regions or spec.region_names)
        self._draw(fleet_doc)
        self.fleet: GorgoProcess | None = None
        self.stacks: dict[str, LiveStack] = {}

    def _draw(self, fleet_doc: dict[str, Any]) -> None:
        self.fleet_doc = fleet_doc
        self.docs = {g: region_view(fleet_doc, g) for g in self.regions}

    def _redraw(self) -> None:
        self._draw(with_free_ports(self.fleet_doc))  # the replicas' and the views' ports

    def _start(self, ready_timeout: float) -> None:
        o = self.opts
        fleet_path = self.workdir / "fleet.yaml"
        fleet_path.write_text(yaml.safe_dump(self.fleet_doc, sort_keys=False))
        views = []
        for g, doc in self.docs.items():
            if doc is not self.fleet_doc:
                path = self.workdir / f"view-{g}.yaml"
                path.write_text(yaml.safe_dump(doc, sort_keys=False))
                views += ["--view", str(path)]
        self.fleet = start_sim_fleet(fleet_path, o, views)
        control = f"http://127.0.0.1:{self.fleet.field('control')}"
        for g, doc in self.docs.items():
            opts = replace(o, fleet_control_url=control)
            self.stacks[g] = LiveStack(doc, self.workdir / f"proxy-{g}", opts).start(
                ready_timeout)

    def stop(self) -> None:
        for stack in self.stacks.values():
            stack.stop()
        self.stacks.clear()
        if self.fleet is not None:
            self.fleet.stop()
            self.fleet = None
