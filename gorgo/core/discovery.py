"""Replicas from DNS: a fleet file's replica entry with ``discover:`` stands for the addresses of
a name (a Kubernetes headless Service) of one family (``family``, FAMILIES), so a rollout needs
no fleet edit.

```yaml
replicas:
  - name: vllm                  # the prefix: replicas are vllm-10-0-0-5, vllm-10-0-0-6, ...
    region: local
    engine: vllm
    cluster: vllm               # Envoy's cluster over the whole name (STRICT_DNS): fail-open
    discover: {dns: vllm-headless.llm.svc.cluster.local, port: 8000, interval_s: 10}
```

Pure: the I/O shell (`extproc/discovery.py`) resolves the names and hands the answers in. The
entry expands in one of two forms, both then checked by `parse_fleet` like any other replica:

- **resolved** (the router): one replica per address, named from the address (``vllm-10-0-0-5``,
  ``vllm-fd00--5``), so the same pod keeps its name, state and metrics labels across refreshes;
  health and metrics URLs are ``http://<address>/health`` and ``/metrics``.
- **unresolved** (the renderer, `gorgo explain`): one replica at ``<dns>:<port>`` with the entry's
  ``cluster``, which Envoy renders as a STRICT_DNS cluster it resolves itself: the fail-open
  default. The pods' own clusters cannot be static, so such a fleet runs in endpoint-picker mode
  (``endpoint_picker: true``): Envoy reaches a picked pod by the IP:port the router names.

Retries stay off (their cluster lists the replicas' addresses statically).
"""

from __future__ import annotations

import copy
import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gorgo.core.fleet import FleetError, FleetSpec, finite_number, host_port, parse_fleet

DISCOVER = "discover"
DEFAULT_INTERVAL_S = 10.0
MAX_INTERVAL_S = 86_400.0  # a day: a longer one is discovery switched off (list the replicas)
# Addresses taken from one name's answer (the lowest, sorted): a fleet is scored per replica on
# every request, and a 20,000-address answer held the router's loop for seconds per change.
MAX_ADDRESSES = 1024
# Derived from each address, so a template may not set them.
DERIVED_FIELDS = ("address", "health_url", "metrics_url")
_DNS_NAME = re.compile(r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.?)+")


@dataclass(frozen=True, slots=True)
class DnsSource:
    """One ``discover:`` entry: its position in ``replicas``, the name prefix and what to ask."""

    index: int
    prefix: str
    dns: str
    port: int
    interval_s: float
    family: str = "auto"  # FAMILIES


# Which addresses of an answer are replicas. A dual-stack headless Service answers an A and an
# AAAA record for every pod: taking both made each pod two replicas (its load, cache view and
# probes split in two). "auto" takes the IPv4 addresses when there are any, else the IPv6 ones.
FAMILIES = ("auto", "ipv4", "ipv6")


def of_family(addresses: Sequence[str], family: str) -> list[str]:
    """The addresses of ``family`` in an answer (see FAMILIES), in their order."""
    v4 = [a for a in addresses if ":" not in a]
    v6 = [a for a in addresses if ":" in a]
    if family == "ipv4":
        return v4
    if family == "ipv6":
        return v6
    return v4 or v6


class NoAddressYet(FleetError):
    """Every ``discover:`` name answered nothing and the fleet lists no other replica: a router
    starting before its pods are ready (`extproc/discovery.py` waits for them)."""


def _fail(path: str, what: str) -> FleetError:
    return FleetError(f"{path}: {what}")


