"""Models and membership in the router's shell, without Envoy: the 404 for an unknown model and
`/v1/models` as immediate responses, and fleet reloads (file, admin API) that keep the old fleet
on a bad document."""

from __future__ import annotations

import asyncio
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.discovery import DnsDiscovery
from extproc.http_api import make_app
from extproc.main import ExtProcServer
from extproc.service import ExtProcService
from extproc.telemetry import RouterMetrics
from gorgo._xds.envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from gorgo._xds.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from gorgo.core.fleet import FleetError, load_fleet, parse_fleet
from gorgo.core.router import Router
from tests.extproc.test_admin import AUTH, TOKEN, Call, with_admin

DOC = {
    "name": "two-models",
    "regions": {"near": {}},
    "replicas": [
        {"name": "a1", "region": "near", "address": "10.0.0.1:8000", "engine": "sglang",
         "models": ["alpha"]},
        {"name": "b1", "region": "near", "address": "10.0.0.2:8000", "engine": "sglang",
         "models": ["beta"]},
    ],
}


def _process(router: Router, path: str, method: str, body: bytes | None) -> list[Any]:
    service = ExtProcService(router, RouterMetrics(router.state, lambda: router.open_requests))
    headers = pb.HttpHeaders(end_of_stream=body is None, headers=HeaderMap(headers=[
        HeaderValue(key=k, raw_value=v.encode())
        for k, v in {":path": path, ":method": method}.items()]))
    reqs = [pb.ProcessingRequest(request_headers=headers)]
    if body is not None:
        reqs.append(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))

    async def go() -> list[Any]:
        async def it():
            for r in reqs:
                yield r
        return [a async for a in service.Process(it(), None)]

    return asyncio.run(go())


def _immediate(answers: list[Any]) -> tuple[int, dict[str, str], Any]:
    imm = answers[-1].immediate_response
    headers = {h.header.key: h.header.raw_value.decode() for h in imm.headers.set_headers}
    return imm.status.code, headers, json.loads(imm.body)


def test_unknown_model_is_an_openai_404_naming_the_known_models_without_retry_after() -> None:
    body = json.dumps({"model": "gamma", "messages": [{"role": "user", "content": "hi"}]})
    status, headers, err = _immediate(_process(Router(parse_fleet(DOC)), "/v1/chat/completions",
                                               "POST", body.encode()))
    assert status == 404 and "retry-after" not in headers
    assert err["error"]["code"] == "model_not_found" and err["error"]["param"] == "model"
    assert err["error"]["type"] == "invalid_request_error"
    assert "'gamma'" in err["error"]["message"] and "alpha, beta" in err["error"]["message"]


def test_models_list_is_answered_from_the_fleet() -> None:
    status, headers, listing = _immediate(_process(Router(parse_fleet(DOC)), "/v1/models?x=1",
                                                   "GET", None))
    assert status == 200 and headers["content-type"] == "application/json"
    assert listing["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"]) for m in listing["data"]] == [
        ("alpha", "model", "two-models"), ("beta", "model", "two-models")]


def test_a_cors_preflight_of_models_is_routed_for_an_engine_to_answer() -> None:
    # It got the router's list, without the access-control-allow-* headers a browser needs.
    answers = _process(Router(parse_fleet(DOC)), "/v1/models", "OPTIONS", None)
    assert not answers[-1].HasField("immediate_response")
    assert _routed_to(answers)
    status, _, listing = _immediate(_process(Router(parse_fleet(DOC)), "/v1/models", "HEAD",
                                             None))
    assert status == 200 and listing["object"] == "list"


def test_a_fleet_without_models_passes_models_through_to_an_engine() -> None:
    doc = json.loads(json.dumps(DOC))
    for r in doc["replicas"]:
        del r["models"]
    answers = _process(Router(parse_fleet(doc)), "/v1/models", "GET", None)
    assert not answers[-1].HasField("immediate_response")


def _routed_to(answers: list[Any]) -> str:
    """The cluster the router's answer routes to (on the headers, or on the body)."""
    routed = {h.header.key: h.header.raw_value.decode() for a in answers
              for kind in ("request_headers", "request_body") if a.HasField(kind)
              for h in getattr(a, kind).response.header_mutation.set_headers}
    return routed["x-gorgo-cluster"]


