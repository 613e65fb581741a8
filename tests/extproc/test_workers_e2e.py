"""`gorgo extproc --workers 2` behind real Envoy: both workers route, the supervisor fans weights
out to every worker, and a killed worker is restarted with the same weights, no request lost."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from gorgo.core.contract import REPLICA_HEADER
from gorgo.envoy_config import EXTPROC_CLUSTER
from gorgo.harness.procs import BIN, GorgoProcess, stop_group, wait_for
from tests.support.e2e import Stack, post, start_stack, stop_stack

pytestmark = pytest.mark.envoy
TOKEN = "workers-test-token"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("workers")
    token = tmp / "token"
    token.write_text(TOKEN)
    st = start_stack(tmp, n=2, workers=2, extproc_args=("--admin-token-file", str(token)))
    yield st
    stop_stack(st)


def _http(st: Stack, method: str, path: str, body: dict | None = None,
          timeout: float = 5.0) -> tuple[int, dict | str]:
    return _call(method, f"http://127.0.0.1:{st.extproc.field('metrics')}{path}", body, timeout)


def _call(method: str, url: str, body: dict | None = None,
          timeout: float = 5.0) -> tuple[int, dict | str]:
    req = urllib.request.Request(url, method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"authorization": f"Bearer {TOKEN}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as err:
        raw, status = err.read().decode(), err.code
    return status, json.loads(raw) if raw.startswith("{") else raw


def _metric(st: Stack, name: str) -> dict[str, float]:
    _, text = _http(st, "GET", "/metrics")
    out: dict[str, float] = {}
    for line in str(text).splitlines():
        if line.startswith((name + "{", name + " ")):
            labels, _, value = line.rpartition(" ")
            out[labels[len(name):]] = out.get(labels[len(name):], 0.0) + float(value)
    return out


def _per_worker(st: Stack, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, v in _metric(st, name).items():
        worker = labels.split('worker="', 1)[1].split('"', 1)[0]
        out[worker] = out.get(worker, 0.0) + v
    return out


def _burst(st: Stack, n: int) -> list[tuple[int, dict]]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello workers"}]}

    async def go() -> list[tuple[int, dict]]:
        answers = await asyncio.gather(*(post(st.url + "/v1/chat/completions",
                                              {**body, "user": str(k)}, {}) for k in range(n)))
        return [(status, headers) for status, headers, _, _ in answers]
    return st.lt.run(go(), timeout=60)


def _worker_pid(st: Stack, k: int) -> int:
    """The pid of worker ``k``'s latest run, from the supervisor's log."""
    return _worker_pid_of(st.extproc, k)


def _worker_pid_of(proc: GorgoProcess, k: int) -> int:
    started = [line for line in proc.lines
               if "event=worker_started" in line and f" worker={k} " in line]
    return int(started[-1].split(" pid=", 1)[1].split()[0])


def _workers(st: Stack) -> list[int]:
    pid = st.extproc.p.pid
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_both_workers_serve_and_route(stack: Stack) -> None:
    before = _per_worker(stack, "gorgo_decisions_total")
    answers = _burst(stack, 24)
    assert [s for s, _ in answers] == [200] * 24
    assert all(REPLICA_HEADER in h for _, h in answers)  # routed, not failed open
    after = _per_worker(stack, "gorgo_decisions_total")
    routed = {w: after.get(w, 0) - before.get(w, 0) for w in ("0", "1")}
    assert sum(routed.values()) == 24
    assert min(routed.values()) >= 6, routed  # Envoy's round robin spreads the streams
    status, ready = _http(stack, "GET", "/readyz")
    assert status == 200 and ready["checks"] == {"worker0": True, "worker1": True}


def test_weights_reach_every_worker_and_a_killed_worker_comes_back_with_them(
        stack: Stack) -> None:
    status, body = _http(stack, "PUT", "/admin/weights", {"rtt": 2.5, "version": 7})
    assert status == 200 and body["rtt"] == 2.5
    _, got = _http(stack, "GET", "/admin/weights")
    assert got["workers"] == [{"worker": 0, "version": 7}, {"worker": 1, "version": 7}]
    assert _metric(stack, "gorgo_weights_version") == {'{worker="0"}': 7.0, '{worker="1"}': 7.0}
    # A stale version is refused by every worker alike: the supervisor passes their answer on.
    status, _ = _http(stack, "PUT", "/admin/weights", {"rtt": 1.0, "version": 3})
    assert status == 409

    assert [s for s, _ in _burst(stack, 16)] == [200] * 16
    _, got = _http(stack, "GET", "/admin/weights")
    routed_before, processes = sum(got["routed"]["7"].values()), set(got["routed_by"])
    assert 0 < routed_before <= 16 and processes and "router" not in got

    victim = _workers(stack)[0]
    os.kill(victim, signal.SIGKILL)
    answers = _burst(stack, 16)  # while worker 0 is down: Envoy fails open or the other routes
    assert [s for s, _ in answers] == [200] * 16
    routed_down = sum(REPLICA_HEADER in h for _, h in answers)
    assert wait_for(lambda: _metric(stack, "gorgo_workers_up").get("", 0) == 2, 60, 0.2)
    assert _metric(stack, "gorgo_worker_restarts_total") == {'{worker="0"}': 1.0}
    assert victim not in _workers(stack) and len(_workers(stack)) == 2
    _, got = _http(stack, "GET", "/admin/weights")
    assert got["workers"] == [{"worker": 0, "version": 7}, {"worker": 1, "version": 7}]
    assert got["rtt"] == 2.5
    # The killed run's decisions still count (the tuner's census waits for their spans): the
    # sum had dropped by them, the restarted worker counting from 0. They are kept as retired.
    assert len(processes - set(got["routed_by"])) <= 1 and "retired" in got["routed_by"]
    assert sum(got["routed"]["7"].values()) >= routed_before + routed_down
    # Envoy routes to the restarted worker again once its health check passes.
    assert wait_for(lambda: all(REPLICA_HEADER in h for _, h in _burst(stack, 8)), 20, 0.5)


def test_a_restarted_worker_takes_the_admin_membership_changes_of_its_peers(
        stack: Stack) -> None:
    """It started from the file: a replica drained through the supervisor took traffic
    again from the restarted worker, which also reported its own view of the fleet."""
    status, _ = _http(stack, "POST", "/admin/fleet/replicas/r0/drain", {"drain": True})
    assert status == 200
    try:
        restarts = _metric(stack, "gorgo_worker_restarts_total").get('{worker="0"}', 0.0)
        os.kill(_worker_pid(stack, 0), signal.SIGKILL)
        assert wait_for(lambda: _metric(stack, "gorgo_worker_restarts_total").get(
            '{worker="0"}', 0.0) == restarts + 1
            and _metric(stack, "gorgo_workers_up").get("", 0) == 2, 60, 0.2)
        _, fleet = _http(stack, "GET", "/admin/fleet")  # the first worker up: the restarted one
        assert {r["name"]: r["draining"] for r in fleet["replicas"]} == {"r0": True,
                                                                         "r1": False}
    finally:
        _http(stack, "POST", "/admin/fleet/replicas/r0/drain", {"drain": False})


def test_a_worker_restarted_after_a_replica_left_takes_the_weights_without_its_rate(
        stack: Stack) -> None:
    """The kept weights named a replica the fleet has since lost: replayed whole, the restarted
    worker refused them (unknown replica) and routed on version 0 while counted as up."""
    status, _ = _http(stack, "PUT", "/admin/weights",
                      {"rtt": 3.0, "version": 9, "prefill_rate": {"r0": 9000, "r1": 8000}})
    assert status == 200
    doc = yaml.safe_load(stack.fleet_path.read_text())  # the operator takes r1 out of the file
    doc["replicas"] = [r for r in doc["replicas"] if r["name"] != "r1"]
    tmp = stack.fleet_path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(doc))
    os.replace(tmp, stack.fleet_path)
    assert wait_for(lambda: _metric(stack, "gorgo_fleet_reloads_total").get(
        '{result="applied",worker="1"}', 0) >= 1, 30, 0.2)
    victim = _workers(stack)[1]
    os.kill(victim, signal.SIGKILL)
    assert wait_for(lambda: victim not in _workers(stack) and len(_workers(stack)) == 2
                    and _metric(stack, "gorgo_workers_up").get("", 0) == 2, 60, 0.2)
    _, got = _http(stack, "GET", "/admin/weights")
    assert got["workers"] == [{"worker": 0, "version": 9}, {"worker": 1, "version": 9}]
    status, ready = _http(stack, "GET", "/readyz")
    assert status == 200 and ready["checks"] == {"worker0": True, "worker1": True}


def test_a_client_holding_an_admin_body_open_holds_no_change_back(stack: Stack) -> None:
    # Without a token, an announced body never sent held the supervisor's lock: every admin
    # change, and a restarted worker's start, waited for as long as the client liked.
    port = stack.extproc.field("metrics")
    held = []
    for auth in ("", f"authorization: Bearer {TOKEN}\r\n"):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(f"PUT /admin/weights HTTP/1.1\r\nhost: x\r\n{auth}"
                     "content-type: application/json\r\ncontent-length: 100\r\n\r\n".encode())
        held.append(sock)
    try:
        assert held[0].recv(65536).startswith(b"HTTP/1.1 401")  # at once, unread
        version = _http(stack, "GET", "/admin/weights")[1]["version"]  # type: ignore[index]
        status, _ = _http(stack, "PUT", "/admin/weights",
                          {"rtt": 1.0, "queue": 1.0, "version": version + 1}, timeout=5.0)
        assert status == 200
        held[1].settimeout(30)
        answer = held[1].recv(65536)  # the token's owner who never sends its body: a 408
        assert answer.startswith(b"HTTP/1.1 408") and b'"error"' in answer
    finally:
        for sock in held:
            sock.close()


def test_sighup_reloads_every_worker_and_the_supervisor_lives(stack: Stack) -> None:
    """SIGHUP, the documented fleet reload, ended the supervisor (its default action) and with
    it every worker."""
    before = _per_worker(stack, "gorgo_fleet_reloads_total")
    os.kill(stack.extproc.p.pid, signal.SIGHUP)
    assert wait_for(lambda: all(
        _per_worker(stack, "gorgo_fleet_reloads_total").get(w, 0) > before.get(w, 0)
        for w in ("0", "1")), 15, 0.2)
    assert stack.extproc.p.poll() is None and len(_workers(stack)) == 2
    assert all(REPLICA_HEADER in h for _, h in _burst(stack, 4))


def test_a_hung_worker_leaves_envoys_rotation_and_the_supervisors_answers(
        stack: Stack) -> None:
    """A stopped (not dead) worker still completes TCP handshakes: a connect-only health check
    kept it in the round robin, half the requests waited for Envoy's message timeout and went
    out unrouted, and the supervisor's /metrics waited 30 s for it."""
    name = f"cluster.{EXTPROC_CLUSTER}.membership_healthy"
    victim = _worker_pid(stack, 0)  # the one reads went to first
    os.kill(victim, signal.SIGSTOP)
    try:
        assert wait_for(lambda: stack.envoy.stats(name).get(name) == 1, 15)
        answers = _burst(stack, 8)
        assert [s for s, _ in answers] == [200] * 8
        assert all(REPLICA_HEADER in h for _, h in answers)  # the other worker routed them all
        status, text = _http(stack, "GET", "/metrics")  # the hung worker left out, in time
        assert status == 200 and 'gorgo_decisions_total{' in str(text)
        status, weights = _http(stack, "GET", "/admin/weights")  # the worker that answered
        assert status == 200 and [w["worker"] for w in weights["workers"]] == [1]
        status, _ = _http(stack, "POST", "/admin/explain", {
            "path": "/v1/chat/completions", "body": '{"messages": []}'})
        assert status == 200
        # a change to every worker is answered too (it waited for ever), as a split answer
        version = weights["version"] + 1
        status, split = _http(stack, "PUT", "/admin/weights", {"rtt": 1.5, "version": version},
                              timeout=30)
        assert status == 502 and {w["status"] for w in split["error"]["workers"]} == {200, 503}
    finally:
        os.kill(victim, signal.SIGCONT)
    assert wait_for(lambda: stack.envoy.stats(name).get(name) == 2, 15)