def dns_sources(raw: Any, source: str = "fleet") -> tuple[DnsSource, ...]:
    """The fleet document's ``discover:`` entries, checked (errors name the field)."""
    if not isinstance(raw, Mapping) or not isinstance(raw.get("replicas"), list):
        return ()  # parse_fleet names what is wrong with the document
    out = []
    families: dict[str, str] = {}
    for i, entry in enumerate(raw["replicas"]):
        if not isinstance(entry, Mapping) or DISCOVER not in entry:
            continue
        path = f"{source}.replicas[{i}]"
        for key in DERIVED_FIELDS:
            if key in entry:
                raise _fail(f"{path}.{key}", "derived from each discovered address: remove it")
        if not raw.get("endpoint_picker"):
            raise _fail(f"{path}.{DISCOVER}", "needs endpoint_picker: true (Envoy reaches a "
                        "discovered replica by the address the router names)")
        if (raw.get("retries") or {}).get("enabled"):
            raise _fail(f"{source}.retries.enabled", "retries list the replicas statically: "
                        "they cannot follow discovered replicas")
        d = entry[DISCOVER]
        where = f"{path}.{DISCOVER}"
        if not isinstance(d, Mapping):
            raise _fail(where, f"expected a mapping, got {type(d).__name__}")
        unknown = sorted(map(str, set(d) - {"dns", "port", "interval_s", "family"}))
        if unknown:
            raise _fail(f"{where}.{unknown[0]}",
                        "unknown field (allowed: dns, family, interval_s, port)")
        family = d.get("family", "auto")
        if family not in FAMILIES:
            raise _fail(f"{where}.family", f"must be one of {', '.join(FAMILIES)}, got {family!r}")
        dns = d.get("dns")
        if not isinstance(dns, str) or not _DNS_NAME.fullmatch(dns) or _is_ip(dns):
            raise _fail(f"{where}.dns", f"expected a DNS name, got {dns!r}")
        port = d.get("port")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise _fail(f"{where}.port", f"expected a port 1-65535, got {port!r}")
        given = d.get("interval_s", DEFAULT_INTERVAL_S)
        interval = finite_number(given)  # .nan re-resolved at random, .inf never, 10**400 crashed
        if interval is None or not 0 < interval <= MAX_INTERVAL_S:
            raise _fail(f"{where}.interval_s",
                        f"must be a number of seconds > 0 and <= {MAX_INTERVAL_S:g}, "
                        f"got {str(given)[:40]}")
        other = families.setdefault(dns, family)
        if other != family:
            # Answers are the name's: one entry's refresh overwrote the other's, the fleet
            # flipped between the two families every interval (each flip a new set of replicas).
            raise _fail(f"{where}.family", f"{dns!r} is discovered by another entry with family "
                        f"{other}: one entry per name (family auto takes one family per pod)")
        prefix = entry.get("name")
        if not isinstance(prefix, str) or not prefix:
            raise _fail(f"{path}.name", "required (the prefix of the discovered replicas' names)")
        out.append(DnsSource(i, prefix, dns, port, float(interval), family))
    return tuple(out)


def refuse_clusters_file(sources: Sequence[DnsSource], source: str = "fleet") -> None:
    """A discovered fleet keeps its clusters in Envoy's bootstrap: the entry's STRICT_DNS
    cluster is Envoy's fail-open route, and the router's resolved fleet has no such replica, so
    a clusters file it rewrites would drop the cluster that route names (every request failing
    open a 503). Endpoint-picker mode needs no cluster per pod."""
    if sources:
        raise _fail(f"{source}.replicas[{sources[0].index}].{DISCOVER}",
                    "a fleet that discovers replicas by DNS runs without a clusters file "
                    "(--cds-file): its pods are reached by address, and its fail-open cluster "
                    "is in Envoy's bootstrap")


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def replica_name(prefix: str, ip: str) -> str:
    """The discovered replica's name: the prefix and its address (``vllm-10-0-0-5``)."""
    return f"{prefix}-{re.sub(r'[.:%]', '-', ip)}"


def expand(raw: Mapping[str, Any], sources: Sequence[DnsSource],
           answers: Mapping[str, Sequence[str]] | None) -> tuple[dict[str, Any], list[int]]:
    """The document with each ``discover:`` entry replaced, and for each replica of the result the
    index of the entry it came from. ``answers`` (dns name -> addresses) gives the resolved form;
    None the unresolved one."""
    doc = copy.deepcopy(dict(raw))
    by_index = {s.index: s for s in sources}
    replicas: list[Any] = []
    origin: list[int] = []
    for i, entry in enumerate(doc["replicas"]):
        s = by_index.get(i)
        if s is None:
            replicas.append(entry)
            origin.append(i)
            continue
        template = {k: v for k, v in entry.items() if k != DISCOVER}
        if answers is None:
            replicas.append({**template, "address": f"{s.dns}:{s.port}"})
            origin.append(i)
            continue
        template.pop("cluster", None)
        for ip in sorted(set(answers.get(s.dns, ()))):
            name = replica_name(s.prefix, ip)
            replicas.append({**template, "name": name, "cluster": name,
                             "address": host_port(ip, s.port)})
            origin.append(i)
    doc["replicas"] = replicas
    doc["retries"] = {**(doc.get("retries") or {}), "enabled": False}
    if answers is not None:
        doc.pop("default_cluster", None)  # the renderer's (unresolved) cluster; the router's none
    return doc, origin


def parse_discovered(raw: Any, answers: Mapping[str, Sequence[str]] | None = None,
                     source: str = "fleet") -> FleetSpec:
    """`parse_fleet` of the document with its ``discover:`` entries expanded (see `expand`);
    an error in an expanded replica names the entry it came from."""
    sources = dns_sources(raw, source)
    if not sources:
        return parse_fleet(raw, source)
    doc, origin = expand(raw, sources, answers)
    if not doc["replicas"]:
        s = sources[0]
        raise NoAddressYet(f"{source}.replicas[{s.index}].{DISCOVER}.dns: {s.dns!r} resolved "
                           "to no address, and the fleet lists no other replica")
    try:
        return parse_fleet(doc, source)
    except FleetError as exc:
        m = re.match(rf"{re.escape(source)}\.replicas\[(\d+)\](.*)", str(exc), re.DOTALL)
        if m is None:
            raise
        raise FleetError(f"{source}.replicas[{origin[int(m.group(1))]}]{m.group(2)}") from None