def test_other_paths_go_where_their_model_is_served_or_anywhere() -> None:
    """`/health` and the extra paths (embeddings, ...) were 404 model_not_found in a fleet of
    several models (no model in an inference body's place): now any replica, or one serving the
    model their body names."""
    router = Router(parse_fleet({**DOC, "routes": {"extra_paths": ["/v1/embeddings"]}}))
    assert _routed_to(_process(router, "/health", "GET", None))
    assert _routed_to(_process(router, "/v1/embeddings", "POST", b'{"input": "x"}'))
    assert _routed_to(_process(router, "/v1/embeddings", "POST", b"not json"))
    for model, cluster in (("alpha", "a1"), ("beta", "b1")):
        for _ in range(3):
            body = json.dumps({"model": model, "input": "x"}).encode()
            assert _routed_to(_process(router, "/v1/embeddings", "POST", body)) == cluster
    # past the inference paths' JSON container count, or not ASCII: the model was lost and the
    # request went to any replica (half to one of another model)
    body = json.dumps({"model": "alpha", "input": [[1, 2]] * 50_001}).encode()
    assert {_routed_to(_process(router, "/v1/embeddings", "POST", body)) for _ in range(6)} == {
        "a1"}
    for model in ("gamma", "älpha"):
        body = json.dumps({"model": model, "input": "x"}).encode()
        status, _, err = _immediate(_process(router, "/v1/embeddings", "POST", body))
        assert status == 404 and err["error"]["code"] == "model_not_found"


