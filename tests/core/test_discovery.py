"""DNS discovery, pure half: a discover: entry expands to one replica per address, named from the
address, or (unresolved) to the one replica at its DNS name; errors name the field."""

from __future__ import annotations

from typing import Any

import pytest

from gorgo.core.discovery import dns_sources, of_family, parse_discovered, replica_name
from gorgo.core.fleet import FleetError

DNS = "vllm-headless.llm.svc.cluster.local"


def _doc(**discover: Any) -> dict[str, Any]:
    return {
        "regions": {"local": None},
        "endpoint_picker": True,
        "default_cluster": "vllm",
        "replicas": [
            {"name": "static-0", "region": "local", "engine": "sglang",
             "address": "10.9.0.1:30000"},
            {"name": "vllm", "region": "local", "engine": "vllm", "cluster": "vllm",
             "prefill_rate": 20000,
             "discover": {"dns": DNS, "port": 8000, "interval_s": 5, **discover}},
        ],
    }


def test_resolved_form_names_replicas_from_their_addresses() -> None:
    spec = parse_discovered(_doc(), {DNS: ["10.0.0.6", "10.0.0.5", "fd00::5"]})
    names = [r.name for r in spec.replicas]
    assert names == ["static-0", "vllm-10-0-0-5", "vllm-10-0-0-6", "vllm-fd00--5"]
    r = spec.replica("vllm-fd00--5")
    assert (r.address, r.cluster, r.engine, r.prefill_rate) == (
        "[fd00::5]:8000", "vllm-fd00--5", "vllm", 20000)
    assert r.health_url == "http://[fd00::5]:8000/health"
    assert not spec.retries.enabled
    # The same pod keeps its name whatever else comes and goes.
    again = parse_discovered(_doc(), {DNS: ["10.0.0.7", "10.0.0.6"]})
    assert "vllm-10-0-0-6" in [r.name for r in again.replicas]
    assert replica_name("vllm", "10.0.0.6") == "vllm-10-0-0-6"


def test_unresolved_form_is_one_replica_at_the_dns_name() -> None:
    spec = parse_discovered(_doc(), None)
    r = spec.replicas[1]
    assert (r.name, r.cluster, r.address) == ("vllm", "vllm", f"{DNS}:8000")
    assert spec.default_cluster == "vllm"
    (s,) = dns_sources(_doc())
    assert (s.index, s.prefix, s.dns, s.port, s.interval_s) == (1, "vllm", DNS, 8000, 5.0)


@pytest.mark.parametrize(("family", "answer", "kept"), [
    # a dual-stack headless Service: every pod answers twice, and was two replicas
    ("auto", ["10.0.0.5", "fd00::5", "10.0.0.6", "fd00::6"], ["10.0.0.5", "10.0.0.6"]),
    ("auto", ["fd00::5", "fd00::6"], ["fd00::5", "fd00::6"]),  # IPv6-only
    ("ipv6", ["10.0.0.5", "fd00::5"], ["fd00::5"]),
    ("ipv4", ["fd00::5"], []),
])
def test_one_address_family_makes_the_replicas(family: str, answer: list[str],
                                               kept: list[str]) -> None:
    (s,) = dns_sources(_doc(family=family))
    assert s.family == family
    assert of_family(answer, family) == kept


def test_no_address_at_all_is_an_error_naming_the_entry() -> None:
    doc = _doc()
    del doc["replicas"][0]
    with pytest.raises(FleetError, match=r"^fleet\.replicas\[0\]\.discover\.dns: .* no address"):
        parse_discovered(doc, {DNS: []})


@pytest.mark.parametrize(("edit", "message"), [
    ({"discover": {"dns": DNS}}, r"replicas\[1\]\.discover\.port: expected a port"),
    ({"discover": {"dns": "10.0.0.1", "port": 80}}, r"replicas\[1\]\.discover\.dns: expected"),
    ({"discover": {"dns": DNS, "port": 80, "ttl": 3}}, r"replicas\[1\]\.discover\.ttl: unknown"),
    ({"discover": {"dns": DNS, "port": 80, "interval_s": 0}}, r"discover\.interval_s: must be"),
    # .nan re-resolved at random moments, .inf never, and 10**400 was an OverflowError
    ({"discover": {"dns": DNS, "port": 80, "interval_s": float("nan")}},
     r"discover\.interval_s: must be a number of seconds > 0 and <= 86400, got nan"),
    ({"discover": {"dns": DNS, "port": 80, "interval_s": float("inf")}},
     r"discover\.interval_s: must be"),
    ({"discover": {"dns": DNS, "port": 80, "interval_s": 10**400}}, r"discover\.interval_s: must"),
    ({"discover": {"dns": DNS, "port": 80, "interval_s": "10"}}, r"discover\.interval_s: must"),
    ({"discover": {"dns": DNS, "port": 80, "family": "v4"}}, r"discover\.family: must be one"),
    ({"address": "10.0.0.1:80"}, r"replicas\[1\]\.address: derived from each"),
    ({"engine": "tgi"}, r"^fleet\.replicas\[1\]\.engine: must be one of"),
])
def test_bad_entries_name_the_field(edit: dict[str, Any], message: str) -> None:
    doc = _doc()
    doc["replicas"][1].update(edit)
    with pytest.raises(FleetError, match=message):
        parse_discovered(doc, {DNS: ["10.0.0.5", "10.0.0.6"]})


def test_one_name_is_discovered_in_one_family() -> None:
    # Answers are the name's: an ipv4 entry and an ipv6 entry of one name took each other's
    # addresses, and the fleet flipped between them on every interval.
    doc = _doc(family="ipv4")
    doc["replicas"].append({**doc["replicas"][1], "name": "v6",
                            "discover": {"dns": DNS, "port": 8000, "family": "ipv6"}})
    with pytest.raises(FleetError, match=r"^fleet\.replicas\[2\]\.discover\.family: .* another "
                       r"entry with family ipv4"):
        parse_discovered(doc, {DNS: ["10.0.0.5", "fd00::5"]})
    doc["replicas"][2]["discover"]["family"] = "ipv4"  # two ports of the same pods: allowed
    doc["replicas"][2]["discover"]["port"] = 8001
    assert len(parse_discovered(doc, {DNS: ["10.0.0.5"]}).replicas) == 3


def test_discovery_needs_picker_mode_and_no_retries() -> None:
    doc = _doc()
    doc["endpoint_picker"] = False
    with pytest.raises(FleetError, match=r"replicas\[1\]\.discover: needs endpoint_picker"):
        parse_discovered(doc, None)
    doc = _doc()
    doc["retries"] = {"enabled": True}
    with pytest.raises(FleetError, match=r"^fleet\.retries\.enabled: "):
        parse_discovered(doc, None)
