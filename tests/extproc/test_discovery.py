"""DNS discovery, I/O half: names resolved at start and re-resolved, with an injected resolver
(and the system one on localhost); a failed or empty answer keeps the last set; a changed answer
and a file reload reach the running router, which keeps every other replica's state."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from extproc.discovery import WAIT_RETRY_S, DnsDiscovery, system_resolve
from extproc.main import ExtProcServer
from gorgo.core.discovery import MAX_ADDRESSES, NoAddressYet
from gorgo.core.fleet import FleetError, FleetSpec
from gorgo.core.router import Router
from gorgo.harness.procs import BIN, stop_group

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


def test_a_router_started_before_its_pods_waits_for_them(tmp_path: Path) -> None:
    # Applied with the model servers, the router found no ready pod and exited 2; Kubernetes
    # restarted it with a growing backoff, up to 5 minutes after the pods were ready.
    answers = iter([[], [], ["10.0.0.5"]])
    slept: list[float] = []
    d = DnsDiscovery(_fleet(tmp_path), resolve=lambda name, port: next(answers),
                     wait=slept.append)
    assert slept == [0.01, 0.01] and [r.name for r in d.spec.replicas] == ["vllm-10-0-0-5"]
    with pytest.raises(NoAddressYet, match=r"discover\.dns: .* resolved to no address"):
        DnsDiscovery(_fleet(tmp_path), resolve=lambda name, port: [])  # no wait: refused


def test_a_waiting_router_reads_its_file_again_and_tries_every_few_seconds(
        tmp_path: Path) -> None:
    # It waited on the name of the file it started with (a fixed ConfigMap never taken up), and
    # an hourly interval_s made it wait up to an hour for pods long ready.
    path = _fleet(tmp_path, "typo.invalid")
    doc = yaml.safe_load(path.read_text())
    doc["replicas"][0]["discover"]["interval_s"] = 3600
    path.write_text(yaml.safe_dump(doc))
    slept: list[float] = []

    def fixed(seconds: float) -> None:
        slept.append(seconds)
        path.write_text(path.read_text().replace("typo.invalid", DNS))

    d = DnsDiscovery(path, resolve=lambda name, port: ["10.0.0.5"] if name == DNS else [],
                     wait=fixed)
    assert slept == [WAIT_RETRY_S] and [r.name for r in d.spec.replicas] == ["vllm-10-0-0-5"]


@pytest.mark.slow
def test_gorgo_extproc_waits_for_a_name_that_answers_nothing_and_stops_on_sigterm(
        tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [str(BIN / "gorgo"), "extproc", "--fleet", str(_fleet(tmp_path, "gorgo-test.invalid")),
         "--port", "0", "--metrics-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        waiting = 0
        while waiting < 2:  # not ready, not exited: resolving again on the interval
            line = proc.stdout.readline()
            assert line and "Traceback" not in line, line
            waiting += "event=dns_waiting" in line and "gorgo-test.invalid" in line
        os.killpg(proc.pid, signal.SIGHUP)  # a reload asked: the file is read on each try
        while waiting < 4:
            line = proc.stdout.readline()
            assert line and "Traceback" not in line, line
            waiting += "event=dns_waiting" in line
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        stop_group(proc)
    assert proc.returncode == 0 and "stopped (SIGTERM)" in out and "READY" not in out, out


@pytest.mark.slow
@pytest.mark.parametrize("flags", [
    ["--workers", "99999"], ["--admin-token-file", "/nonexistent/token"],
    ["--cds-file", "clusters.yaml"]])
def test_a_bad_flag_is_refused_before_waiting_for_the_pods(
        tmp_path: Path, flags: list[str]) -> None:
    # It waited with the router until the pods came up, then crash-looped on the flag.
    done = subprocess.run(
        [str(BIN / "gorgo"), "extproc", "--fleet", str(_fleet(tmp_path, "gorgo-test.invalid")),
         "--port", "0", "--metrics-port", "0", *flags],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and "dns_waiting" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


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


def test_an_answer_of_thousands_of_addresses_is_capped(tmp_path: Path) -> None:
    """Each replica is scored on every request, and 20,000 addresses held the router's loop for
    4 s per change: the lowest MAX_ADDRESSES are kept, and a change is still diffed quickly."""
    answer = [[f"10.{k // 250}.{k % 250}.1" for k in range(3000)]]
    changes: list = []
    d = DnsDiscovery(_fleet(tmp_path), lambda *c: changes.append(c), lambda *_: answer[0])
    assert len(d.spec.replicas) == MAX_ADDRESSES
    assert len(d.answers[DNS]) == MAX_ADDRESSES and d.answers[DNS] == sorted(answer[0])[
        :MAX_ADDRESSES]
    answer[0] = answer[0][1:]  # one address gone: one added at the end of the kept range
    assert asyncio.run(d.refresh(d.sources[0]))
    ((_, added, removed),) = changes
    assert len(added) == len(removed) == 1


def test_a_dual_stack_answer_is_one_replica_per_pod(tmp_path: Path) -> None:
    answer = ["10.0.0.5", "fd00::5", "10.0.0.6", "fd00::6"]
    d = DnsDiscovery(_fleet(tmp_path), lambda *c: None, lambda *_: answer)
    assert [r.name for r in d.spec.replicas] == ["vllm-10-0-0-5", "vllm-10-0-0-6"]


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


# --- changes applied live (ExtProcServer: the membership reload) ----------------------------


def _mixed_fleet(tmp_path: Path, **extra: object) -> Path:
    """A listed replica and a discover: entry."""
    path = tmp_path / "fleet.yaml"
    doc = {
        "regions": {"local": None}, "endpoint_picker": True,
        "replicas": [
            {"name": "static-0", "region": "local", "engine": "sglang",
             "address": "10.9.0.1:30000"},
            {"name": "vllm", "region": "local", "engine": "vllm",
             "discover": {"dns": DNS, "port": 8000, "interval_s": 0.01}},
        ],
        **extra,
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(doc))
    tmp.replace(path)  # atomically, as a ConfigMap swap
    return path


def _server(tmp_path: Path, answer: list[list[str]]) -> tuple[ExtProcServer, DnsDiscovery]:
    d = DnsDiscovery(_mixed_fleet(tmp_path), resolve=lambda name, port: answer[0])
    return ExtProcServer(Router(d.spec), fleet_path=str(d.path), discovery=d), d


def test_a_changed_answer_adds_and_removes_replicas_keeping_the_others_state(
        tmp_path: Path) -> None:
    answer = [["10.0.0.5", "10.0.0.6"]]
    server, d = _server(tmp_path, answer)
    s = server.router.state
    assert s.names == ["static-0", "vllm-10-0-0-5", "vllm-10-0-0-6"]
    for name, rtt in (("static-0", 12.0), ("vllm-10-0-0-6", 3.0)):
        s.rtt_ms[s.index[name]], s.rtt_samples[s.index[name]] = rtt, 7
    answer[0] = ["10.0.0.6", "10.0.0.7"]
    (source,) = d.sources
    assert asyncio.run(d.refresh(source))
    s = server.router.state
    assert s.names == ["static-0", "vllm-10-0-0-6", "vllm-10-0-0-7"]
    assert [float(s.rtt_ms[s.index[n]]) for n in ("static-0", "vllm-10-0-0-6")] == [12.0, 3.0]
    assert int(s.rtt_samples[s.index["vllm-10-0-0-6"]]) == 7
    # The new pod is unroutable until its first probe answers.
    assert not s.healthy[s.index["vllm-10-0-0-7"]] and s.healthy[s.index["vllm-10-0-0-6"]]
    assert server.router.spec.replica("vllm-10-0-0-7").address == "10.0.0.7:8000"
    assert server.reloader.status()["last_error"] is None


def test_a_file_reload_resolves_discover_entries_and_follows_a_changed_name(
        tmp_path: Path) -> None:
    answer = [["10.0.0.5"]]
    asked: list[str] = []

    def resolve(name: str, port: int) -> list[str]:
        asked.append(name)
        return ["10.1.0.1"] if name == "other.llm.svc" else answer[0]

    d = DnsDiscovery(_mixed_fleet(tmp_path), resolve=resolve)
    server = ExtProcServer(Router(d.spec), fleet_path=str(d.path), discovery=d)
    s = server.router.state
    s.rtt_ms[s.index["vllm-10-0-0-5"]] = 4.0
    _mixed_fleet(tmp_path, name="renamed")  # another document, the same DNS entry
    server.reloader.poll()
    s = server.router.state
    assert server.router.spec.name == "renamed"
    assert s.names == ["static-0", "vllm-10-0-0-5"]  # resolved: never the DNS name itself
    assert float(s.rtt_ms[s.index["vllm-10-0-0-5"]]) == 4.0 and asked == [DNS]
    # A changed name is resolved on the reload and re-resolved from then on.
    doc = yaml.safe_load(d.path.read_text())
    doc["replicas"][1]["discover"]["dns"] = "other.llm.svc"
    d.path.with_suffix(".tmp").write_text(yaml.safe_dump(doc))
    d.path.with_suffix(".tmp").replace(d.path)
    server.reloader.poll()
    assert server.router.state.names == ["static-0", "vllm-10-1-0-1"]
    assert [src.dns for src in d.sources] == ["other.llm.svc"]


def test_a_reload_that_brings_discovery_under_a_clusters_file_is_refused(
        tmp_path: Path) -> None:
    """The entry's fail-open cluster is in Envoy's bootstrap, never in the file the router
    rewrites; and a discovered pod became the guarded default, so a DNS answer without it was
    refused for good."""
    cds = tmp_path / "cds.yaml"
    doc = yaml.safe_load(_mixed_fleet(tmp_path).read_text())
    doc["replicas"] = doc["replicas"][:1]
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc))
    d = DnsDiscovery(path, resolve=lambda name, port: ["10.0.0.5"])
    server = ExtProcServer(Router(d.spec), fleet_path=str(path), cds_file=str(cds), discovery=d)
    _mixed_fleet(tmp_path)
    with pytest.raises(FleetError, match=r"replicas\[1\]\.discover: .* without a clusters file"):
        server.reloader.reload_file("test")
    assert server.router.state.names == ["static-0"] and not cds.exists()


def test_a_name_that_does_not_answer_is_left_to_its_interval_on_reloads(
        tmp_path: Path) -> None:
    """Each reload, admin change or SIGHUP re-resolved it on the router's loop, holding every
    decision for the resolver's timeout while the name stayed unanswered."""
    asked: list[str] = []

    def resolve(name: str, port: int) -> list[str]:
        asked.append(name)
        raise socket.gaierror(socket.EAI_AGAIN, "temporary failure in name resolution")

    d = DnsDiscovery(_mixed_fleet(tmp_path), resolve=resolve)
    server = ExtProcServer(Router(d.spec), fleet_path=str(d.path), discovery=d)
    assert server.router.state.names == ["static-0"] and asked == [DNS]
    for name in ("one", "two"):
        _mixed_fleet(tmp_path, name=name)
        server.reloader.poll()
        assert server.router.spec.name == name
    assert asked == [DNS]  # resolved at start only: the interval retries it, off the loop


