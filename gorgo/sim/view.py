"""`gorgo sim view`: another proxy's view of a simulated fleet, for a proxy (Envoy + router) per
region.

A fleet file gives each region's RTT from one proxy region only. A proxy in another region sees
the same replicas under the same names, at addresses of its own (one more link per replica and
view, to the same engine: `gorgo sim fleet --view`), with each region's RTT from its own region
(`gorgo.sim.routers.view_from`). So every router probes, scrapes and routes over its region's
links while all of them load the same engines. The native multi-proxy demo writes its views on
free loopback ports (`gorgo.harness.multiproxy`); the compose file's ``multi`` profile mounts the
views this command writes, each replica on its own service at its port plus a fixed offset.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from gorgo.core.fleet import parse_fleet, read_fleet
from gorgo.errors import UserError, output_file
from gorgo.sim.routers import view_from


def view_doc(doc: dict[str, Any], region: str, addresses: Sequence[str]) -> dict[str, Any]:
    """The fleet document as a proxy in ``region`` sees it, replica k at ``addresses[k]``."""
    spec = parse_fleet(doc)
    if len(addresses) != len(spec.replicas):
        raise ValueError(f"{len(addresses)} addresses for {len(spec.replicas)} replicas")
    view = view_from(spec, region)
    out = json.loads(json.dumps(doc))
    out["name"] = f"{doc.get('name', 'fleet')}-{region}"
    out["proxy_region"] = region
    for g in view.regions:
        out["regions"][g.name] = {**(out["regions"][g.name] or {}),
                                  "sim": {"rtt_ms": g.rtt_ms, "jitter_ms": g.jitter_ms}}
    for r, address in zip(out["replicas"], addresses, strict=True):
        r["address"] = address
    if spec.sharing is not None:  # the fleet's subject, not one named after the view
        out["sharing"] = {"nats": spec.sharing.nats, "subject": spec.sharing.subject}
    return out


def offset_addresses(doc: dict[str, Any], offset: int) -> list[str]:
    """Each replica's address with its port moved by ``offset`` (same host)."""
    return [f"{r.host}:{r.port + offset}" for r in parse_fleet(doc).replicas]


def header(fleet: str, region: str, offset: int) -> str:
    return (f"# The fleet {fleet} as a proxy in {region} sees it (its own links, each replica's "
            f"port + {offset}).\n# Generated: gorgo sim view {fleet} --region {region} "
            f"--port-offset {offset}\n")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("fleet", help="fleet YAML file with engine: sim replicas")
    p.add_argument("--region", required=True, help="the region of the proxy that sees it")
    p.add_argument("--port-offset", type=int, required=True,
                   help="each replica's link for this view listens at its port plus this")
    p.add_argument("-o", "--output", default="-", help="file to write (default: stdout)")


def main(args: argparse.Namespace) -> int:
    """Write the view; an unknown region or a port beyond 65535 is a UserError."""
    if args.output != "-":
        output_file(args.output)
    doc = read_fleet(args.fleet)  # a missing or bad file: its UserError
    spec = parse_fleet(doc, source=Path(args.fleet).name)
    if args.region not in spec.region_names:
        raise UserError(f"unknown region {args.region!r}: the fleet has "
                        f"{', '.join(spec.region_names)}")
    if args.region == spec.proxy_region:
        raise UserError(f"{args.region} is the fleet's own proxy region: {args.fleet} is its view")
    addresses = offset_addresses(doc, args.port_offset)
    if any(not 0 < int(a.rpartition(":")[2]) < 65536 for a in addresses):
        raise UserError(f"--port-offset {args.port_offset} moves a replica's port out of range")
    text = header(args.fleet, args.region, args.port_offset) + yaml.safe_dump(
        view_doc(doc, args.region, addresses), sort_keys=False)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text)
    return 0