def _write(path: Path, doc: Any) -> None:
    """Atomically, as an operator's tooling (or a ConfigMap) replaces a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    os.replace(tmp, path)


def _server(tmp_path: Path) -> ExtProcServer:
    path = tmp_path / "fleet.yaml"
    _write(path, DOC)
    return ExtProcServer(Router(load_fleet(path)), admin_token=TOKEN, fleet_path=str(path),
                         cds_file=str(tmp_path / "cds.yaml"))


def _reloads(server: ExtProcServer, result: str) -> float:
    return sum(s.value for m in server.metrics.registry.collect() for s in m.samples
               if s.name == "gorgo_fleet_reloads_total" and s.labels == {"result": result})


def test_a_changed_file_reloads_and_a_broken_one_keeps_the_old_fleet(tmp_path: Path) -> None:
    server = _server(tmp_path)
    r = server.reloader
    r.poll()
    assert _reloads(server, "applied") == 0  # unchanged file: nothing to do
    doc = json.loads(json.dumps(DOC))
    doc["replicas"].append({"name": "a2", "region": "near", "address": "10.0.0.3:8000",
                            "engine": "sglang", "models": ["alpha"]})
    _write(r.path, doc)
    r.poll()
    assert server.router.state.names == ["a1", "b1", "a2"] and _reloads(server, "applied") == 1
    assert "a2" in (tmp_path / "cds.yaml").read_text()  # Envoy's clusters follow
    state = server.router.state
    for broken in ("replicas: [", {**doc, "policy": "nope"}):
        _write(r.path, broken)
        r.poll()
        assert server.router.state is state
    assert _reloads(server, "error") == 2
    assert "policy: unknown policy 'nope'" in (r.last_error or "")


def test_a_file_touched_or_copied_over_unchanged_keeps_the_admin_changes(tmp_path: Path) -> None:
    # Its inode, mtime or size changed, so the watch reloaded it and undid every admin change
    # (a replica drained for maintenance took traffic again after config management's copy).
    server = _server(tmp_path)
    r = server.reloader
    r.add({"name": "a2", "region": "near", "address": "10.0.0.3:8000", "engine": "sglang",
           "models": ["alpha"]})
    r.drain("a1", True)
    os.utime(r.path, ns=(1, 1))
    r.poll()
    _write(r.path, DOC)  # a new inode, the same document
    r.poll()
    assert server.router.state.names == ["a1", "b1", "a2"]
    assert list(server.router.state.draining) == [True, False, False]
    _write(r.path, {**DOC, "name": "edited"})  # an edit is the source of truth again
    r.poll()
    assert server.router.state.names == ["a1", "b1"] and server.router.spec.name == "edited"
    assert not server.router.state.draining.any()
    r.drain("a1", True)
    r.reload_file("SIGHUP")  # a SIGHUP reads it whatever it holds
    assert not server.router.state.draining.any()


def test_a_worker_that_took_on_its_peers_fleet_keeps_it_through_a_touch(tmp_path: Path) -> None:
    # It forgot what the file held, so a touch reloaded the file on it alone: its peer kept
    # the drain, it lost it.
    peer = _server(tmp_path)
    peer.reloader.drain("a1", True)
    path = peer.reloader.path
    worker = ExtProcServer(Router(load_fleet(path)), admin_token=TOKEN, fleet_path=str(path))
    shared = peer.reloader.document()
    worker.reloader.adopt(shared["document"], tuple(shared["file_stamp"]))
    os.utime(path, ns=(5, 5))
    for server in (peer, worker):
        server.reloader.poll()
        assert list(server.router.state.draining) == [True, False]


def test_an_edit_made_while_the_router_starts_is_taken_on(tmp_path: Path) -> None:
    # The file was read again after the router's fleet had been parsed and stamped then: the
    # edit was reported as the running document and never applied.
    path = tmp_path / "fleet.yaml"
    _write(path, DOC)
    discovery = DnsDiscovery(path)
    router = Router(discovery.spec)
    _write(path, {**DOC, "name": "edited"})
    server = ExtProcServer(router, admin_token=TOKEN, fleet_path=str(path),
                           discovery=discovery)
    assert yaml.safe_load(server.reloader.document()["document"])["name"] == "two-models"
    server.reloader.poll()
    assert server.router.spec.name == "edited"


def test_a_reload_that_raises_leaves_the_watch_reading_the_next_change(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = _server(tmp_path)
    r = server.reloader
    doc = json.loads(json.dumps(DOC))
    doc["replicas"][0]["prefill_rate"] = math.nan  # YAML's .nan: a FleetError, not a crash
    _write(r.path, doc)
    r.poll()
    assert "prefill_rate: expected a finite number" in (r.last_error or "")

    def broken(spec: object) -> None:
        raise RuntimeError("a bug in a reload")

    doc["replicas"][0]["prefill_rate"] = 9000.0
    _write(r.path, doc)
    with monkeypatch.context() as m:
        m.setattr(server.router, "reload", broken)
        r.poll()  # logged and counted, not raised: the watch task would end with it
    assert r.last_error == "a bug in a reload" and _reloads(server, "error") == 2
    doc["replicas"][0]["prefill_rate"] = 8000.0
    _write(r.path, doc)
    r.poll()
    assert server.router.spec.replicas[0].prefill_rate == 8000.0 and r.last_error is None


def test_the_cluster_envoy_fails_open_to_stays_after_a_reload_names_another_default(
        tmp_path: Path) -> None:
    # Envoy's bootstrap keeps the default cluster it was rendered with. A reload naming b1 the
    # default was taken on, and the next one could then remove a1: the clusters file lost the
    # cluster every request failing open goes to.
    server = _server(tmp_path)
    r = server.reloader
    cds = tmp_path / "cds.yaml"
    server.apply_fleet(server.router.spec)  # the clusters file as the start writes it
    doc = json.loads(json.dumps(DOC))
    doc["default_cluster"] = "b1"
    _write(r.path, doc)
    r.poll()
    assert server.router.spec.default_cluster == "b1" and r.last_error is None
    doc["replicas"] = doc["replicas"][1:]
    _write(r.path, doc)
    r.poll()
    assert _reloads(server, "error") == 1 and server.router.state.names == ["a1", "b1"]
    assert "'a1' is the cluster Envoy's routes send" in (r.last_error or "")
    assert "a1" in cds.read_text()


@pytest.mark.parametrize(("picker", "address"), [
    (False, "10.0.0.3:8000"), (False, None), (True, "10.0.0.3:8000")])
def test_without_a_clusters_file_a_replica_envoy_has_no_cluster_for_is_refused(
        tmp_path: Path, picker: bool, address: str | None) -> None:
    # Cluster mode's clusters are static in Envoy's bootstrap without --cds-file: an added
    # replica (or a moved address) was taken on, and every request routed there was Envoy's 503.
    path = tmp_path / "fleet.yaml"
    _write(path, {**DOC, "endpoint_picker": picker})
    server = ExtProcServer(Router(load_fleet(path)), admin_token=TOKEN, fleet_path=str(path))
    r = server.reloader
    doc = json.loads(json.dumps({**DOC, "endpoint_picker": picker}))
    if address is None:  # b1 moved
        doc["replicas"][1]["address"] = "10.0.0.9:8000"
    else:
        doc["replicas"].append({"name": "a2", "region": "near", "address": address,
                                "engine": "sglang", "models": ["alpha"]})
    if picker:  # Envoy reaches any address the router names
        r.apply_doc(doc, "test")
        assert server.router.state.names == ["a1", "b1", "a2"]
        return
    with pytest.raises(FleetError, match="is not a cluster of Envoy's bootstrap"):
        r.apply_doc(doc, "test")
    assert server.router.state.names == ["a1", "b1"]
    r.drain("a1", True)  # what the bootstrap has may still change
    r.remove("b1")
    assert server.router.state.names == ["a1"]


def test_a_peers_document_without_the_fail_open_cluster_is_refused(tmp_path: Path) -> None:
    # `PUT /admin/fleet/document` (a restarted worker taking on its peers' fleet, or any admin
    # caller) skipped the check the DELETE of the same replica got
    server = _server(tmp_path)
    server.apply_fleet(server.router.spec)
    doc = json.loads(json.dumps(DOC))
    doc["replicas"] = doc["replicas"][1:]
    with pytest.raises(FleetError, match="'a1' is the cluster Envoy's routes send"):
        server.reloader.adopt(yaml.safe_dump(doc), None)
    assert server.router.state.names == ["a1", "b1"]
    assert "a1" in (tmp_path / "cds.yaml").read_text()



def test_a_refused_reload_says_why_and_never_touches_the_clusters_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused for the fail-open cluster while the clusters file cannot be written: the refusal
    named the write (the file was staged before the fleet was checked), and every refusal
    wrote and removed a file beside Envoy's."""
    server = _server(tmp_path)
    server.cds_file = str(tmp_path / "gone" / "cds.yaml")
    doc = json.loads(json.dumps(DOC))
    doc["replicas"] = doc["replicas"][1:]
    with pytest.raises(FleetError, match="'a1' is the cluster Envoy's routes send"):
        server.reloader.apply_doc(doc, "test")
    staged: list[object] = []
    monkeypatch.setattr("extproc.main.stage_cds", lambda *a: staged.append(a))
    with pytest.raises(FleetError, match="'a1' is the cluster Envoy's routes send"):
        server.reloader.apply_doc(doc, "test")
    assert staged == [] and server.router.generation == 0


