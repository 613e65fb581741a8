"""DNS discovery, I/O half: names resolved at start and re-resolved, with an injected resolver
(and the system one on localhost); a failed or empty answer keeps the last set."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import yaml

from extproc.discovery import DnsDiscovery, system_resolve
from gorgo.core.fleet import FleetSpec

DNS = "vllm-headless.llm.svc.cluster.local"


def _fleet(tmp_path: Path, dns: str = DNS) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump({
        "regions": {"local": None}, "endpoint_picker": True,
        "replicas": [{"name": "vllm", "region": "local", "engine": "vllm",
                      "discover": {"dns": dns, "port": 8000, "interval_s": 0.01}}],
    }))
    return path


def test_system_resolver_finds_localhost() -> None:
    assert "127.0.0.1" in system_resolve("localhost", 80) or "::1" in system_resolve(
        "localhost", 80)


def test_localhost_fleet_resolves_at_start(tmp_path: Path) -> None:
    d = DnsDiscovery(_fleet(tmp_path, "localhost"))
    assert {r.host.strip("[]") for r in d.spec.replicas} <= {"127.0.0.1", "::1"}
    assert all(r.name.startswith("vllm-") for r in d.spec.replicas)


def test_refresh_reports_added_and_removed_and_keeps_the_last_set(tmp_path: Path) -> None:
    answer: list = [["10.0.0.5", "10.0.0.6"]]
    changes: list[tuple[FleetSpec, list[str], list[str]]] = []

    def resolve(name: str, port: int) -> list[str]:
        assert (name, port) == (DNS, 8000)
        if isinstance(answer[0], Exception):
            raise answer[0]
        return answer[0]

    d = DnsDiscovery(_fleet(tmp_path), lambda *c: changes.append(c), resolve)
    assert [r.name for r in d.spec.replicas] == ["vllm-10-0-0-5", "vllm-10-0-0-6"]
    (s,) = d.sources

    async def run() -> list[bool]:
        out = [await d.refresh(s)]  # unchanged
        answer[0] = ["10.0.0.7", "10.0.0.6", "10.0.0.6"]
        out.append(await d.refresh(s))
        answer[0] = socket.gaierror("temporary failure")
        out.append(await d.refresh(s))
        answer[0] = []
        out.append(await d.refresh(s))
        return out

    assert asyncio.run(run()) == [False, True, False, False]
    ((spec, added, removed),) = changes
    assert (added, removed) == (["vllm-10-0-0-7"], ["vllm-10-0-0-5"])
    assert [r.name for r in spec.replicas] == ["vllm-10-0-0-6", "vllm-10-0-0-7"]
    assert d.spec is spec


def test_the_loop_re_resolves_on_its_interval(tmp_path: Path) -> None:
    calls: list[int] = []

    def resolve(name: str, port: int) -> list[str]:
        calls.append(1)
        return [f"10.0.0.{len(calls)}"]

    seen: list[list[str]] = []
    d = DnsDiscovery(_fleet(tmp_path), lambda spec, added, removed: seen.append(added), resolve)

    async def run() -> None:
        d.start()
        while len(seen) < 2:
            await asyncio.sleep(0.01)
        await d.stop()

    asyncio.run(asyncio.wait_for(run(), 30))
    assert seen[:2] == [["vllm-10-0-0-2"], ["vllm-10-0-0-3"]]