def test_the_clusters_file_is_written_with_workers_and_each_worker_keeps_its_rules(
        stack: Stack, tmp_path: Path) -> None:
    """--cds-file was silently dropped with --workers: no file, and Envoy had no clusters. Then
    only worker 0 had it, so only worker 0 refused removing Envoy's fail-open replica: a 502
    split, the other worker routing a fleet the file no longer matched."""
    cds, token, fleet = tmp_path / "cds.yaml", tmp_path / "token", tmp_path / "fleet.yaml"
    token.write_text(TOKEN)
    doc = yaml.safe_load(stack.fleet_path.read_text())  # an earlier test took r1 out of it
    r0 = next(r for r in doc["replicas"] if r["name"] == "r0")
    doc["replicas"] = [r0, {**r0, "name": "r1", "address": "127.0.0.1:9"}]
    fleet.write_text(yaml.safe_dump(doc))
    proc = GorgoProcess(["extproc", "--fleet", str(fleet), "--port", "0",
                         "--metrics-port", "0", "--workers", "2", "--cds-file", str(cds),
                         "--admin-token-file", str(token)], timeout=60)
    try:
        names = {c["name"] for c in yaml.safe_load(cds.read_text())["resources"]}
        assert {"r0", "r1"} <= names
        url = f"http://127.0.0.1:{proc.field('metrics')}/admin/fleet/replicas/"
        status, body = _call("DELETE", url + "r0")  # Envoy's fail-open cluster
        assert status == 400 and "fail open" in body["error"]["message"], body
        status, body = _call("DELETE", url + "r1")
        assert status == 200, body
        names = {c["name"] for c in yaml.safe_load(cds.read_text())["resources"]}
        assert "r0" in names and "r1" not in names
    finally:
        proc.stop()