def test_a_restarted_worker_keeps_what_envoy_was_rendered_from(tmp_path: Path) -> None:
    """A worker of --workers started again read its file, edited since: it guarded the file's
    default cluster, not Envoy's, and refused its peers' fleet for a replica Envoy's static
    clusters hold but its file no longer listed."""
    rendered = parse_fleet(DOC)  # what the supervisor started with, and Envoy was rendered from
    path = tmp_path / "fleet.yaml"
    _write(path, {**DOC, "default_cluster": "b1"})
    worker = ExtProcServer(Router(load_fleet(path)), admin_token=TOKEN, fleet_path=str(path),
                           cds_file=str(tmp_path / "cds.yaml"), rendered=rendered)
    with pytest.raises(FleetError, match="'a1' is the cluster Envoy's routes send"):
        worker.reloader.apply_doc({**DOC, "default_cluster": "b1",
                                   "replicas": DOC["replicas"][1:]}, "test")
    _write(path, {**DOC, "replicas": DOC["replicas"][:1]})  # b1 left the file
    worker = ExtProcServer(Router(load_fleet(path)), admin_token=TOKEN, fleet_path=str(path),
                           rendered=rendered)
    worker.reloader.adopt(yaml.safe_dump(DOC), None)  # the peers' fleet, b1 added back
    assert worker.router.state.names == ["a1", "b1"]


