"""deploy/kubernetes/, checked without a cluster: every manifest parses; core kinds pass
kubernetes-validate's strict schemas; the InferencePool is checked against the v1 API's required
fields (its CRD's schema is not bundled); the fleets in the ConfigMaps load, discover the headless
Service, and their Envoy config is a fresh render that the typed classes and `envoy --mode
validate` accept; names, labels and ports agree across the manifests."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from extproc.main import add_arguments as extproc_arguments
from gorgo.core.discovery import dns_sources, parse_discovered
from gorgo.envoy_config import render_bootstrap
from gorgo.envoy_drain import add_arguments as drain_arguments
from gorgo.envoy_typed import check_bootstrap
from gorgo.harness.envoy_proc import envoy_binary

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "kubernetes"
K8S_VERSION = "1.33.0"
CRD_KINDS = {"InferencePool"}
# The InferencePool fields the v1 API reference (inference.networking.k8s.io/v1) requires.
INFERENCE_POOL_V1 = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "spec": {
            "type": "object", "additionalProperties": False,
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "properties": {
                "selector": {"type": "object", "required": ["matchLabels"],
                             "properties": {"matchLabels": {"type": "object"}}},
                "targetPorts": {"type": "array", "minItems": 1, "maxItems": 1, "items": {
                    "type": "object", "required": ["number"], "additionalProperties": False,
                    "properties": {"number": {"type": "integer", "minimum": 1,
                                              "maximum": 65535}}}},
                "endpointPickerRef": {
                    "type": "object", "required": ["name"], "additionalProperties": False,
                    "properties": {
                        "group": {"type": "string"}, "kind": {"type": "string"},
                        "name": {"type": "string", "minLength": 1},
                        "port": {"type": "object", "required": ["number"]},
                        "failureMode": {"enum": ["FailOpen", "FailClose"]}}},
            },
        },
    },
}
# The sidecar deployment's envoy.yaml is rendered with these arguments (its header says so).
SIDECAR_RENDER = {"listen": "0.0.0.0:10000", "extproc": "127.0.0.1:50051",
                  "admin": "127.0.0.1:9901"}


def _docs() -> list[tuple[str, dict[str, Any]]]:
    return [(p.name, d) for p in sorted(K8S.glob("*.yaml"))
            for d in yaml.safe_load_all(p.read_text()) if d]


def _find(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for _, d in _docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _fleet(configmap: str) -> dict[str, Any]:
    return yaml.safe_load(_find("ConfigMap", configmap)["data"]["fleet.yaml"])


def test_every_manifest_parses_and_core_kinds_validate() -> None:
    docs = _docs()
    assert {f for f, _ in docs} == {"model-servers.yaml", "endpoint-picker.yaml", "sidecar.yaml"}
    for name, doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']}: {exc.message} at "
                        f"{'.'.join(map(str, exc.path))}")
    for kind in ("Deployment", "Service", "ConfigMap", "InferencePool", "Namespace"):
        assert any(d["kind"] == kind for _, d in docs), kind


def test_a_typo_in_a_manifest_is_caught() -> None:
    doc = _find("Deployment", "gorgo-gateway")
    doc["spec"]["template"]["spec"]["containers"][0]["imagePullPolicie"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_inference_pool_names_the_router_and_the_model_servers() -> None:
    pool = _find("InferencePool", "vllm")
    jsonschema.validate(pool, INFERENCE_POOL_V1)
    ref = pool["spec"]["endpointPickerRef"]
    svc = _find("Service", ref["name"])
    assert ref["port"]["number"] in [p["port"] for p in svc["spec"]["ports"]]
    epp = _find("Deployment", "gorgo-epp")
    assert svc["spec"]["selector"] == epp["spec"]["template"]["metadata"]["labels"]
    args = _args(epp)
    assert args.port == ref["port"]["number"] and args.host == "0.0.0.0"
    vllm = _find("Deployment", "vllm")
    assert pool["spec"]["selector"]["matchLabels"] == vllm["spec"]["template"]["metadata"][
        "labels"]
    assert pool["spec"]["targetPorts"][0]["number"] == 8000


def _args(deployment: dict[str, Any]) -> argparse.Namespace:
    (router,) = [c for c in deployment["spec"]["template"]["spec"]["containers"]
                 if c["name"] == "extproc"]
    assert router["args"][0] == "extproc"
    parser = argparse.ArgumentParser()
    extproc_arguments(parser)
    args = parser.parse_args(router["args"][1:])
    mounts = {m["mountPath"] for m in router["volumeMounts"]}
    assert str(Path(args.fleet).parent) in mounts
    return args


@pytest.mark.parametrize("configmap", ["gorgo-epp-fleet", "gorgo-gateway"])
def test_fleets_discover_the_headless_service(configmap: str) -> None:
    raw = _fleet(configmap)
    (source,) = dns_sources(raw)
    headless = _find("Service", "vllm-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert source.dns == f"vllm-headless.{headless['metadata']['namespace']}.svc.cluster.local"
    assert source.port in [p["port"] for p in headless["spec"]["ports"]]
    spec = parse_discovered(raw, {source.dns: ["10.1.0.7", "10.1.0.8"]})
    assert [r.address for r in spec.replicas] == ["10.1.0.7:8000", "10.1.0.8:8000"]
    assert spec.endpoint_picker


def _sidecar_envoy() -> str:
    return _find("ConfigMap", "gorgo-gateway")["data"]["envoy.yaml"]


@pytest.mark.slow  # a second or more: out of test-fast
def test_sidecar_envoy_config_is_a_fresh_typed_render() -> None:
    spec = parse_discovered(_fleet("gorgo-gateway"))
    fresh = render_bootstrap(spec, **SIDECAR_RENDER)
    shipped = yaml.safe_load(_sidecar_envoy())
    assert shipped == fresh, "deploy/kubernetes/sidecar.yaml: re-render envoy.yaml (header)"
    check_bootstrap(shipped)
    clusters = {c["name"]: c for c in shipped["static_resources"]["clusters"]}
    assert clusters["vllm"]["type"] == "STRICT_DNS"  # the fail-open default over the name
    assert clusters["picker_original_dst"]["type"] == "ORIGINAL_DST"
    gateway = _find("Deployment", "gorgo-gateway")
    args = _args(gateway)
    assert f"127.0.0.1:{args.port}" == SIDECAR_RENDER["extproc"]


def _container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    (c,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return c


# Runs `envoy --mode validate`, with the Deployment's own Envoy arguments.
@pytest.mark.envoy
def test_sidecar_envoy_config_validates(tmp_path: Path) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(_sidecar_envoy())
    args = _container(_find("Deployment", "gorgo-gateway"), "envoy")["args"]
    assert args[:2] == ["-c", "/etc/gorgo/envoy.yaml"]
    out = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), *args[2:],
                          "--base-id", "4545"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_sidecar_pod_stops_envoy_only_once_drained() -> None:
    """Envoy exits at once on SIGTERM: its preStop hook waits for the file the router's hook
    (`gorgo envoy-drain`, against this Envoy's admin) writes once drained, within the grace."""
    gateway = _find("Deployment", "gorgo-gateway")
    pod = gateway["spec"]["template"]["spec"]
    envoy, router = _container(gateway, "envoy"), _container(gateway, "extproc")
    hook = router["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[:2] == ["gorgo", "envoy-drain"]
    parser = argparse.ArgumentParser()
    drain_arguments(parser)
    drain = parser.parse_args(hook[2:])
    assert drain.admin == SIDECAR_RENDER["admin"]
    wait = envoy["lifecycle"]["preStop"]["exec"]["command"]
    assert wait[:2] == ["sh", "-c"] and f"[ -e {drain.done_file} ]" in wait[2]
    envoy_wait_s = int(wait[2].split("$(seq ")[1].split(")")[0])
    assert drain.timeout_s < envoy_wait_s < pod["terminationGracePeriodSeconds"]
    # the done file lies on one volume both containers mount
    mounts = [{m["name"]: m["mountPath"] for m in c["volumeMounts"]} for c in (envoy, router)]
    (shared,) = [v for v in pod["volumes"] if "emptyDir" in v]
    assert all(m[shared["name"]] == str(drain.done_file.parent) for m in mounts)