def test_a_restarted_worker_runs_its_peers_fleet_and_the_clusters_file_never_leaves_it(
        tmp_path: Path) -> None:
    """A restarted worker replayed the weights before the admin changes (an added replica's
    rate dropped: the workers' rates diverged), forgot the changes once the file changed even
    when every worker refused it (an admin-drained replica routable again), and worker 0
    rewrote the clusters file from the file at its start (an added replica's cluster gone, a
    removed one back; after a refused file, Envoy's fail-open cluster gone)."""
    cds, token, fleet = tmp_path / "cds.yaml", tmp_path / "token", tmp_path / "fleet.yaml"
    token.write_text(TOKEN)

    def replica(k: int) -> dict:
        return {"name": f"r{k}", "region": "local", "address": f"127.0.0.1:{9 + k}",
                "engine": "vllm"}
    doc = {"name": "restarts", "regions": {"local": {}}, "replicas": [replica(0), replica(1)]}
    fleet.write_text(yaml.safe_dump(doc))
    proc = GorgoProcess(["extproc", "--fleet", str(fleet), "--port", "0", "--metrics-port", "0",
                         "--workers", "2", "--cds-file", str(cds),
                         "--admin-token-file", str(token)], timeout=60)
    url = f"http://127.0.0.1:{proc.field('metrics')}"
    seen: list[set[str]] = []
    stop = threading.Event()

    def watch() -> None:  # every version of the clusters file Envoy could read
        last = None
        while not stop.is_set():
            with contextlib.suppress(OSError, yaml.YAMLError, TypeError):
                if (inode := os.stat(cds).st_ino) != last:
                    last = inode
                    seen.append({c["name"] for c in yaml.safe_load(cds.read_text())["resources"]})
            time.sleep(0.002)

    def rates() -> dict[str, dict[str, float]]:
        _, text = _call("GET", url + "/metrics")
        out: dict[str, dict[str, float]] = {}
        for line in str(text).splitlines():
            if line.startswith("gorgo_prefill_rate_tokens_per_second{"):
                labels, _, value = line.rpartition(" ")
                name = labels.split('replica="', 1)[1].split('"', 1)[0]
                worker = labels.split('worker="', 1)[1].split('"', 1)[0]
                out.setdefault(worker, {})[name] = float(value)
        return out

    def restarts() -> float:
        _, text = _call("GET", url + "/metrics")
        return sum(float(line.rpartition(" ")[2]) for line in str(text).splitlines()
                   if line.startswith("gorgo_worker_restarts_total{"))

    def up() -> bool:
        _, text = _call("GET", url + "/metrics")
        return "gorgo_workers_up 2.0" in str(text)

    watcher = threading.Thread(target=watch)
    try:
        assert _call("POST", url + "/admin/fleet/replicas", replica(2))[0] == 200
        assert _call("PUT", url + "/admin/weights", {"rtt": 1.0, "version": 5, "prefill_rate": {
            "r2": 5000}})[0] == 200
        assert _call("DELETE", url + "/admin/fleet/replicas/r1")[0] == 200
        assert _call("POST", url + "/admin/fleet/replicas/r2/drain")[0] == 200
        # the operator's file drops Envoy's fail-open replica: every worker refuses it
        tmp = fleet.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump({**doc, "replicas": [replica(1)]}))
        os.replace(tmp, fleet)
        assert wait_for(lambda: all("fail open" in str(_call(
            "GET", url + "/admin/fleet")[1]) for _ in range(4)), 30, 0.2)
        watcher.start()
        for k in (0, 1):
            before = restarts()
            os.kill(_worker_pid_of(proc, k), signal.SIGKILL)
            assert wait_for(lambda: restarts() == before + 1 and up(), 60, 0.2)  # noqa: B023
        time.sleep(1.5)  # a poll of the file after the restarts
        assert rates() == {"0": {"r0": 10000.0, "r2": 5000.0},
                           "1": {"r0": 10000.0, "r2": 5000.0}}
        _, state = _call("GET", url + "/admin/fleet")
        assert {r["name"]: r["draining"] for r in state["replicas"]} == {"r0": False,
                                                                         "r2": True}
    finally:
        stop.set()
        if watcher.is_alive():
            watcher.join()
        proc.stop()
    assert seen and all("r0" in names and "r2" in names and "r1" not in names
                        for names in seen), seen