def test_a_new_name_that_answered_nothing_is_tried_again_on_a_later_reload(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reload naming a Service not created yet is refused; once it resolves, a reload takes
    it (its empty answer was kept and never asked again: refused until a restart), at most
    every RETRY_UNADOPTED_S."""
    ready = {DNS: ["10.0.0.5"]}
    asked: list[str] = []

    def resolve(name: str, port: int) -> list[str]:
        asked.append(name)
        if name in ready:
            return ready[name]
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    d = DnsDiscovery(_fleet(tmp_path), resolve=resolve)
    server = ExtProcServer(Router(d.spec), fleet_path=str(d.path), discovery=d)
    _fleet(tmp_path, dns="new.svc")
    with pytest.raises(FleetError, match=r"new\.svc"):
        server.reloader.reload_file("SIGHUP")
    with pytest.raises(FleetError, match=r"new\.svc"):  # within the retry time: not asked again
        server.reloader.reload_file("SIGHUP")
    assert asked.count("new.svc") == 1
    ready["new.svc"] = ["10.1.0.1"]
    monkeypatch.setattr("extproc.discovery.RETRY_UNADOPTED_S", 0.0)
    server.reloader.reload_file("SIGHUP")
    assert server.router.state.names == ["vllm-10-1-0-1"]


def test_discovered_replicas_are_drained_by_their_entry_and_named_in_the_error(
        tmp_path: Path) -> None:
    server, _ = _server(tmp_path, [["10.0.0.5", "10.0.0.6"]])
    with pytest.raises(FleetError, match=r"^vllm-10-0-0-5: discovered from a DNS name"):
        server.reloader.drain("vllm-10-0-0-5", True)
    server.reloader.drain("vllm", True)
    assert server.router.state.draining.tolist() == [False, True, True]


def test_a_change_the_router_refuses_is_not_committed(tmp_path: Path) -> None:
    answer = [["10.0.0.5"]]
    refuse = [True]

    def on_change(spec: FleetSpec, added: list[str], removed: list[str]) -> None:
        if refuse[0]:
            raise FleetError("refused")

    d = DnsDiscovery(_fleet(tmp_path), on_change, lambda name, port: answer[0])
    (s,) = d.sources
    answer[0] = ["10.0.0.6"]
    assert not asyncio.run(d.refresh(s))
    assert d.answers[DNS] == ["10.0.0.5"]  # so the next interval tries again
    refuse[0] = False
    assert asyncio.run(d.refresh(s)) and d.answers[DNS] == ["10.0.0.6"]