def test_a_clusters_file_that_cannot_be_written_refuses_the_change(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The write failed after the router had taken the replica on: the admin call answered 200,
    # and Envoy never learnt of the cluster the router then sent requests to.
    server = _server(tmp_path)
    server.cds_file = str(tmp_path / "gone" / "cds.yaml")
    a2 = {"name": "a2", "region": "near", "address": "10.0.0.3:8000", "engine": "sglang",
          "models": ["alpha"]}
    with pytest.raises(FleetError, match=r"clusters file: cannot write .*gone/cds\.yaml"):
        server.reloader.add(a2)
    assert server.router.state.names == ["a1", "b1"] and server.router.generation == 0
    assert _reloads(server, "error") == 1
    (tmp_path / "gone").mkdir()
    # the rename can fail too (after the router took it on): counted, and put in place later
    real = os.replace
    monkeypatch.setattr("extproc.main.os.replace", lambda *a: (_ for _ in ()).throw(
        PermissionError(13, "Permission denied")))
    server.reloader.add(a2)
    assert server.router.state.names == ["a1", "b1", "a2"] and _reloads(server, "cds_error") == 1
    assert not list((tmp_path / "gone").iterdir())  # nothing half-written left behind
    monkeypatch.setattr("extproc.main.os.replace", real)
    monkeypatch.setattr("extproc.main.POLL_INTERVAL_S", 0.0)
    asyncio.run(_polls(server, 3))  # the fleet file's watch puts it in place
    assert "a2" in (tmp_path / "gone" / "cds.yaml").read_text()


async def _polls(server: ExtProcServer, n: int) -> None:
    task = asyncio.create_task(server._watch_fleet())
    for _ in range(n):
        await asyncio.sleep(0)
    task.cancel()


def test_admin_adds_drains_and_removes_a_replica_and_its_series(tmp_path: Path) -> None:
    server = _server(tmp_path)
    router = server.router

    async def body(call: Call) -> None:
        status, _ = await call("GET", "/admin/fleet")
        assert status == 401
        status, out = await call("POST", "/admin/fleet/replicas", headers=AUTH, data={
            "name": "a2", "region": "near", "address": "10.0.0.3:8000", "engine": "sglang",
            "models": ["alpha"]})
        assert status == 200 and out["added"] == ["a2"], out
        router.state.healthy[:] = True  # as its first probe would
        status, out = await call("POST", "/admin/fleet/replicas/a1/drain", headers=AUTH)
        assert status == 200 and [r["draining"] for r in out["replicas"]] == [True, False, False]
        server.metrics.decisions.labels("gorgo", "a1", "near", "alpha").inc()
        # a1's cluster is Envoy's fail-open default, which the clusters file must keep (it
        # was gone after this DELETE, and every request failing open a 503)
        status, out = await call("DELETE", "/admin/fleet/replicas/a1", headers=AUTH)
        assert status == 400 and "'a1' is the cluster Envoy's routes send" in out["error"][
            "message"]
        assert router.state.names == ["a1", "b1", "a2"]
        server.metrics.decisions.labels("gorgo", "b1", "near", "beta").inc()
        status, out = await call("DELETE", "/admin/fleet/replicas/b1", headers=AUTH)
        assert status == 200 and out["removed"] == ["b1"]
        assert all(s.labels.get("replica") != "b1" for m in server.metrics.registry.collect()
                   for s in m.samples)
        status, out = await call("DELETE", "/admin/fleet/replicas/zz", headers=AUTH)
        assert status == 404
        status, out = await call("POST", "/admin/fleet/replicas", headers=AUTH,
                                 data={"name": "bad", "region": "mars", "address": "x:1",
                                       "engine": "sglang", "models": ["alpha"]})
        assert status == 400 and "replicas[2].region: unknown region" in out["error"]["message"]
        assert router.state.names == ["a1", "a2"]

    app = make_app(server.metrics, router, TOKEN, None, server.reloader)
    with_admin(router, TOKEN, body, app)


def test_the_running_document_is_read_and_taken_on_whole(tmp_path: Path) -> None:
    """A restarted worker starts from the file: it takes on its peers' running document
    (`/admin/fleet/document`), the admin changes they took included, and the file they read."""
    server = _server(tmp_path)
    router = server.router

    async def body(call: Call) -> None:
        status, _ = await call("GET", "/admin/fleet/document")
        assert status == 401
        status, _ = await call("POST", "/admin/fleet/replicas/b1/drain", headers=AUTH)
        assert status == 200
        status, out = await call("GET", "/admin/fleet/document", headers=AUTH)
        assert status == 200 and len(out["file_stamp"]) == 3
        doc = yaml.safe_load(out["document"])
        assert [r.get("drain", False) for r in doc["replicas"]] == [False, True]
        doc["replicas"].append({"name": "a2", "region": "near", "address": "10.0.0.3:8000",
                                "engine": "sglang", "models": ["alpha"]})
        status, out = await call("PUT", "/admin/fleet/document", headers=AUTH, data={
            "document": yaml.safe_dump(doc), "file_stamp": None})
        assert status == 200 and out["added"] == ["a2"], out
        assert router.state.names == ["a1", "b1", "a2"] and bool(router.state.draining[1])
        for bad, field in (({"document": "replicas: ["}, "not valid YAML"),
                           ({"document": 3}, "expected {"),
                           ({"document": "{}", "file_stamp": [1, 2]}, "file_stamp"),
                           ({"document": "{}", "extra": 1}, "expected {"),
                           ({"document": yaml.safe_dump({**doc, "replicas": []})}, "replicas")):
            status, out = await call("PUT", "/admin/fleet/document", headers=AUTH, data=bad)
            assert status == 400 and field in out["error"]["message"], (bad, out)
        assert router.state.names == ["a1", "b1", "a2"]  # each refused whole

    app = make_app(server.metrics, router, TOKEN, None, server.reloader)
    with_admin(router, TOKEN, body, app)