def test_without_the_admin_token_a_restarted_worker_still_runs_its_peers_fleet(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No admin change exists without the token, but a fleet file every worker refused was what
    a restarted worker ran (and worker 0 wrote it to the clusters file, Envoy's fail-open
    cluster gone); the admin API stays off for clients."""
    cds, fleet = tmp_path / "cds.yaml", tmp_path / "fleet.yaml"
    replicas = [{"name": f"r{k}", "region": "local", "address": f"127.0.0.1:{9 + k}",
                 "engine": "vllm"} for k in range(2)]
    doc = {"name": "no-token", "regions": {"local": {}}, "replicas": replicas}
    fleet.write_text(yaml.safe_dump(doc))
    monkeypatch.delenv("GORGO_ADMIN_TOKEN", raising=False)
    proc = GorgoProcess(["extproc", "--fleet", str(fleet), "--port", "0", "--metrics-port", "0",
                         "--workers", "2", "--cds-file", str(cds)], timeout=60)
    url = f"http://127.0.0.1:{proc.field('metrics')}"

    def metric(name: str) -> list[str]:
        return [line for line in str(_call("GET", url + "/metrics")[1]).splitlines()
                if line.startswith(name)]
    try:
        tmp = fleet.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump({**doc, "replicas": replicas[1:]}))  # drops the default
        os.replace(tmp, fleet)
        assert wait_for(lambda: len([line for line in metric("gorgo_fleet_reloads_total{")
                                     if 'result="error"' in line]) == 2, 30, 0.2)
        before = len(metric("gorgo_worker_restarts_total{"))
        os.kill(_worker_pid_of(proc, 0), signal.SIGKILL)
        assert wait_for(lambda: len(metric("gorgo_worker_restarts_total{")) > before
                        and "gorgo_workers_up 2.0" in metric("gorgo_workers_up"), 60, 0.2)
        rates = {line.split('replica="', 1)[1].split('"', 1)[0] + "@"
                 + line.split('worker="', 1)[1].split('"', 1)[0]
                 for line in metric("gorgo_prefill_rate_tokens_per_second{")}
        assert rates == {"r0@0", "r1@0", "r0@1", "r1@1"}
        assert {c["name"] for c in yaml.safe_load(cds.read_text())["resources"]} >= {"r0", "r1"}
        status, body = _call("GET", url + "/admin/fleet")
        assert status == 403 and body["error"]["message"] == "admin API disabled"
    finally:
        proc.stop()


def test_a_stop_signal_while_the_workers_start_is_a_clean_stop(stack: Stack) -> None:
    """A SIGTERM to the process group (init systems, `GorgoProcess.stop`) while worker 0 was
    still starting ended with exit 2 and "worker 0 did not start"."""
    proc = subprocess.Popen(
        [str(BIN / "gorgo"), "extproc", "--fleet", str(stack.fleet_path), "--port", "0",
         "--metrics-port", "0", "--workers", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        assert wait_for(lambda: proc.poll() is not None or children.read_text().split(), 30,
                        0.01)
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        stop_group(proc)
    assert proc.returncode == 0, err
    assert "did not start" not in err and "stopped (SIGTERM)" in err


def test_sigterm_stops_every_worker(stack: Stack) -> None:
    """Last in this module: it stops the module's router. A stop signal to the supervisor's
    whole group (Ctrl-C, systemd) reached each worker twice, the supervisor's own SIGTERM after
    the group's, and the second one cut the drain: the streams awaiting their response headers
    lost their routing answer."""
    pids = _workers(stack)
    assert len(pids) == 2
    for u in stack.upstreams:
        u.delay_s = 2.0
    before = sum(len(u.served) for u in stack.upstreams)
    held = [asyncio.run_coroutine_threadsafe(
        post(stack.url + "/v1/chat/completions",
             {"model": "m", "messages": [{"role": "user", "content": f"held {k}"}]}, {}),
        stack.lt.loop) for k in range(4)]
    assert wait_for(lambda: sum(len(u.served) for u in stack.upstreams) >= before + 4, 10)
    os.killpg(stack.extproc.p.pid, signal.SIGTERM)
    answers = [h.result(timeout=30) for h in held]
    assert [a[0] for a in answers] == [200] * 4
    assert all(REPLICA_HEADER in a[1] for a in answers)  # drained, not cut
    stack.extproc.p.wait(30)
    assert stack.extproc.p.returncode == 0
    assert wait_for(lambda: not any(Path(f"/proc/{p}").exists() for p in pids), 15)
